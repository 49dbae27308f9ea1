#!/usr/bin/env bash
# Creates (or reuses) a virtual environment with one of the project's two pinned stacks. Every step is skipped
# when already done, so a second call returns in seconds. Sourced by scripts/run_example.sh and scripts/test.sh.
#
#   MEMOPT_STACK=ort (default): .venv, constraints.txt, torch 2.4 + onnxruntime-training (both backends' code,
#                               the ORT backend by default), and ORTModule's C++ extensions built once.
#   MEMOPT_STACK=torch:         .venv-torch, constraints-torch.txt, current torch and transformers 5.x, no ORT:
#                               the torch backend (`--memory_opt_backend torch`, the default there).
#   MEMOPT_PYTHON, MEMOPT_VENV, MEMOPT_CONSTRAINTS: another interpreter, venv or constraints file (scripts/compat.py
#                               --pythons uses them for the other Python versions).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK="${MEMOPT_STACK:-ort}"
case "$STACK" in
  ort) VENV="${MEMOPT_VENV:-$ROOT/.venv}"; CONSTRAINTS="${MEMOPT_CONSTRAINTS:-$ROOT/constraints.txt}"; EXTRAS="cpu,deepspeed,dev,dev-ort" ;;
  torch) VENV="${MEMOPT_VENV:-$ROOT/.venv-torch}"; CONSTRAINTS="${MEMOPT_CONSTRAINTS:-$ROOT/constraints-torch.txt}"; EXTRAS="torch,deepspeed,dev,dev-torch" ;;
  *) echo "[setup] MEMOPT_STACK is '$STACK'; expected 'ort' or 'torch'" >&2; exit 2 ;;
esac
# The wheels of onnxruntime-training 1.19.2 exist for CPython 3.8-3.12; the modern stack's torch file on this
# machine is for 3.11.
if [ -z "${MEMOPT_PYTHON:-}" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then MEMOPT_PYTHON="$candidate"; break; fi
  done
fi
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV ($STACK stack) with $MEMOPT_PYTHON"
  "$MEMOPT_PYTHON" -m venv "$VENV"
fi

want="$(cat "$CONSTRAINTS" "$ROOT/setup.cfg" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"
stamp="$VENV/.memopt-installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing the pinned $STACK stack (first time: a few minutes)"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  "$PY" -m pip install -q -c "$CONSTRAINTS" pip setuptools wheel ninja
  # torch first: DeepSpeed ships as an sdist whose build imports torch, so it is built
  # without isolation against this torch instead of pulling the newest one into a build env.
  "$PY" -m pip install -q -c "$CONSTRAINTS" torch
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-build-isolation -c "$CONSTRAINTS" -e "$ROOT[$EXTRAS]"
  if [ "$STACK" = ort ]; then
    # optimum's ORTTrainer imports ORTModule from torch-ort, which declares the CUDA build `onnxruntime-training`;
    # the CPU build installed here provides the same module, so torch-ort goes in without its requirements.
    "$PY" -m pip install -q --no-deps -c "$CONSTRAINTS" torch-ort
  else
    # TRL 1.16 declares datasets>=4.7; with the pinned datasets 3.6 its SFTTrainer runs (docs/STACK.md), so it goes
    # in without its requirements (the rest of them are in the constraints).
    "$PY" -m pip install -q --no-deps -c "$CONSTRAINTS" trl
  fi
  echo "$want" > "$stamp"
fi

if [ "$STACK" = ort ]; then
  # ORTModule refuses to start until its torch C++ extensions are built for this torch.
  ext_dir="$("$PY" -c 'import os, onnxruntime.training.ortmodule.torch_cpp_extensions as m; print(os.path.dirname(m.__file__))' 2>/dev/null || true)"
  if [ -z "$ext_dir" ]; then
    echo "[setup] onnxruntime-training is not importable from $VENV" >&2
    exit 1
  fi
  if ! "$PY" -c 'import sys; from optimum_memopt.backends.ort import extensions_built; sys.exit(0 if extensions_built() else 1)'; then
    echo "[setup] building ORTModule's C++ extensions (first time: ~4 minutes on 2 cores)"
    # Beside them, DeepSpeed's shared-memory all-reduce op, which DeepSpeed compiles (torch's JIT loader, cached under
    # ~/.cache/torch_extensions) the first time its communication starts on the CPU, as in a ZeRO run launched as a
    # user launches it: 50-110 s of both cores inside that run otherwise. ORTModule's first extension is one file, a
    # core idle meanwhile. Not built here: DeepSpeed builds it when first needed, as before.
    shm_log="$VENV/.memopt-deepspeed-shm.log"
    "$PY" -c 'import importlib; importlib.import_module("deepspeed.comm.torch").build_shm_op()' > "$shm_log" 2>&1 &
    shm=$!
    (cd "$VENV" && MAX_JOBS="${MAX_JOBS:-$(nproc)}" "$PY" -m onnxruntime.training.ortmodule.torch_cpp_extensions.install)
    if wait "$shm" && grep -q "built successfully" "$shm_log"; then
      echo "[setup] DeepSpeed's shared-memory all-reduce op built beside them"
    else
      echo "[setup] DeepSpeed's shared-memory all-reduce op not built here (DeepSpeed builds it when first needed): $shm_log"
    fi
  fi
fi
export MEMOPT_VENV="$VENV"
