"""The loss inside the backend's graph (`--ort_loss_in_graph`)."""

import torch
from torch import nn

IGNORE_INDEX = -100


def smoothed_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, epsilon: float, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Cross-entropy with label smoothing, averaged over labels that are not ignored.

    Written out with log_softmax and gather because ORT 1.19's exporter refuses
    `cross_entropy(label_smoothing=...)` ("ONNX does not support label_smoothing"). The same value as
    the Trainer's `LabelSmoother`: (1 - eps) * NLL + eps * mean over classes of -log p.
    """
    log_probs = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    nll = -log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(dim=-1)
    per_label = (1.0 - epsilon) * nll + epsilon * smooth
    weights = valid.to(per_label.dtype)
    return (per_label * weights).sum() / weights.sum().clamp(min=1.0)


class LossInGraph(nn.Module):
    """Runs the model and returns only its loss, so the loss is computed inside the backend's graph and
    the logits never leave it (ORT can then drop ignored labels before the loss: label sparsity).

    With ``label_smoothing`` > 0 the smoothed cross-entropy is computed here, for models whose labels
    align with their logits (sequence classification, masked LM). Attribute access falls through to
    the wrapped model (its ``config``, ``_keys_to_ignore_on_save``...), so Trainer code that reads them
    keeps working.
    """

    def __init__(self, model: nn.Module, label_smoothing: float = 0.0):
        super().__init__()
        self.model = model
        self.label_smoothing = float(label_smoothing)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if self.label_smoothing > 0 and labels is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
            logits = self.model(*args, **kwargs)["logits"]
            loss = smoothed_cross_entropy(logits, labels, self.label_smoothing)
        else:
            outputs = self.model(*args, **kwargs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss,)
