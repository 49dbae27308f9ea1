"""Measuring one configuration: the user's own training script, run in a fresh process with a few flags
overridden, reports its peak memory, its step times and the backend's plan report.

A fresh process per configuration is what makes the CPU figure honest (memory a previous run freed
stays with the process) and what isolates an out-of-memory trial.

The child is told what to do by a flag, `--memory_measure_out PATH` (a `MemoptTrainingArguments`
field): the trainer hook then adds `MeasureCallback`, which records on rank 0 the memory in use when
training begins (model built, data ready), the peak during training and each step's duration, and
writes them with the plan report to PATH as JSON. The peak is counted as `auto` counts its budget: CUDA's
max allocated; on the CPU, on the modern stack (the torch backend, or none), the process's tensor
storages counted after every op of the whole training (`backends.torch.measure.live`: the unit CUDA
counts in, weights included); on the ORT stack, whose ORTModule allocates outside torch's tensors, the
allocator's bytes in use above their level at training's start (mallinfo2; ORT's CPU arena off), with
the resident peak beside it.
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
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from transformers import TrainerCallback

from ..callbacks.base import current_model
from ..memory import MemoryMeter, training_device
from ..plans import PlanReport
from ..transformers_releases import overwrite_output_dir_flag

WARMUP_STEPS = 2  # the first step includes ORT's export and session build


class MeasureCallback(TrainerCallback):
    def __init__(self, path: str, trainer=None):
        self.path = path
        self.trainer = trainer
        self.meter = None
        self.baseline = None
        self.times: List[float] = []
        # the steps `auto` measured, checked or reported on (its choice settled as the last of them ended): no
        # step of a run's speed (`run_child`); None until it settled
        self.unsettled_steps: Optional[int] = None
        self._t0 = None
        self._counting = None  # the dispatch mode counting tensor storages through training (`_storages`)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        device = training_device(args, current_model(self.trainer, model))
        self.meter = self._storages(current_model(self.trainer, model)) if device == "cpu" else None
        if self.meter is None:
            self.meter = MemoryMeter(device)
        self.meter.reset_peak()
        self.baseline = self.meter.read()

    def _storages(self, model):
        """On the modern stack (the torch backend usable, ORT not the run's backend): a meter of the process's tensor
        storages, counted after every op until training ends (`_counting`); else None."""
        from ..backends.torch import torch_problem

        backend = getattr(self.trainer, "memopt_backend", None)
        if torch_problem() is not None or (backend is not None and backend.name == "ort"):
            return None
        from ..backends.torch.measure.live import LiveMeter, live_count

        count = live_count()
        count.seed(list(model.parameters()) + list(model.buffers()) if model is not None else [])
        self._counting = count.ops()
        self._counting.__enter__()
        return LiveMeter(count)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.meter is not None:
            self._synchronize()
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.meter is not None and self._t0 is not None:
            self._synchronize()
            self.times.append(time.perf_counter() - self._t0)
            if self.unsettled_steps is None:
                backend, wrapped = self._wrapped(model)
                if wrapped is None or backend.auto_settled(wrapped):
                    self.unsettled_steps = len(self.times)

    def _synchronize(self) -> None:
        """On a card, wait for the work queued so far: a step's time is its kernels', not the host's queueing of them
        (the Trainer reads no value back each step)."""
        if getattr(self.meter, "device", None) == "cuda":
            import torch

            torch.cuda.synchronize()

    def _wrapped(self, model):
        """(the trainer's backend, the model it wrapped), or (backend, None) where it wrapped none."""
        trainer = self.trainer
        backend = getattr(trainer, "memopt_backend", None)
        model = trainer.model if trainer is not None and getattr(trainer, "model", None) is not None else model
        return backend, (backend.find(model) if backend is not None and model is not None else None)

    def _plan_report(self, model) -> Optional[dict]:
        backend, wrapped = self._wrapped(model)
        if wrapped is None:
            return None
        report = backend.plan_report(wrapped, self.trainer.memopt_wrap_settings())
        return None if report is None else report.to_dict()

    def _auto_choice(self, model) -> Optional[dict]:
        backend, wrapped = self._wrapped(model)
        return backend.auto_choice(wrapped) if wrapped is not None else None

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if self.meter is None:
            return
        r = self.meter.read()
        self.meter.close()
        counting, self._counting = self._counting, None
        if counting is not None:
            from ..backends.torch._torch_api import dispatch_mode_on_top

            if dispatch_mode_on_top(counting):
                counting.__exit__(None, None, None)
        b = self.baseline
        cuda = r.device == "cuda" or self.meter.allocator == "storages"  # tensors, from 0: weights included
        result = {
            "device": r.device,
            "allocator": self.meter.allocator,
            "baseline_mb": b.current_mb,
            "peak_mb": r.peak_mb,
            # CUDA's allocated figure (and the CPU's tensor storages) starts from the model and optimizer state, as
            # users read it; with the CPU's allocator, the process's level before training (libraries, data) is
            # taken off.
            "peak_above_baseline_mb": None
            if r.peak_mb is None
            else r.peak_mb - (0.0 if cuda else b.current_mb or 0.0),
            "resident_peak_above_baseline_mb": (
                None if cuda or r.resident_peak_mb is None else r.resident_peak_mb - (b.resident_mb or 0.0)
            ),
            "step_times": self.times,
            "unsettled_steps": self.unsettled_steps,
            "batch_size": args.per_device_train_batch_size,
            "plans": self._plan_report(model),
            "auto": self._auto_choice(model),
        }
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, self.path)


@dataclass
class Measurement:
    """One configuration of one script at one batch size."""

    label: str
    flags: List[str]
    batch_size: int
    ok: bool
    # CUDA: max allocated; CPU: tensor storages (modern stack), or allocator bytes above the pre-training level (ORT)
    peak_mb: Optional[float] = None
    resident_peak_mb: Optional[float] = None  # CPU: resident peak above the pre-training level
    step_time_s: Optional[float] = None  # median over the steady steps (`steady_times`)
    samples_per_s: Optional[float] = None
    oom: bool = False
    error: Optional[str] = None
    wall_s: float = 0.0
    device: Optional[str] = None
    first_step_s: Optional[float] = None  # the first step alone (a compiled run's compile time is in it)
    plans: Optional[PlanReport] = field(default=None, repr=False)
    auto: Optional[dict] = None  # what `--memory_opt_config auto` chose in the run (`Backend.auto_choice`)
    # the steps `step_time_s` is the median of; False in `speed_settled` where the run ended before `auto` settled,
    # so that its speed is of steps it still measured
    speed_steps: int = 0
    speed_settled: bool = True

    def as_dict(self) -> Dict:
        d = asdict(self)
        d.pop("plans")
        return d


Runner = Callable[..., Measurement]


def script_backend(script_argv: Sequence[str]) -> str:
    """The backend a training command line trains through: its `--memory_opt_backend`, else the default here."""
    argv = list(script_argv)
    for i, a in enumerate(argv):
        if a == "--memory_opt_backend" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--memory_opt_backend="):
            return a.split("=", 1)[1]
    from ..backends import default_backend

    return default_backend()


def backend_label(backend: str) -> str:
    return "ORT" if backend == "ort" else f"{backend} backend"


def memory_flags(backend: bool = True, config: str = "", level: int = 0, extra: Sequence[str] = ()) -> List[str]:
    """Flags that pin one memory configuration, whatever the user's command line said (its `--use_ort`, the
    switch's deprecated name, is dropped: `ADVISOR_FLAGS`); `backend=False`: no backend."""
    if not backend:
        return ["--memory_opt_backend", "none", *extra]
    return ["--memory_opt_level", str(level), "--memory_opt_config", config, *extra]


# Flags of the user's command line that a measuring run must not inherit: the advisor's own, and, for a
# run without ORT, every flag that only means something with ORT. Value: whether the flag takes a value
# (None: a boolean flag, whose value is optional).
ADVISOR_FLAGS = {
    "--use_ort": None,
    "--memory_opt_config": True,
    "--memory_budget_mb": True,
    "--activation_memory_budget": True,
    "--memory_probe_max_plans": True,
    "--memory_probe_steps": True,
}
ORT_ONLY_FLAGS = {
    "--memory_opt_backend": True,
    "--memory_opt_level": True,
    "--ort_log_level": True,
    "--ort_fallback_policy": True,
    "--ort_save_onnx_dir": True,
    "--ort_cache_dir": True,
    "--ort_loss_in_graph": None,
}
_BOOL_WORDS = {"true", "false", "yes", "no", "y", "n", "t", "f", "1", "0"}


def strip_flags(argv: Sequence[str], flags: Dict[str, Optional[bool]]) -> List[str]:
    """``argv`` without ``flags`` (``--flag value``, ``--flag=value`` and, for booleans, a bare ``--flag``)."""
    out, i = [], 0
    argv = list(argv)
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in flags:
            if "=" not in a:
                takes = flags[name]
                if takes or (takes is None and i + 1 < len(argv) and argv[i + 1].lower() in _BOOL_WORDS):
                    i += 1
            i += 1
            continue
        out.append(a)
        i += 1
    return out


def child_command(
    script_argv: Sequence[str],
    flags: Sequence[str],
    batch_size: int,
    steps: int,
    work: str,
    out_json: str,
    python: str = sys.executable,
) -> List[str]:
    """The child's command line. argparse keeps the last occurrence of a flag, so the overrides appended
    here win over the user's own values."""
    overrides = [
        "--output_dir",
        os.path.join(work, "run"),
        *overwrite_output_dir_flag(),
        "--do_train",
        "--do_eval",
        "false",
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(batch_size),
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--logging_steps",
        "100000",
        "--disable_tqdm",
        "true",
        "--log_memory_plans",
        "true",
        "--print_memory_stats",
        "false",
        "--print_input_density",
        "false",
        "--memory_measure_out",
        out_json,
        *flags,
    ]
    drop = dict(ADVISOR_FLAGS)
    if "--memory_opt_backend" in flags and flags[list(flags).index("--memory_opt_backend") + 1] == "none":
        drop.update(ORT_ONLY_FLAGS)
    script_argv = [script_argv[0], *strip_flags(script_argv[1:], drop)]
    return [python, *script_argv, *overrides]


def _run(cmd: List[str], env: dict, timeout: float):
    """Run ``cmd``; on a timeout or any exception here (SIGTERM turned into SystemExit by the CLI), the child
    is asked to stop (SIGTERM, so it can clean up), then killed after 10 s."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except BaseException:
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except BaseException:
            proc.kill()
            proc.communicate()
        raise


def steady_times(times: List[float], unsettled: Optional[int]) -> Tuple[List[float], bool]:
    """The step times a run's speed is read from, and whether they are steady: those after the warm-up
    (`WARMUP_STEPS`) and after every step `auto` measured, checked or reported on (`unsettled`: their count; None
    where it never settled). Where none is left, the steps after the warm-up (else all), said unsteady."""
    skip = max(WARMUP_STEPS, unsettled if unsettled is not None else len(times))
    if times[skip:]:
        return times[skip:], True
    return times[WARMUP_STEPS:] or times, False


def run_child(
    script_argv: Sequence[str],
    label: str,
    flags: Sequence[str],
    batch_size: int,
    steps: int = 6,
    timeout: float = 1800,
    python: str = sys.executable,
) -> Measurement:
    """Run the script once with ``flags`` at ``batch_size`` for ``steps`` steps and read what it measured."""
    work = tempfile.mkdtemp(prefix="memopt-probe-")
    out_json = os.path.join(work, "measure.json")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    try:
        returncode, stdout, stderr = _run(
            child_command(script_argv, flags, batch_size, steps, work, out_json, python), env, timeout
        )
        wall = time.perf_counter() - t0
        if returncode != 0 or not os.path.exists(out_json):
            tail = (stderr or stdout or "")[-4000:]
            oom = "out of memory" in tail.lower() or returncode in (-9, 137)
            last = tail.strip().splitlines()[-1] if tail.strip() else f"exit {returncode}"
            if returncode == 0:
                last = f"the script exited 0 without training through MemoptTrainer (no measurement written); {last}"
            return Measurement(label, list(flags), batch_size, False, oom=oom, error=last, wall_s=wall)
        with open(out_json) as f:
            data = json.load(f)
        times, settled = steady_times(data["step_times"], data.get("unsettled_steps"))
        step = statistics.median(times) if times else None
        return Measurement(
            label,
            list(flags),
            batch_size,
            True,
            peak_mb=data["peak_above_baseline_mb"],
            resident_peak_mb=data["resident_peak_above_baseline_mb"],
            step_time_s=step,
            samples_per_s=(batch_size / step) if step else None,
            wall_s=wall,
            device=data["device"],
            first_step_s=data["step_times"][0] if data["step_times"] else None,
            plans=PlanReport.from_dict(data["plans"]) if data.get("plans") else None,
            auto=data.get("auto"),
            speed_steps=len(times),
            speed_settled=settled,
        )
    except subprocess.TimeoutExpired:
        return Measurement(
            label,
            list(flags),
            batch_size,
            False,
            error=f"timed out after {timeout:.0f} s",
            wall_s=time.perf_counter() - t0,
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
