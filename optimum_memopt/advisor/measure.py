"""Measuring one configuration: the user's own training script, run in a fresh process with a
few flags overridden, reports its peak memory and step time.

A fresh process per configuration is what makes the CPU figure honest (memory a previous run
freed stays resident in the same process) and what isolates an out-of-memory trial.

In the child, `MeasureCallback` (added by `MemoptTrainerMixin` when `MEMOPT_MEASURE_OUT` is set)
records, on rank 0: the memory level when training begins (model built, data ready), the peak
during training (CUDA: max allocated; CPU: resident high-water mark) and each step's duration.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from transformers import TrainerCallback

from ..memory import MemoryMeter

ENV_OUT = "MEMOPT_MEASURE_OUT"
ENV_CHILD = "MEMOPT_PROBE_CHILD"
WARMUP_STEPS = 2  # the first step includes ORT's export and session build


class MeasureCallback(TrainerCallback):
    def __init__(self, path: str):
        self.path = path
        self.meter = None
        self.baseline_mb = None
        self.times: List[float] = []
        self._t0 = None

    def on_train_begin(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        self.meter = MemoryMeter()
        self.baseline_mb = self.meter.read().current_mb
        self.meter.reset_peak()

    def on_step_begin(self, args, state, control, **kwargs):
        if self.meter is not None:
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self.meter is not None and self._t0 is not None:
            self.times.append(time.perf_counter() - self._t0)

    def on_train_end(self, args, state, control, **kwargs):
        if self.meter is None:
            return
        reading = self.meter.read()
        plans_file = os.path.join(args.output_dir, "memory_plans.json")
        result = {
            "device": reading.device,
            "baseline_mb": self.baseline_mb,
            "peak_mb": reading.peak_mb,
            "peak_above_baseline_mb": reading.peak_mb - (self.baseline_mb if reading.device == "cpu" else 0.0),
            "step_times": self.times,
            "batch_size": args.per_device_train_batch_size,
            "peak_resets": self.meter.peak_resets,
            "plans": json.load(open(plans_file)) if os.path.exists(plans_file) else None,
        }
        with open(self.path, "w") as f:
            json.dump(result, f)


@dataclass
class Measurement:
    """One configuration of one script at one batch size."""

    label: str
    flags: List[str]
    batch_size: int
    ok: bool
    peak_mb: Optional[float] = None  # CUDA: max allocated; CPU: resident peak above the level before training
    step_time_s: Optional[float] = None  # median over the steps after the warm-up
    samples_per_s: Optional[float] = None
    oom: bool = False
    error: Optional[str] = None
    wall_s: float = 0.0
    device: Optional[str] = None
    plans: Optional[dict] = field(default=None, repr=False)

    def as_dict(self) -> Dict:
        d = asdict(self)
        d.pop("plans")
        return d


def memory_flags(use_ort: bool = True, config: str = "", level: int = 0, extra: Sequence[str] = ()) -> List[str]:
    """Flags that pin one memory configuration, whatever the user's command line said."""
    if not use_ort:
        return ["--use_ort", "false", "--memory_opt_level", "0", "--memory_opt_config", "", *extra]
    return ["--use_ort", "true", "--memory_opt_level", str(level), "--memory_opt_config", config, *extra]


def run_child(script_argv: Sequence[str], label: str, flags: Sequence[str], batch_size: int, steps: int = 6,
              timeout: float = 1800, python: str = sys.executable) -> Measurement:
    """Run ``python script_argv... <overrides>`` and read what it measured.

    argparse keeps the last occurrence of a flag, so the overrides appended here win over the
    user's own values.
    """
    work = tempfile.mkdtemp(prefix="memopt-probe-")
    out_json = os.path.join(work, "measure.json")
    overrides = [
        "--output_dir", os.path.join(work, "run"), "--overwrite_output_dir", "--do_train", "--do_eval", "false",
        "--max_steps", str(steps), "--per_device_train_batch_size", str(batch_size), "--save_strategy", "no",
        "--report_to", "none", "--logging_steps", "100000", "--disable_tqdm", "true", "--log_memory_plans", "true",
        "--print_memory_stats", "false", "--print_input_density", "false", *flags,
    ]
    env = {**os.environ, ENV_OUT: out_json, ENV_CHILD: "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        res = subprocess.run([python, *script_argv, *overrides], capture_output=True, text=True, timeout=timeout, env=env)
        wall = time.perf_counter() - t0
        if res.returncode != 0 or not os.path.exists(out_json):
            tail = (res.stderr or res.stdout)[-2000:]
            oom = "out of memory" in tail.lower() or res.returncode in (-9, 137)
            return Measurement(label, list(flags), batch_size, False, oom=oom, error=tail.strip().splitlines()[-1] if tail.strip() else f"exit {res.returncode}", wall_s=wall)
        with open(out_json) as f:
            data = json.load(f)
        times = data["step_times"][WARMUP_STEPS:] or data["step_times"]
        step = statistics.median(times) if times else None
        return Measurement(label, list(flags), batch_size, True, peak_mb=data["peak_above_baseline_mb"], step_time_s=step,
                           samples_per_s=(batch_size / step) if step else None, wall_s=wall, device=data["device"],
                           plans=data["plans"])
    except subprocess.TimeoutExpired:
        return Measurement(label, list(flags), batch_size, False, error=f"timed out after {timeout:.0f} s",
                           wall_s=time.perf_counter() - t0)
    finally:
        shutil.rmtree(work, ignore_errors=True)
