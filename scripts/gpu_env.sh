# Sourced by the scripts run on a lent card (gpu_check.sh, gpu_next.sh): the checkout as the working directory and
# on PYTHONPATH (nothing installed), the interpreter in PY (PYTHON, default python3), nothing fetched, output
# unbuffered (a call cut short keeps what it printed).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false WANDB_DISABLED=true
