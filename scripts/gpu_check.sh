#!/usr/bin/env bash
# The GPU kit: every GPU test and the GPU benchmarks at GPU size, one report file (scripts/gpu_check.py says what).
# For a machine with a CUDA GPU where torch and transformers are installed already (other minor versions than the
# pins allowed) and nothing can be downloaded: the plugin runs from this checkout (PYTHONPATH), nothing is installed.
#   bash scripts/gpu_check.sh                  # the report: gpu_check/gpu_check.md, or $OUT/gpu_check.md where set
#   bash scripts/gpu_check.sh --rounds 3       # arguments go to scripts/gpu_check.py
# About 15 minutes on one H100 with the defaults. PYTHON picks the interpreter (default: python3).
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
exec "$PY" scripts/gpu_check.py "$@"
