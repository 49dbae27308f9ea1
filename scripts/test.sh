#!/usr/bin/env bash
# README's test command: set up (skipped when done), then the whole test suite.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$MEMOPT_VENV/bin/python" -m pytest -p no:cacheprovider -rfEs --timeout 1200 "$@"
