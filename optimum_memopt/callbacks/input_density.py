"""`InputDensityCallback`: how much of each training batch is real data.

For every training micro-batch (rank 0 only), from the inputs the trainer hands `training_step`, before
a label smoother or a custom `compute_loss` can pop the labels:

* EMBED: the share of `input_ids` that are not the pad id (the model config's `pad_token_id`; where
  there is none, the attention mask; where there is neither, every token counts as valid and the
  PAD IDX column says `none`);
* LABEL: the share of `labels` that are not ignored (-100).

Metrics added to each training log (summed over the micro-batches since the previous log):
  - `memopt/embed_density_pct`, `memopt/label_density_pct`: percentages;
  - `memopt/embed_valid_tokens`, `memopt/embed_total_tokens`: tokens;
  - `memopt/label_valid`, `memopt/label_total`: labels.

Every `input_density_table_steps` steps a table (STEP, MICRO, INPUT TYPE, INPUT NAME, PAD IDX, DENSITY,
VALID TOKENS, TOTAL TOKENS, VALID TOKENS/ROW) goes to the log; every micro-batch's figures go to
`<output_dir>/input_density.csv` (on resume, the file continues from the checkpoint's step).
"""

import os
from collections import deque

import torch

from ..losses import IGNORE_INDEX
from .base import CsvReport, MetricsCallback, show

CSV_FIELDS = ("step", "micro_batch", "input_type", "input_name", "pad_idx", "valid", "total", "density_pct")


class InputDensityCallback(MetricsCallback):
    def __init__(self, table_steps: int = 10, trainer=None):
        super().__init__()
        self.table_steps = table_steps
        self.trainer = trainer
        # (step, micro, type, name, pad, valid, total, per_row): what the next table needs; every row is in the CSV
        self.rows = deque(maxlen=64 * table_steps)
        self._sums = {"EMBED": [0, 0], "LABEL": [0, 0]}
        self._active = False
        self._pad_id = None
        self._csv = None
        self._micro = (-1, 0)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero:
            return
        self._active = True
        plain = getattr(self.trainer, "plain_model", None) or model
        self._pad_id = getattr(getattr(plain, "config", None), "pad_token_id", None)
        self._csv = CsvReport(self, os.path.join(args.output_dir, "input_density.csv"), CSV_FIELDS)
        self._csv.start(state.global_step)

    @torch.no_grad()
    def observe_batch(self, inputs, state):
        if not self._active:
            return
        step = state.global_step
        micro = self._micro[1] + 1 if self._micro[0] == step else 0
        self._micro = (step, micro)
        rows = []
        input_ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if torch.is_tensor(input_ids):
            if self._pad_id is not None:
                valid_mask, pad = input_ids != self._pad_id, str(self._pad_id)
            elif torch.is_tensor(inputs.get("attention_mask")):
                valid_mask, pad = inputs["attention_mask"] != 0, "mask"
            else:
                valid_mask, pad = torch.ones_like(input_ids, dtype=torch.bool), "none"
            per_row = valid_mask.reshape(input_ids.shape[0], -1).sum(dim=1).tolist()
            rows.append((step, micro, "EMBED", "input_ids", pad, int(sum(per_row)), input_ids.numel(), per_row))
        labels = inputs.get("labels") if hasattr(inputs, "get") else None
        if torch.is_tensor(labels):
            valid = int((labels != IGNORE_INDEX).sum().item())
            rows.append((step, micro, "LABEL", "labels", str(IGNORE_INDEX), valid, labels.numel(), None))
        for row in rows:
            self.rows.append(row)
            self._sums[row[2]][0] += row[5]
            self._sums[row[2]][1] += row[6]
        self._csv.append([[*r[:7], f"{100.0 * r[5] / r[6]:.2f}" if r[6] else ""] for r in rows])
        self._update_pending()

    def on_step_end(self, args, state, control, **kwargs):
        if not self._active:
            return
        if state.global_step % self.table_steps == 0:
            first = state.global_step - self.table_steps  # rows carry the step they started at (global_step - 1 now)
            recent = [r for r in self.rows if r[0] >= first]
            if recent:
                show(format_density_table(recent, self.table_steps))

    def _update_pending(self):
        metrics = {}
        (ev, et), (lv, lt) = self._sums["EMBED"], self._sums["LABEL"]
        if et:
            metrics.update(
                {
                    "memopt/embed_density_pct": 100.0 * ev / et,
                    "memopt/embed_valid_tokens": float(ev),
                    "memopt/embed_total_tokens": float(et),
                }
            )
        if lt:
            metrics.update(
                {
                    "memopt/label_density_pct": 100.0 * lv / lt,
                    "memopt/label_valid": float(lv),
                    "memopt/label_total": float(lt),
                }
            )
        self._pending = metrics

    def pop_metrics(self):
        self._sums = {"EMBED": [0, 0], "LABEL": [0, 0]}
        return super().pop_metrics()

    def on_train_end(self, args, state, control, **kwargs):
        if self._active and self._csv is not None:
            self._csv.finish()
        self._active = False


def format_density_table(rows, steps: int) -> str:
    header = (
        "STEP",
        "MICRO",
        "INPUT TYPE",
        "INPUT NAME",
        "PAD IDX",
        "DENSITY",
        "VALID TOKENS",
        "TOTAL TOKENS",
        "VALID TOKENS/ROW",
    )
    table = [header]
    for step, micro, kind, name, pad, valid, total, per_row in rows:
        density = f"{100.0 * valid / total:.2f} %" if total else "n/a"
        table.append(
            (
                str(step),
                str(micro),
                kind,
                name,
                pad,
                density,
                str(valid),
                str(total),
                str(per_row) if per_row else "N/A",
            )
        )
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in table]
    return f"Input density (valid/total) over the last {steps} step(s):\n" + "\n".join(lines)
