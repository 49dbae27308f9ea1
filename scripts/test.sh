#!/usr/bin/env bash
# README's test command: set up (skipped when done), lint, the whole test suite on the pinned set and, when
# called without arguments (as CI calls it), the compatibility slice on the newest transformers in range.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
"$MEMOPT_VENV/bin/ruff" check .
"$MEMOPT_VENV/bin/ruff" format --check optimum_memopt tests examples benchmarks scripts
if [ "$#" -gt 0 ]; then
  exec "$MEMOPT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200 "$@"
fi
"$MEMOPT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200
echo "[compat] the pinned set passed; now the slice on the newest transformers in the supported range"
"$MEMOPT_VENV/bin/python" scripts/compat.py --versions "$("$MEMOPT_VENV/bin/python" scripts/compat.py --newest)" --no_write
