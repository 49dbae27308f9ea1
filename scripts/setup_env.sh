#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment with the pinned stack and builds
# ORTModule's C++ extensions. Every step is skipped when already done, so a second call
# returns in seconds. Sourced by scripts/run_example.sh and scripts/test.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MEMOPT_VENV:-$ROOT/.venv}"
# The wheels of onnxruntime-training 1.19.2 exist for CPython 3.8-3.12.
if [ -z "${MEMOPT_PYTHON:-}" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then MEMOPT_PYTHON="$candidate"; break; fi
  done
fi
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV with $MEMOPT_PYTHON"
  "$MEMOPT_PYTHON" -m venv "$VENV"
fi

want="$(cat "$ROOT/constraints.txt" "$ROOT/setup.cfg" | sha256sum | cut -d' ' -f1)"
stamp="$VENV/.memopt-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the pinned stack (first time: a few minutes, ~3 GB of torch + CUDA runtime wheels)"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$PY" -m pip install -q -c "$ROOT/constraints.txt" pip setuptools wheel ninja
  # torch first: DeepSpeed ships as an sdist whose build imports torch, so it is built
  # without isolation against this torch instead of pulling the newest one into a build env.
  "$PY" -m pip install -q -c "$ROOT/constraints.txt" torch
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-build-isolation -c "$ROOT/constraints.txt" \
    -e "$ROOT[cpu,deepspeed,dev]"
  echo "$want" > "$stamp"
fi

# ORTModule refuses to start until its torch C++ extensions are built for this torch.
ext_dir="$("$PY" -c 'import os, onnxruntime.training.ortmodule.torch_cpp_extensions as m; print(os.path.dirname(m.__file__))' 2>/dev/null || true)"
if [ -z "$ext_dir" ]; then
  echo "[setup] onnxruntime-training is not importable from $VENV" >&2
  exit 1
fi
if ! "$PY" -c 'import sys; from optimum_memopt.backends.ort import extensions_built; sys.exit(0 if extensions_built() else 1)'; then
  echo "[setup] building ORTModule's C++ extensions (first time: ~4 minutes on 2 cores)"
  (cd "$VENV" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" -m onnxruntime.training.ortmodule.torch_cpp_extensions.install)
fi
export MEMOPT_VENV="$VENV"
