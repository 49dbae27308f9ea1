#!/usr/bin/env bash
# README's test command (what CI runs): set up both stacks (skipped when done), lint, then
#   1. the ORT stack's tests (constraints.txt: torch 2.4, onnxruntime-training): those marked `ort` or `both_stacks`;
#   2. the compatibility slice on the newest transformers in the ORT stack's range;
#   3. the modern stack's tests (constraints-torch.txt: current torch, transformers 5.x, the torch backend): all others.
# Both tiers each time, on pytest-xdist's workers (one a core; the launches one at a time on one of them), the slowest
# tests listed at the end. What each tier holds and how to run one file, tier or stack: tests/README.md.
#
#   bash scripts/test.sh                 everything, as above
#   bash scripts/test.sh fast            the fast tier (`-m "not slow"`) on both stacks: the edit loop, a few minutes
#   bash scripts/test.sh slow            the slow tier on both stacks
#   bash scripts/test.sh ARGS...         pytest ARGS on the ORT stack, serially (MEMOPT_STACK=torch: the modern
#                                        stack's; add `-n auto --dist loadgroup` for the workers)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTEST=(-p no:cacheprovider -rfEs --timeout 1200)
PARALLEL=(-n auto --dist loadgroup --durations 25 --durations-min 1)
TIER=()
case "${1:-}" in
  fast) TIER=(-m "not slow"); shift ;;
  slow) TIER=(-m slow); shift ;;
  "") ;;
  *)
    source "$ROOT/scripts/setup_env.sh"
    exec "$MEMOPT_VENV/bin/python" -m pytest "${PYTEST[@]}" "$@"
    ;;
esac
if [ "$#" -gt 0 ]; then
  echo "[test] '$1' after the tier: give pytest's arguments alone (MEMOPT_STACK=torch bash scripts/test.sh tests/test_plans.py)" >&2
  exit 2
fi
start=$SECONDS
MEMOPT_STACK=ort source "$ROOT/scripts/setup_env.sh"
ORT_VENV="$MEMOPT_VENV"
unset MEMOPT_VENV
MEMOPT_STACK=torch source "$ROOT/scripts/setup_env.sh"
TORCH_VENV="$MEMOPT_VENV"
"$ORT_VENV/bin/ruff" check .
"$ORT_VENV/bin/ruff" format --check optimum_memopt tests examples benchmarks scripts
echo "[test] 1/3: the ORT stack ($ORT_VENV) ${TIER[*]}"
"$ORT_VENV/bin/python" -m pytest "${PYTEST[@]}" "${PARALLEL[@]}" "${TIER[@]}"
echo "[test] $((SECONDS - start)) s so far"
if [ "${#TIER[@]}" -eq 0 ]; then
  echo "[test] 2/3: the compatibility slice on the newest transformers in the ORT stack's range"
  "$ORT_VENV/bin/python" scripts/compat.py --versions "$("$ORT_VENV/bin/python" scripts/compat.py --newest)" --no_write
  echo "[test] $((SECONDS - start)) s so far"
fi
echo "[test] 3/3: the modern stack ($TORCH_VENV) ${TIER[*]}"
"$TORCH_VENV/bin/python" -m pytest "${PYTEST[@]}" "${PARALLEL[@]}" "${TIER[@]}"
echo "[test] done in $((SECONDS - start)) s"
