"""A causal LM's loss summed chunk by chunk: each chunk's logits made from its rows of the hidden states, its
cross-entropy (or the Trainer's label smoothing) summed, and the logits made again in backward."""

import functools
import inspect
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ... import _torch_api


@functools.lru_cache(maxsize=None)
def smoother_counts_items() -> bool:
    """Whether the installed transformers' `LabelSmoother` divides by the Trainer's `num_items_in_batch` (5.15 on)."""
    from transformers.trainer_pt_utils import LabelSmoother

    return "num_items_in_batch" in inspect.signature(LabelSmoother.__call__).parameters


def chunk_losses(logits_of: Callable, hidden, target, rows: int, ignore: int, smoothing) -> list:
    """Each chunk of `rows` tokens' loss sums (`_chunk_sums`), its logits let go after and made again in backward."""
    return [
        checkpoint(_chunk_sums, logits_of, h, y, ignore, smoothing, use_reentrant=False)
        for h, y in zip(hidden.split(rows), _torch_api.split_keyed_alike(target, rows))
    ]


def _chunk_sums(logits_of: Callable, hidden, target, ignore: int, smoothing: Optional[float]):
    """One chunk: the sum of its tokens' loss (with smoothing: the two sums of `LabelSmoother`, the labels' and the
    whole vocabulary's); `logits_of`: the head and what the forward does to its logits (`HeadForm.logits`)."""
    logits = logits_of(hidden)
    if smoothing is None:
        return F.cross_entropy(logits.float(), target, ignore_index=ignore, reduction="sum")
    minus = -F.log_softmax(logits, dim=-1)
    padding = target.eq(ignore).unsqueeze(-1)
    nll = minus.gather(dim=-1, index=target.clamp(min=0).unsqueeze(-1)).masked_fill(padding, 0.0)
    smooth = minus.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill(padding, 0.0)
    return nll.sum(), smooth.sum()
