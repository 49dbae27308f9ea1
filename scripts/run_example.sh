#!/usr/bin/env bash
# README's main command: set up (skipped when done), then the GLUE recipe's offline default
# (a small DeBERTa-v2 built in code, a tokenizer trained locally, generated data) through ORTModule,
# printing the memory-optimizer plan table, input density and memory phases. Extra arguments
# are passed to examples/run_glue/run_glue.py. MEMOPT_STACK=torch runs it on the modern stack (.venv-torch), where
# the torch backend applies the same plan.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$MEMOPT_VENV/bin/python" examples/run_glue/run_glue.py "$@"
