"""`MemoryPhaseCallback`: memory at each phase of a training step, on rank 0 only.

Phases: `pre_forward` and `post_forward` (forward hooks on the module the Trainer calls: the backend's
wrapper or the plain model), `pre_backward` (a gradient hook on the loss the trainer is about to
back-propagate, or the model's first output that needs a gradient, whichever backward reaches first)
and `post_backward` (`on_pre_optimizer_step`: after
the step's last backward, before the optimizer). With gradient accumulation the forward-side phases are
those of the step's last micro-batch.

Recorded steps: all of the first ten, then powers of two, and every logging step. Readings (see
`optimum_memopt.memory`): on CUDA, allocated / peak allocated within the phase / reserved; on CPU, bytes
in use at the allocator level (`mallinfo2`) with their peak within the phase, and the resident set with
its high-water mark within the phase beside them. With `--skip_memory_metrics false` on CUDA the peaks
are not reset (the Trainer's own memory metrics read the same counter), so each peak is the peak since
training began, and the log says so.

Metrics added to each training log, for the latest recorded step (MiB):
  - `memopt/mem_<phase>_mb`: memory in use at the end of the phase (CUDA allocated; CPU allocator in use);
  - `memopt/mem_<phase>_peak_mb`: its peak within the phase;
  - `memopt/mem_<phase>_resident_mb` (CPU): resident memory at the end of the phase;
  - `memopt/mem_step_peak_mb`: the peak over the whole step;
  - `memopt/mem_forward_held_mb`: in use after forward minus before it (what forward left for backward: the
    activations autograd keeps, and the outputs).
Only the step peak and the forward's held memory go into each log line unless `--log_all_memory_metrics`.
Files: `<output_dir>/memory_phases.csv` (every recorded reading; on resume, it continues from the
checkpoint's step) and, at the end of training, `<output_dir>/memory_phases.png` (phases over steps).
"""

import os

import torch

from ..memory import READABLE_DEVICES, MemoryMeter, training_device
from .base import CsvReport, MetricsCallback, atomic_write, current_model, hookable, logger

PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward")
CSV_FIELDS = (
    "step",
    "phase",
    "device",
    "in_use_mb",
    "in_use_peak_mb",
    "resident_mb",
    "resident_peak_mb",
    "reserved_mb",
)


def should_record(step: int, logging_steps: int) -> bool:
    """First ten steps, powers of two, and logging steps (the step that ends at a multiple of logging_steps)."""
    return step < 10 or (step & (step - 1)) == 0 or (logging_steps > 0 and (step + 1) % logging_steps == 0)


def _first_grad_tensor(output):
    if isinstance(output, dict):
        values = ([output["loss"]] if output.get("loss") is not None else []) + list(output.values())
    elif isinstance(output, (tuple, list)):
        values = list(output)
    else:
        values = [output]
    return next((v for v in values if torch.is_tensor(v) and v.requires_grad), None)


def _fmt(x):
    return "" if x is None else f"{x:.1f}"


class MemoryPhaseCallback(MetricsCallback):
    def __init__(self, trainer=None, plot: bool = True):
        super().__init__()
        self.trainer = trainer
        self.plot = plot
        self.rows = []
        self.meter = None
        self._handles = []
        self._state = None
        self._logging_steps = 0
        self._csv = None
        self._readings = {}
        self._reset_peaks = True
        self._step = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or current_model(self.trainer, model) is None:
            return
        self._state = state
        self._logging_steps = int(args.logging_steps) if args.logging_strategy == "steps" else 0
        device = training_device(args, current_model(self.trainer, model))
        if device not in READABLE_DEVICES:
            logger.warning(
                "memory phases: this run trains on %r; the plugin reads memory on CUDA and on the CPU only, so no "
                "phases are recorded",
                device,
            )
            return
        self.meter = MemoryMeter(device)
        self._reset_peaks = not (self.meter.device == "cuda" and not args.skip_memory_metrics)
        if not self._reset_peaks:
            logger.info(
                "memory phases: --skip_memory_metrics false reads CUDA's peak counter too, so it is not reset "
                "between phases; each phase's peak is the peak since training began"
            )
        if self.meter.device == "cpu" and self.meter.allocator is None:
            logger.warning(
                "memory phases: mallinfo2 is not available here; only resident memory is recorded, which "
                "stays at its high-water mark once the allocator holds the pages"
            )
        self._csv = CsvReport(self, os.path.join(args.output_dir, "memory_phases.csv"), CSV_FIELDS)
        self._csv.start(state.global_step)
        target = hookable(self.trainer, model)
        self._handles = [
            target.register_forward_pre_hook(self._pre_forward),
            target.register_forward_hook(self._post_forward),
        ]

    def _recording(self, module) -> bool:
        return module.training and should_record(self._state.global_step, self._logging_steps)

    def _take(self, phase: str):
        self._readings[phase] = self.meter.read()
        if self._reset_peaks:
            self.meter.reset_peak()

    def _pre_forward(self, module, args):
        if self._recording(module):
            if self._reset_peaks:
                self.meter.reset_peak()
            self._readings = {}
            self._step = self._state.global_step
            self._take("pre_forward")

    def _post_forward(self, module, args, output):
        if self._recording(module) and "pre_forward" in self._readings:
            self._take("post_forward")
            # Backward starts where the gradient first reaches the model's output: its loss, or (when a label
            # smoother or a custom compute_loss takes the labels) the first output tensor that needs a gradient.
            first = _first_grad_tensor(output)
            if first is not None:
                first.register_hook(self._pre_backward)

    def observe_loss(self, loss):
        """Called by the trainer hook with the loss it will back-propagate."""
        if self.meter is not None and "post_forward" in self._readings:
            loss.register_hook(self._pre_backward)

    def _pre_backward(self, grad):
        if "pre_backward" not in self._readings:
            self._take("pre_backward")
        return grad

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.meter is None or not self._readings or self._step != state.global_step:
            return
        self._take("post_backward")
        self._flush(state.global_step)

    def _flush(self, step: int):
        readings, self._readings, self._step = self._readings, {}, None
        out = []
        for phase in PHASES:
            r = readings.get(phase)
            if r is None:
                continue
            out.append(
                [
                    step,
                    phase,
                    r.device,
                    _fmt(r.current_mb),
                    _fmt(r.peak_mb),
                    _fmt(r.resident_mb),
                    _fmt(r.resident_peak_mb),
                    _fmt(r.reserved_mb),
                ]
            )
            self.rows.append(
                {
                    "step": step,
                    "phase": phase,
                    "in_use_mb": r.current_mb,
                    "in_use_peak_mb": r.peak_mb,
                    "resident_mb": r.resident_mb,
                }
            )
        self._csv.append(out)
        metrics = {}
        for phase, r in readings.items():
            if r.current_mb is not None:
                metrics[f"memopt/mem_{phase}_mb"] = r.current_mb
                metrics[f"memopt/mem_{phase}_peak_mb"] = r.peak_mb
            if r.resident_mb is not None:
                metrics[f"memopt/mem_{phase}_resident_mb"] = r.resident_mb
        before, after = readings.get("pre_forward"), readings.get("post_forward")
        if before is not None and after is not None and None not in (before.current_mb, after.current_mb):
            metrics["memopt/mem_forward_held_mb"] = after.current_mb - before.current_mb
        peaks = [r.peak_mb for r in readings.values() if r.peak_mb is not None]
        if peaks:
            metrics["memopt/mem_step_peak_mb"] = max(peaks)
        self._pending = metrics

    def on_train_end(self, args, state, control, **kwargs):
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.meter is None:
            return
        self.meter.close()
        self._csv.finish()
        if self.plot and self.rows:
            path = os.path.join(args.output_dir, "memory_phases.png")
            plot = lambda p: plot_phases(self.rows, p, self.meter.device)  # noqa: E731
            if self.write_report(path, lambda p: atomic_write(p, plot)):
                logger.info("memory phases: %d readings in %s, plot in %s", len(self.rows), self._csv.path, path)


def plot_phases(rows, path: str, device: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    for phase in PHASES:
        pts = [
            (r["step"], r["in_use_mb"], r["in_use_peak_mb"])
            for r in rows
            if r["phase"] == phase and r["in_use_mb"] is not None
        ]
        if not pts:
            continue
        steps, cur, peak = zip(*pts)
        # post_forward and pre_backward often read the same: different markers keep both visible
        marker = {"pre_forward": "o", "post_forward": "s", "pre_backward": "x", "post_backward": "o"}[phase]
        line = ax.plot(steps, cur, marker=marker, markersize=7 if marker == "s" else 5, label=phase)[0]
        ax.plot(steps, peak, linestyle="--", color=line.get_color(), alpha=0.6, label=f"{phase} (peak in phase)")
    what = "allocated" if device == "cuda" else "in use at the allocator"
    ax.set_xlabel("step")
    ax.set_ylabel(f"MiB ({what})")
    ax.set_title(f"Memory by phase ({device}): activations held from post_forward until backward frees them")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
