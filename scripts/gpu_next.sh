#!/usr/bin/env bash
# The next lent card's runs for issues 53 and 55, most important first, in one call (docs/GPU.md, "The next card's
# runs"): each run is started only where its usual length fits the time left before the deadline, writes its figures
# under $OUT/next (or gpu_next/) as it ends, and one cut short keeps what it wrote. What each run measures and how to
# read it: docs/GPU.md. Nothing is installed; the plugin runs from this checkout (PYTHONPATH).
#   bash scripts/gpu_next.sh                     # from the first run, until 560 s have passed
#   bash scripts/gpu_next.sh --from 3            # a second call: the runs from the third on
#   bash scripts/gpu_next.sh --deadline 300      # seconds from the start that no run may be expected to pass
#   bash scripts/gpu_next.sh --tiny              # the same queue at tiny size on the CPU: the script's own check
# The runs (seconds each on an H200, as measured on 2026-11-28):
#   1 (60)  the GPU tests of planning again for a longer batch, by a dry run and by measuring (issue 53)
#   2 (420) 8B LoRA at 65,536 tokens: auto under an H100's budget beside level 1 + Loss+, 3 steady steps each: its
#           choice with attention priced (231e40e), its speed and its start (issue 53, points 3 and 4)
#   3 (240) 8B LoRA at 8,192 tokens: eager, level 1 + Loss+, auto where eager fits and under 25,000 MiB (its start)
#   4 (180) 8B: step one at 2,048 tokens, then 8,192: the re-planned step's check, no step over 25,000 MiB
#   5 (90)  Liger's fused linear cross-entropy row at 8,192 tokens (where .whl was carried and installed)
#   6 (60)  the offload tests: bitwise, lower, counted (issue 55)
# With Liger's wheel carried (`carry: [".whl"]`), begin the call with docs/GPU.md's pip line.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"

from=1
deadline=560
tiny=0
while [ "$#" -gt 0 ]; do
  case "$1" in
    --from) from="$2"; shift 2 ;;
    --deadline) deadline="$2"; shift 2 ;;
    --tiny) tiny=1; shift ;;
    *) echo "[next] unknown argument '$1': the arguments are --from N, --deadline SECONDS, --tiny" >&2; exit 2 ;;
  esac
done
DIR="${OUT:-$ROOT/gpu_next}/next"
mkdir -p "$DIR"
start=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  free -g; "$PY" -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
  git -C "$ROOT" log --oneline -1 2>/dev/null; } > "$DIR/machine.txt" 2>&1
cat "$DIR/machine.txt"

if [ "$tiny" = 1 ]; then
  SETUP=(--tiny --setups tiny-lora)
  PRESET=(--preset tiny --lora_r 4 --lora_dropout 0.05 --first_seq 64 --seq 256 --samples 8)
  BUDGETS_BIG=(--budgets_mb 1000) BUDGETS_8K=(--budgets_mb 1000 60) BUDGET=60
else
  SETUP=(--setups llama-3.1-8b-lora)
  PRESET=(--preset llama-3.1-8b --lora_r 16 --lora_dropout 0.05 --weights_dtype bfloat16 --bf16 --first_seq 2048
          --seq 8192 --samples 16)
  BUDGETS_BIG=(--budgets_mb 76851) BUDGETS_8K=(--budgets_mb 76851 25000) BUDGET=25000
fi
SEQ_LONG=65536 SEQ=8192
[ "$tiny" = 1 ] && SEQ_LONG=256 SEQ=256

# run N SECONDS NAME COMMAND...: started where SECONDS fit before the deadline, held to the time left
run() {
  local n="$1" usual="$2" name="$3"
  shift 3
  [ "$n" -lt "$from" ] && return
  local left=$((deadline - (SECONDS - start)))
  if [ "$usual" -gt "$left" ]; then
    echo "[next] $n $name: not started (about $usual s, $left s left): bash scripts/gpu_next.sh --from $n" | tee -a "$DIR/summary.txt"
    return
  fi
  echo "[next] $n $name: started at $((SECONDS - start)) s" | tee -a "$DIR/summary.txt"
  local began=$SECONDS
  timeout --signal=INT --kill-after=20 "$left" "$@" > "$DIR/$n-$name.log" 2>&1
  local rc=$?
  echo "[next] $n $name: rc $rc in $((SECONDS - began)) s (log $n-$name.log)" | tee -a "$DIR/summary.txt"
  tail -n 15 "$DIR/$n-$name.log"
}

run 1 60 longer_batch "$PY" -m pytest -p no:cacheprovider -q -rfEs tests/test_gpu_torch.py -k longer_batch
run 2 420 real_65k "$PY" benchmarks/real_size.py "${SETUP[@]}" --seqs "$SEQ_LONG" "${BUDGETS_BIG[@]}" \
  --recipes 'level 1 + Loss+' --no_file_rows --rounds 1 --steps 6 --out "$DIR/real_65k.json"
run 3 240 real_8k "$PY" benchmarks/real_size.py "${SETUP[@]}" --seqs "$SEQ" "${BUDGETS_8K[@]}" \
  --recipes eager 'level 1 + Loss+' --no_file_rows --rounds 1 --steps 6 --out "$DIR/real_8k.json"
run 4 180 longer "$PY" benchmarks/decoder.py "${PRESET[@]}" --optim adamw_torch_fused --dataloader_num_workers 0 \
  --per_device_train_batch_size 1 --max_steps 6 --logging_steps 1 --report_to none --output_dir "$DIR/longer_run" \
  --memory_opt_backend torch --memory_opt_config auto --memory_budget_mb "$BUDGET"
if "$PY" -c "import liger_kernel" 2>/dev/null; then
  run 5 90 liger "$PY" benchmarks/real_size.py "${SETUP[@]}" --seqs "$SEQ" --budgets 0 --rounds 1 --steps 6 \
    --recipes "checkpointing + Liger's fused linear cross-entropy" --out "$DIR/real_8k_liger.json"
else
  [ 5 -ge "$from" ] && echo "[next] 5 liger: liger-kernel not importable (carry .whl: docs/GPU.md)" | tee -a "$DIR/summary.txt"
fi
run 6 60 offload "$PY" -m pytest -p no:cacheprovider -q -rfEs tests/test_gpu_torch.py -k offload
echo "[next] done in $((SECONDS - start)) s; figures in $DIR"
