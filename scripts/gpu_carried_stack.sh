#!/usr/bin/env bash
# On a lent GPU machine that reaches no registry: install CI's transformers / PEFT / accelerate / DeepSpeed from wheels
# carried in `.whl/` (git-ignored; how to fill it: docs/STACK.md, "Carrying CI's stack to a lent GPU"), over the
# image's torch. Nothing is installed where `.whl/` is absent. Then the environment the GPU kit's bitwise tests need.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY="${PYTHON:-python3}"
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --find-links .whl transformers==5.23.0 huggingface_hub==2.4.0 peft==0.21.2 \
        accelerate==1.15.0 pydantic hjson py-cpuinfo msgpack ninja nvidia-ml-py
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation .whl/deepspeed-0.19.8.tar.gz
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
