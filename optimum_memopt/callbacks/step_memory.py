"""The picture of the step's memory, after `--memory_opt_config auto` has chosen and checked its choice (torch
backend), on rank 0: step one's memory at every layer mark (each layer's forward and backward, the head and the
loss, after backward), the budget, the peak predicted with the choice in each stretch and the peak measured after
it, the plan each layer runs, and, where the layers come from several lists (a vision-language model's towers), which
list each layer's number belongs to. Drawn from the solver's figures, the ones `memory_auto/solver.json` holds, into
`memory_auto/step_memory.png`, and handed to TensorBoard and W&B when the run reports to them (`report_to`), as the
Trainer's own callbacks write there. A picture that cannot be drawn or sent is said, and training goes on.
"""

import logging
import os
import re
from typing import List, Optional

from .base import MetricsCallback, atomic_write, current_model

logger = logging.getLogger(__name__)

IMAGE_TAG = "memopt/step_memory"


def _short(segment: dict) -> str:
    """A segment as an axis label, from its place (`layer 3 forward` -> `L3 fwd`); a file written before segments
    carried their place, from its name."""
    place = segment.get("place")
    if place is not None:
        kind, layer = place["kind"], place["layer"]
        if layer is not None:
            return f"L{layer} {'fwd' if kind == 'forward' else 'bwd'}"
        return {"head": "head+loss", "after": "optimizer"}.get(kind, kind)
    name = segment["name"]
    match = re.fullmatch(r"layer (\d+) (forward|backward)", name)
    if match:
        return f"L{match.group(1)} {'fwd' if match.group(2) == 'forward' else 'bwd'}"
    if name.startswith("after the layers"):
        return "head+loss"
    if name.startswith("after backward"):
        return "optimizer"
    return name[:12]


def _rank0(points: List[dict], processes: int) -> List[dict]:
    """Several processes' segments are placed per rank: rank 0's, as measured there, named as its own step names
    them (a file written before segments carried their place: by the name's `... on rank 0`)."""
    if processes <= 1:
        return points
    if all("place" in p for p in points):
        return [
            dict(p, name=p["name"][: -len(" on rank 0")], place=dict(p["place"], rank=None))
            for p in points
            if p["place"]["rank"] == 0
        ]
    return [dict(p, name=p["name"][: -len(" on rank 0")]) for p in points if p["name"].endswith(" on rank 0")]


def draw_step_memory(data: dict, path: Optional[str] = None):
    """The picture of `data` (the solver's figures: `BudgetPlanner.solver_data`, as in solver.json); written as a
    PNG to `path` when given. Returns the matplotlib figure."""
    from matplotlib.figure import Figure

    memory = data["memory"]
    segments = memory["segments"]
    x = list(range(len(segments)))
    fig = Figure(figsize=(13, 6))
    ax = fig.subplots()
    ax.bar(x, [s["peak_mb"] for s in segments], color="#9ecae1", label="step one: the peak of each stretch")
    ax.plot(x, [s["start_mb"] for s in segments], "k_", markersize=14, label="step one: at the mark it starts at")
    fit = next((f for f in reversed(data["fits"]) if f.get("config") is not None), None)
    if fit is not None:
        predicted = _rank0(fit.get("predicted_segments") or [], data.get("processes", 1))
        if [p["name"] for p in predicted] == [s["name"] for s in segments]:
            ax.plot(x, [p["peak_mb"] for p in predicted], "o-", color="#e6550d", label="predicted with the choice")
    if data.get("budget_mb") is not None:
        ax.axhline(data["budget_mb"], color="#d62728", linestyle="--", label=f"budget {data['budget_mb']:,.1f} MiB")
    if data.get("verified") and len(data["verified"]) == len(data["fits"]):  # the last choice's own check
        measured = data["verified"][-1]["measured_peak_mb"]
        ax.axhline(measured, color="#2ca02c", linestyle=":", label=f"measured after the choice {measured:,.1f} MiB")
    ax.set_xticks(x)
    ax.set_xticklabels([_short(s) for s in segments], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(f"MiB ({'allocated' if memory['device'] == 'cuda' else 'in use at the allocator'})")
    plans = "recompute nothing" if fit is None or not fit.get("config") else "the choice, per layer"
    ax.set_title(f"The step's memory ({memory['device']}): step one with every layer recomputed whole, and {plans}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the axes, over nothing
    fig.subplots_adjust(left=0.07, right=0.7, bottom=0.16, top=0.92)
    lines = []
    if fit is not None and fit.get("per_layer"):
        lines = ["the plans each layer runs:"] + [f"layer {i}: {label}" for i, label in enumerate(fit["per_layer"])]
    if data.get("layer_lists"):  # a VLM's towers: which list each layer number belongs to
        lines += ["", "the layers come from:"] + list(data["layer_lists"])
    if lines:
        fig.text(0.71, 0.6, "\n".join(lines), fontsize=7, family="monospace", va="top")
    if path is not None:
        fig.savefig(path, dpi=110, format="png")
    return fig


class StepMemoryCallback(MetricsCallback):
    """Draws the picture once `auto`'s choice has been checked, or as training ends before that (rank 0), and sends
    it where the run reports."""

    def __init__(self, trainer=None):
        super().__init__()
        self.trainer = trainer
        self.path: Optional[str] = None  # where the picture was written, once it was

    def _planner(self, model):
        backend = getattr(self.trainer, "memopt_backend", None)
        wrapped = backend.find(current_model(self.trainer, model)) if backend is not None else None
        state = getattr(wrapped, "_memopt_recompute", None)
        return getattr(state, "planner", None)

    def on_train_begin(self, args, state, control, **kwargs):
        self.path = None  # each `train()` gets its picture (a second one on the same Trainer too)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._draw(args, state, model, checked=True)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._draw(args, state, model, checked=False)  # training ended before the choice was checked

    def _draw(self, args, state, model, checked: bool) -> None:
        if self.path is not None or not state.is_world_process_zero:
            return
        planner = self._planner(model)
        if planner is None or planner.memory is None or not planner.fits or (checked and not planner.settled):
            return
        path = os.path.join(args.output_dir, "memory_auto", "step_memory.png")
        self.path = path
        figure = []
        draw = lambda tmp: figure.append(draw_step_memory(planner.solver_data(), tmp))  # noqa: E731
        if self.write_report(path, lambda p: atomic_write(p, draw)):  # a failure is said; training goes on
            logger.info("step memory: the picture of auto's choice is in %s", path)
            self._send(figure[0], path, state.global_step)

    def _send(self, figure, path: str, step: int) -> None:
        """To TensorBoard and W&B, through the writers the Trainer's own callbacks opened (`report_to`)."""
        for callback in getattr(getattr(self.trainer, "callback_handler", None), "callbacks", []):
            name = type(callback).__name__
            try:
                if name == "TensorBoardCallback" and getattr(callback, "tb_writer", None) is not None:
                    callback.tb_writer.add_figure(IMAGE_TAG, figure, global_step=step)
                    callback.tb_writer.flush()
                elif name == "WandbCallback" and getattr(callback, "_wandb", None) is not None:
                    wandb = callback._wandb
                    if wandb.run is not None:
                        wandb.log({IMAGE_TAG: wandb.Image(path)}, commit=False)
            except Exception as e:  # a report must never cost the run
                logger.error("step memory: could not send the picture to %s (%s: %s)", name, type(e).__name__, e)
