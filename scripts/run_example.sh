#!/usr/bin/env bash
# README's main command: set up (skipped when done), then the causal-LM recipe's offline default on the modern stack
# (.venv-torch): a small Llama built in code, a tokenizer trained locally, generated text; LoRA, and
# `--memory_opt_config auto --memory_budget_mb 150` (the torch backend chooses the least
# recompute that fits, from a dry run of step one that step one checks), printing the choice, the plan table and the
# memory phases. Extra arguments are passed to examples/run_clm/run_clm.py (they replace its offline defaults).
# MEMOPT_STACK=ort runs the ORT stack's main job instead: the GLUE recipe's offline default through ORTModule
# (examples/run_glue/run_glue.py; docs/ort-stack.md).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MEMOPT_STACK="${MEMOPT_STACK:-torch}"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
if [ "$MEMOPT_STACK" = ort ]; then
  exec "$MEMOPT_VENV/bin/python" examples/run_glue/run_glue.py "$@"
fi
exec "$MEMOPT_VENV/bin/python" examples/run_clm/run_clm.py "$@"
