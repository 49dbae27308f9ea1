#!/usr/bin/env bash
# README's test command: set up (skipped when done), lint, then the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
"$MEMOPT_VENV/bin/ruff" check .
"$MEMOPT_VENV/bin/ruff" format --check optimum_memopt tests examples benchmarks scripts
exec "$MEMOPT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200 "$@"
