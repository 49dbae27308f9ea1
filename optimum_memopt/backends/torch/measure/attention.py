"""The attention kernel a CUDA card runs, on a dry run's fake tensors.

`torch.nn.functional.scaled_dot_product_attention` picks a kernel by the device its tensors are on, and each keeps its
own tensors for backward: on the CPU (where a dry run's fake tensors are) a flash kernel for every dtype; on a CUDA
card cuDNN's or the flash kernel in fp16/bf16, memory-efficient attention where those cannot run (fp32, a mask, a head
dimension they do not take), and otherwise the math path, which keeps the softmax's probabilities (batch x heads x
queries x keys) and, with fewer key/value heads than query heads, copies of the keys and values repeated. So a dry
run for a card lets the card's rules choose, never the CPU's: under `on_cuda(kernels)` the fake step runs the kernel
`choose` names, as the composite op prepares its inputs on CUDA (flash: the head dimension padded to a multiple of 8;
memory-efficient: a boolean mask made a float bias, padded where its strides are not multiples of 8, expanded over the
heads), through the same aten ops, whose fake (meta) rules give their outputs' shapes; each keeps its random state
where the card keeps it (`_Kernel`), and the math path's dropout is the card's (`math_path`). Held to an H100's own
figures for every kind of input by tests/test_attention.py (tests/data/cuda_attention_kept_h100.json), and on a card
by tests/test_gpu_torch.py.

The rules are torch 2.11's (`aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`, the torch of the GPU kit's
image, whose runs hold `choose` to `torch._fused_sdp_choice`: tests/test_gpu_torch.py); another torch may choose
otherwise (later ones let memory-efficient attention take grouped-query heads). Not modelled: nested tensors; cuDNN's
handling of a mask is taken as memory-efficient attention's (a float bias of the mask's shape).
"""

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import FrozenSet, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F

CUDNN, FLASH, EFFICIENT, MATH = "cudnn", "flash", "efficient", "math"
BACKENDS = (CUDNN, FLASH, EFFICIENT, MATH)
# torch._fused_sdp_choice's answer (`SDPBackend`'s values), by name
CHOICE_VALUES = {MATH: 0, FLASH: 1, EFFICIENT: 2, CUDNN: 3}
CUDNN_FIRST_VERSION = (
    91500  # torch 2.11 puts cuDNN's attention first on sm90/sm100 above this cuDNN (9.19 in its wheel)
)
LOW = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CudaKernels:
    """The card a dry run stands for, as far as its attention kernel goes: its compute capability, whether
    deterministic algorithms are on and not only warned about (`torch.use_deterministic_algorithms(True)`: cuDNN's
    attention is then not taken; with `warn_only=True` it is, as an H200 showed), the kernels enabled
    (`torch.backends.cuda.enable_*_sdp`), and the cuDNN version (None: the one torch 2.11's wheel brings)."""

    capability: Tuple[int, int]
    deterministic: bool = False
    enabled: FrozenSet[str] = field(default_factory=lambda: frozenset(BACKENDS))
    cudnn_version: Optional[int] = None

    @classmethod
    def here(cls, device=None) -> "CudaKernels":
        """This process's CUDA device (the current one, or `device`) as its next attention call would find it."""
        backends = torch.backends.cuda
        enabled = {
            name
            for name, on in (
                (CUDNN, getattr(backends, "cudnn_sdp_enabled", lambda: False)()),
                (FLASH, backends.flash_sdp_enabled()),
                (EFFICIENT, backends.mem_efficient_sdp_enabled()),
                (MATH, backends.math_sdp_enabled()),
            )
            if on
        }
        return cls(
            tuple(torch.cuda.get_device_capability(device)),
            torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled(),
            frozenset(enabled),
            torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        )

    def order(self) -> Tuple[str, ...]:
        """The kernels in the order torch tries them (`sdp::priority_order`)."""
        major, minor = self.capability
        cudnn_first = (
            major in (9, 10)
            and minor in (0, 3)
            and (self.cudnn_version is None or self.cudnn_version > CUDNN_FIRST_VERSION)
            and not os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED")
        )
        return (CUDNN, FLASH, EFFICIENT, MATH) if cudnn_first else (FLASH, EFFICIENT, MATH, CUDNN)


def choose(kernels: CudaKernels, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False) -> str:
    """The kernel the card runs for these inputs (a gradient wanted: read from the inputs and grad mode)."""
    for name in kernels.order():
        if name in kernels.enabled and _can(name, kernels, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa):
            return name
    return MATH


def _can(name, kernels, q, k, v, mask, dropout_p, is_causal, enable_gqa) -> bool:
    if name == MATH:
        return True
    major, minor = kernels.capability
    cap = major * 10 + minor
    if not (q.dim() == k.dim() == v.dim() == 4) or 0 in (q.shape[-2], k.shape[-2]):
        return False
    if any(t.stride(-1) != 1 and not (name == FLASH and t.shape[-1] == 1) for t in (q, k, v)):
        return False
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    d_q, d_k, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
    same_dtype = q.dtype == k.dtype == v.dtype
    heads_q, heads_k, heads_v = q.shape[1], k.shape[1], v.shape[1]
    batches = q.shape[0] == k.shape[0] == v.shape[0]
    grouped = heads_k == heads_v and heads_k > 0 and heads_q % heads_k == 0
    if name == FLASH:
        if mask is not None or not (d_q == d_k == d_v <= 256) or not 80 <= cap <= 121:
            return False
        if grad and (86 <= cap <= 89 or 120 <= cap <= 121) and (192 < d_q <= 224 or (d_q > 224 and dropout_p > 0)):
            return False
        if is_causal and q.shape[-2] != k.shape[-2]:
            return False
        heads = (heads_q == heads_k == heads_v) or (enable_gqa and grouped)
        return q.dtype in LOW and same_dtype and batches and heads
    if name == EFFICIENT:
        if not 50 <= cap <= 121 or d_q != d_k:
            return False
        align = 4 if q.dtype == torch.float32 else 8
        if d_q % align or d_v % align:
            return False
        if mask is not None and mask.stride(-1) != 1:
            return False
        if not (batches and heads_q == heads_k == heads_v):  # no grouped heads, whatever `enable_gqa` says
            return False
        return q.dtype in (torch.float16, torch.bfloat16, torch.float32) and same_dtype
    if name == CUDNN:  # torch 2.11: fp16/bf16, no deterministic algorithms, head dimension a multiple of 8
        most = 256 if major == 9 else 128
        if kernels.deterministic or q.dtype not in LOW or not same_dtype or d_q % 8 or d_q > most or d_q != d_k:
            return False
        if k.shape[-2] == 1 or (mask is not None and (mask.dim() not in (2, 4) or mask.requires_grad)):
            return False
        heads = (heads_q == heads_k == heads_v) or (enable_gqa and grouped)
        return batches and heads
    return False


def _float_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as the additive bias the composite op makes of it (0 where attended, -inf elsewhere)."""
    if mask.dtype != torch.bool:
        return mask
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.full((), -math.inf, dtype=dtype))


def _efficient_bias(mask: torch.Tensor, q, k) -> torch.Tensor:
    """Memory-efficient attention's bias: the mask padded (and sliced back) where its strides are not multiples of 8,
    expanded over batch and heads (`preprocess_mask`)."""
    keys = k.shape[-2]
    if any(s % 8 for s in mask.stride()[:-1]) or mask.stride(-1) != 1:
        mask = F.pad(mask, (0, 8 - keys % 8))[..., :keys]
    return mask.expand(q.shape[0], q.shape[1], q.shape[-2], keys)


def run(
    kernels: CudaKernels,
    q,
    k,
    v,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    ran=None,
):
    """`scaled_dot_product_attention` as the card runs it: the kernel `choose` names, its inputs prepared as the
    composite op prepares them on CUDA; the output (what the caller gets). `ran` (a dict) counts the kernel run."""
    aten = torch.ops.aten
    if torch.is_autocast_enabled("cpu"):  # the dry run's autocast stands for CUDA's, which runs attention in its dtype
        low = torch.get_autocast_dtype("cpu")
        q, k, v = (t.to(low) if t.is_floating_point() else t for t in (q, k, v))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    name = choose(kernels, q, k, v, attn_mask, dropout_p, is_causal, enable_gqa)
    if ran is not None:
        ran[name] = ran.get(name, 0) + 1
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    with torch.autocast("cpu", enabled=False):
        if name == FLASH:
            width = q.shape[-1]
            if width % 8:
                q, k, v = (F.pad(t, (0, 8 - width % 8)) for t in (q, k, v))
            return _Kernel.apply(FLASH, q, k, v, None, dropout_p, is_causal, scale, grad)[..., :width]
        if name in (CUDNN, EFFICIENT):
            bias = None if attn_mask is None else _float_bias(attn_mask, q.dtype)
            if bias is not None and name == EFFICIENT:
                bias = _efficient_bias(bias, q, k)
            return _Kernel.apply(name, q, k, v, bias, dropout_p, is_causal, scale, grad)
        if dropout_p > 0:
            return math_path(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, card_dropout)
        return aten._scaled_dot_product_attention_math(
            q, k, v, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]


def card_dropout(attn: torch.Tensor, p: float) -> torch.Tensor:
    """The math path's dropout as a card runs it: the fused `native_dropout`, which keeps a one-byte mask."""
    return torch.ops.aten.native_dropout(attn, p, True)[0]


def cpu_dropout(attn: torch.Tensor, p: float) -> torch.Tensor:
    """The math path's dropout as the CPU runs it: noise of the probabilities' dtype, kept by the multiplication."""
    return torch.dropout(attn, p, True)


def math_path(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, dropout):
    """`_scaled_dot_product_attention_math` op for op (torch 2.11's, aten's attention.cpp), its dropout `dropout`: aten
    calls the CPU's or the card's by the device its tensors are on, inside one op, so a dry run's fake tensors would
    keep the CPU's (four bytes an element of the fp32 probabilities, where an H100 kept one). With `cpu_dropout` it
    is aten's op on the CPU to the bit and keeps the same tensors (tests/test_attention.py holds both)."""
    low = q.dtype in LOW
    origin = q.dtype
    if low:  # the math path computes in fp32 for accuracy
        q, k, v = q.float(), k.float(), v.float()
    factor = math.sqrt(scale)
    q = q * factor
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if attn_mask is not None:
        attn_mask = _float_bias(attn_mask, q.dtype)
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
    attn = torch.matmul(q, k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        attn.add_(attn_mask)
    attn = torch.ops.aten._safe_softmax(attn, -1)
    attn = dropout(attn, dropout_p)
    return torch.matmul(attn, v).to(origin)


class _Kernel(torch.autograd.Function):
    """A CUDA kernel through its aten ops (`kernel`: flash, memory-efficient or cuDNN's), keeping for backward what
    CUDA keeps: the inputs, the bias, the output and the log-sum-exp, and the random state where the card keeps it:
    flash's and cuDNN's seed and offset are tensors on the card, kept with dropout or without (two 512-byte blocks a
    call); memory-efficient attention's are on the host, counted nowhere on the card (an H100, torch 2.11: the
    figures of tests/data/cuda_attention_kept_h100.json)."""

    @staticmethod
    def forward(ctx, kernel, q, k, v, bias, dropout_p, is_causal, scale, grad):
        aten = torch.ops.aten
        if kernel == FLASH:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
                q, k, v, dropout_p, is_causal, False, scale=scale
            )
            ctx.extra = (cum_q, cum_k, max_q, max_k)
        elif kernel == EFFICIENT:
            out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, grad, dropout_p, is_causal, scale=scale
            )
            ctx.extra = ()
        else:
            out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
                q, k, v, bias, grad, dropout_p, is_causal, False, scale=scale
            )
            ctx.extra = (cum_q, cum_k, max_q, max_k)
        on_host = kernel == EFFICIENT
        ctx.host_rng = (seed, offset) if on_host else None
        ctx.save_for_backward(
            q, k, v, out, lse, *((bias,) if bias is not None else ()), *(() if on_host else (seed, offset))
        )
        ctx.kernel, ctx.bias, ctx.args = kernel, bias is not None, (dropout_p, is_causal, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        aten = torch.ops.aten
        q, k, v, out, lse, *rest = ctx.saved_tensors
        bias = rest.pop(0) if ctx.bias else None
        seed, offset = rest or ctx.host_rng
        dropout_p, is_causal, scale = ctx.args
        if ctx.kernel == FLASH:
            cum_q, cum_k, max_q, max_k = ctx.extra
            dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, scale=scale
            )
        elif ctx.kernel == EFFICIENT:
            dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
                grad, q, k, v, bias, out, lse, seed, offset, dropout_p, [True, True, True, False], is_causal,
                scale=scale,
            )  # fmt: skip
        else:
            cum_q, cum_k, max_q, max_k = ctx.extra
            none = torch.empty(0)
            dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                grad, q, k, v, out, lse, seed, offset, none if bias is None else bias,
                none if cum_q is None else cum_q, none if cum_k is None else cum_k, max_q, max_k, dropout_p,
                is_causal, scale=scale,
            )  # fmt: skip
        return None, dq, dk, dv, None, None, None, None, None


class _OnCuda:
    """`torch.nn.functional.scaled_dot_product_attention` as `kernels`' card runs it, put in its module's place (a
    function mode would not reach a checkpointed layer's recompute in backward, which then kept other tensors than
    its forward: torch.utils.checkpoint refused it). `ran` counts the kernels run."""

    def __init__(self, kernels: CudaKernels):
        self.kernels = kernels
        self.ran = {}

    def __call__(self, *args, **kwargs):
        return run(self.kernels, *args, **kwargs, ran=self.ran)


@contextmanager
def on_cuda(kernels: Optional[CudaKernels]) -> Iterator[Optional[_OnCuda]]:
    """Every `torch.nn.functional.scaled_dot_product_attention` called inside (by its module's name, as transformers
    calls it) runs as on `kernels`' card; nothing changes where `kernels` is None. Yields what counts the kernels
    run (`ran`)."""
    if kernels is None:
        yield None
        return
    original = F.scaled_dot_product_attention
    mine = _OnCuda(kernels)
    F.scaled_dot_product_attention = mine
    try:
        yield mine
    finally:
        F.scaled_dot_product_attention = original
