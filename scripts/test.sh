#!/usr/bin/env bash
# README's test command: set up (skipped when done), lint, then
#   1. the whole suite on the ORT stack (constraints.txt);
#   2. the compatibility slice on the newest transformers in the ORT stack's range;
#   3. the whole suite on the modern stack (constraints-torch.txt: current torch, transformers 5.x, the torch backend).
# With arguments, only the ORT stack's pytest runs, with them (MEMOPT_STACK=torch: the modern stack's).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ "$#" -gt 0 ]; then
  source "$ROOT/scripts/setup_env.sh"
  exec "$MEMOPT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200 "$@"
fi
MEMOPT_STACK=ort source "$ROOT/scripts/setup_env.sh"
ORT_VENV="$MEMOPT_VENV"
"$ORT_VENV/bin/ruff" check .
"$ORT_VENV/bin/ruff" format --check optimum_memopt tests examples benchmarks scripts
echo "[test] 1/3: the ORT stack ($ORT_VENV)"
"$ORT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200
echo "[test] 2/3: the compatibility slice on the newest transformers in the ORT stack's range"
"$ORT_VENV/bin/python" scripts/compat.py --versions "$("$ORT_VENV/bin/python" scripts/compat.py --newest)" --no_write
unset MEMOPT_VENV
MEMOPT_STACK=torch source "$ROOT/scripts/setup_env.sh"
echo "[test] 3/3: the modern stack ($MEMOPT_VENV)"
"$MEMOPT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200
