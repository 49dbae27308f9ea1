"""`InputDensityCallback`: how much of each training batch is real data.

Per training step (rank 0 only), from the batch the model receives:

* EMBED: the share of `input_ids` that are not the pad id (the model config's `pad_token_id`; where
  there is none, the attention mask);
* LABEL: the share of `labels` that are not ignored (-100).

Metrics added to each training log (averaged over the steps since the previous log):
  - `memopt/embed_density_pct`, `memopt/label_density_pct`: percentages;
  - `memopt/embed_valid_tokens`, `memopt/embed_total_tokens`: tokens summed over those steps;
  - `memopt/label_valid`, `memopt/label_total`: labels summed over those steps.

Every `input_density_table_steps` steps a table in ORT's layout (STEP, INPUT TYPE, INPUT NAME, PAD IDX,
DENSITY, VALID TOKENS, TOTAL TOKENS, VALID TOKENS/BATCH) goes to the log; every step's figures go to
`<output_dir>/input_density.csv`.
"""

import csv
from collections import deque

import torch

from .base import MetricsCallback, logger, unwrap_to_hookable

IGNORE_INDEX = -100


class InputDensityCallback(MetricsCallback):
    def __init__(self, table_steps: int = 10):
        super().__init__()
        self.table_steps = table_steps
        # (step, type, name, pad, valid, total, per_row): only what the next table needs; every row is in the CSV
        self.rows = deque(maxlen=4 * table_steps)
        self._handle = None
        self._state = None
        self._pad_id = None
        self._since_log = []
        self._csv_path = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not state.is_world_process_zero or model is None:
            return
        self._state = state
        config = getattr(model, "config", None)
        self._pad_id = getattr(config, "pad_token_id", None)
        self._csv_path = self.output_path(args, "input_density.csv")
        with open(self._csv_path, "w", newline="") as f:
            csv.writer(f).writerow(["step", "input_type", "input_name", "pad_idx", "valid", "total", "density_pct"])
        target = unwrap_to_hookable(model)
        self._handle = target.register_forward_pre_hook(self._pre_forward, with_kwargs=True)

    @torch.no_grad()
    def _pre_forward(self, module, args, kwargs):
        if not module.training:
            return None
        step = self._state.global_step
        input_ids = kwargs.get("input_ids", args[0] if args and torch.is_tensor(args[0]) else None)
        if input_ids is not None:
            if self._pad_id is not None:
                valid_mask = input_ids != self._pad_id
                pad = str(self._pad_id)
            elif kwargs.get("attention_mask") is not None:
                valid_mask = kwargs["attention_mask"] != 0
                pad = "mask"
            else:
                valid_mask = torch.ones_like(input_ids, dtype=torch.bool)
                pad = "none"
            per_row = valid_mask.reshape(input_ids.shape[0], -1).sum(dim=1).tolist()
            self._record(step, "EMBED", "input_ids", pad, int(sum(per_row)), input_ids.numel(), per_row)
        labels = kwargs.get("labels")
        if labels is not None:
            valid = int((labels != IGNORE_INDEX).sum().item())
            self._record(step, "LABEL", "labels", str(IGNORE_INDEX), valid, labels.numel(), None)
        return None

    def _record(self, step, kind, name, pad, valid, total, per_row):
        row = (step, kind, name, pad, valid, total, per_row)
        self.rows.append(row)
        self._since_log.append(row)
        with open(self._csv_path, "a", newline="") as f:
            density = 100.0 * valid / total if total else 0.0
            csv.writer(f).writerow([step, kind, name, pad, valid, total, f"{density:.2f}"])

    def on_step_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero or self._handle is None:
            return
        if state.global_step % self.table_steps == 0:
            recent = [r for r in self.rows if r[0] > state.global_step - 1 - self.table_steps]
            logger.info("%s", format_density_table(recent, self.table_steps))
        self._update_pending()

    def _update_pending(self):
        sums = {"EMBED": [0, 0], "LABEL": [0, 0]}
        for _, kind, _, _, valid, total, _ in self._since_log:
            sums[kind][0] += valid
            sums[kind][1] += total
        metrics = {}
        if sums["EMBED"][1]:
            metrics["memopt/embed_density_pct"] = 100.0 * sums["EMBED"][0] / sums["EMBED"][1]
            metrics["memopt/embed_valid_tokens"] = float(sums["EMBED"][0])
            metrics["memopt/embed_total_tokens"] = float(sums["EMBED"][1])
        if sums["LABEL"][1]:
            metrics["memopt/label_density_pct"] = 100.0 * sums["LABEL"][0] / sums["LABEL"][1]
            metrics["memopt/label_valid"] = float(sums["LABEL"][0])
            metrics["memopt/label_total"] = float(sums["LABEL"][1])
        self._pending = metrics

    def pop_metrics(self):
        self._since_log = []
        return super().pop_metrics()

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def format_density_table(rows, steps: int) -> str:
    header = ("STEP", "INPUT TYPE", "INPUT NAME", "PAD IDX", "DENSITY", "VALID TOKENS", "TOTAL TOKENS", "VALID TOKENS/BATCH")
    table = [header]
    for step, kind, name, pad, valid, total, per_row in rows:
        density = f"{100.0 * valid / total:.2f} %" if total else "n/a"
        table.append((str(step), kind, name, pad, density, str(valid), str(total), str(per_row) if per_row else "N/A"))
    widths = [max(len(r[c]) for r in table) for c in range(len(header))]
    lines = ["| " + " | ".join(cell.ljust(w) for cell, w in zip(r, widths)) + " |" for r in table]
    return f"Input density (valid/total) over the last {steps} step(s):\n" + "\n".join(lines)
