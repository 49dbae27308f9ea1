"""`MemoryPhaseCallback`: memory at each phase of a training step, on rank 0 only.

Phases: `pre_forward` and `post_forward` (forward hooks on the module the Trainer calls: the
ORTModule or the plain model), `pre_backward` (a gradient hook on the loss: the first thing the
backward pass computes) and `post_backward` (`on_pre_optimizer_step`: after the last backward of
the step, before the optimizer). With gradient accumulation the forward-side phases are those of
the step's last micro-batch.

Recorded steps: all of the first ten, then powers of two, and every logging step. Readings
(see `optimum_memopt.memory`): on CUDA allocated / max allocated / reserved; on CPU the process's
resident memory and its peak within the phase.

Metrics added to each training log, for the latest recorded step (MiB):
  - `memopt/mem_<phase>_mb`: allocated (CUDA) or resident (CPU) memory at the end of the phase;
  - `memopt/mem_<phase>_peak_mb`: the peak within the phase;
  - `memopt/mem_step_peak_mb`: the peak over the whole step.
Files: `<output_dir>/memory_phases.csv` (every recorded reading) and, at the end of training,
`<output_dir>/memory_phases.png` (phases over steps).
"""

import csv

import torch

from ..memory import MemoryMeter
from .base import MetricsCallback, logger, unwrap_to_hookable

PHASES = ("pre_forward", "post_forward", "pre_backward", "post_backward")
CSV_FIELDS = ("step", "phase", "device", "current_mb", "peak_mb", "reserved_mb")


def should_record(step: int, logging_steps: int) -> bool:
    """First ten steps, powers of two, and logging steps (the step that ends at a multiple of logging_steps)."""
    return step < 10 or (step & (step - 1)) == 0 or (logging_steps > 0 and (step + 1) % logging_steps == 0)


class MemoryPhaseCallback(MetricsCallback):
    def __init__(self, plot: bool = True):
        super().__init__()
        self.plot = plot
        self.rows = []
        self.meter = None
        self._handles = []
        self._state = None
        self._logging_steps = 0
        self._csv_path = None
        self._current_step = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return
        self._state = state
        self._logging_steps = int(args.logging_steps) if args.logging_strategy == "steps" else 0
        self.meter = MemoryMeter()
        if self.meter.device == "cpu" and not self.meter.peak_resets:
            logger.info("memory phases: /proc/self/clear_refs is not writable; CPU peaks are since process start")
        self._csv_path = self.output_path(args, "memory_phases.csv")
        with open(self._csv_path, "w", newline="") as f:
            csv.writer(f).writerow(CSV_FIELDS)
        target = unwrap_to_hookable(model)
        self._handles = [
            target.register_forward_pre_hook(self._pre_forward),
            target.register_forward_hook(self._post_forward),
        ]

    def _recording(self, module) -> bool:
        return module.training and should_record(self._state.global_step, self._logging_steps)

    def _take(self, phase: str):
        reading = self.meter.read()
        self._current_step[phase] = reading
        self.meter.reset_peak()

    def _pre_forward(self, module, args):
        if self._recording(module):
            self.meter.reset_peak()
            self._current_step = {}
            self._take("pre_forward")

    def _post_forward(self, module, args, output):
        if not self._recording(module):
            return
        self._take("post_forward")
        loss = output.get("loss") if isinstance(output, dict) else (output[0] if isinstance(output, (tuple, list)) else output)
        if torch.is_tensor(loss) and loss.requires_grad:
            loss.register_hook(self._pre_backward)

    def _pre_backward(self, grad):
        self._take("pre_backward")
        return grad

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self.meter is None or not self._current_step:
            return
        self._take("post_backward")
        self._flush(state.global_step)

    def _flush(self, step: int):
        readings = self._current_step
        self._current_step = {}
        with open(self._csv_path, "a", newline="") as f:
            writer = csv.writer(f)
            for phase in PHASES:
                r = readings.get(phase)
                if r is None:
                    continue
                reserved = "" if r.reserved_mb is None else f"{r.reserved_mb:.1f}"
                writer.writerow([step, phase, r.device, f"{r.current_mb:.1f}", f"{r.peak_mb:.1f}", reserved])
                self.rows.append({"step": step, "phase": phase, "current_mb": r.current_mb, "peak_mb": r.peak_mb,
                                  "reserved_mb": r.reserved_mb})
        metrics = {}
        for phase, r in readings.items():
            metrics[f"memopt/mem_{phase}_mb"] = r.current_mb
            metrics[f"memopt/mem_{phase}_peak_mb"] = r.peak_mb
        if readings:
            metrics["memopt/mem_step_peak_mb"] = max(r.peak_mb for r in readings.values())
        self._pending = metrics

    def on_train_end(self, args, state, control, **kwargs):
        for h in self._handles:
            h.remove()
        self._handles = []
        if state.is_world_process_zero and self.plot and self.rows:
            path = self.output_path(args, "memory_phases.png")
            plot_phases(self.rows, path, self.meter.device if self.meter else "cpu")
            logger.info("memory phases: %d readings in %s, plot in %s", len(self.rows), self._csv_path, path)


def plot_phases(rows, path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for phase in PHASES:
        pts = [(r["step"], r["current_mb"], r["peak_mb"]) for r in rows if r["phase"] == phase]
        if not pts:
            continue
        steps, cur, peak = zip(*pts)
        line = ax.plot(steps, cur, marker="o", label=f"{phase}")[0]
        ax.plot(steps, peak, linestyle="--", color=line.get_color(), alpha=0.6, label=f"{phase} (peak in phase)")
    what = "allocated" if device == "cuda" else "resident"
    ax.set_xlabel("step")
    ax.set_ylabel(f"MiB ({what})")
    ax.set_title(f"Memory by phase ({device})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
