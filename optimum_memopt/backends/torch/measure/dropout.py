"""Dropout as a CUDA card runs it, on a dry run's fake tensors.

`torch.nn.functional.dropout` (what `nn.Dropout`, PEFT's `lora_dropout` and transformers' eager attention call) takes
one of two paths by the device its input is on. On a CUDA card, training with `0 < p < 1` and not in place, it runs
the fused `native_dropout`, whose backward keeps a one-byte boolean mask. Everywhere else (the CPU, where a dry run's
fake tensors are; in place on a card too) it draws a noise tensor of the input's dtype and multiplies by it, and the
multiplication keeps that tensor: two or four bytes an element. A dry run for a card that let the CPU's path run
counted each mask at the input's element size (fp32 LoRA adapters: four times what the card keeps).

Under `on_cuda(True)` every `torch.nn.functional.dropout` call the card would fuse runs `native_dropout` instead, as
the card does, and keeps what the card keeps (the rule is torch's `is_fused_kernel_acceptable`, aten's Dropout.cpp);
the others run as before. Held to CUDA's own saved tensors by tests/test_gpu_torch.py; here, by tests/test_dropout.py.
The math attention path's dropout, inside one aten op, is run as the card runs it by `attention.math_path`. Not
reached: `torch.dropout` called directly, and the feature and alpha dropouts.
"""

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F


def fused_on_cuda(input: torch.Tensor, p: float, training: bool, inplace: bool) -> bool:
    """Whether a card runs this call as `native_dropout` (its one-byte mask), not as noise times the input."""
    return training and not inplace and 0.0 < p < 1.0 and input.numel() > 0


class _OnCuda:
    """`torch.nn.functional.dropout` as a card runs it, put in its module's place while a dry run for a card runs (a
    function mode would not reach a checkpointed layer's recompute in backward: `attention._OnCuda` says why)."""

    def __init__(self, original):
        self.original = original

    def __call__(self, input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False):
        if not fused_on_cuda(input, p, training, inplace):
            return self.original(input, p, training, inplace)
        return torch.ops.aten.native_dropout(input, p, True)[0]


@contextmanager
def on_cuda(card: bool) -> Iterator[None]:
    """Every `torch.nn.functional.dropout` called inside runs as on a CUDA card (`card` True); nothing changes
    otherwise."""
    if not card:
        yield
        return
    original = F.dropout
    F.dropout = _OnCuda(original)
    try:
        yield
    finally:
        F.dropout = original
