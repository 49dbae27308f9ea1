"""What an op costs on a device: its FLOPs and the bytes it reads and writes (`op_cost`), priced on a device's
roofline (`roofline`: the longer of the two at the device's rates). The clock a count times ops by (`clock_for`: what
the engine's profile and the levers' measurements weigh recompute by, on fake tensors where no op really runs) and
the costs of a whole step kept to be priced on any device after it (`OpCosts`). A device is any object with
`flops_low` (16-bit tensor cores), `flops_fp32` and `bandwidth` (bytes a second): `planning.devices.Device`."""

from typing import List, Optional

from .. import _torch_api
from ..nested import tensors_in

# an op whose schema says its output is not a view, though it is one (`reshape`'s and `matmul`'s own view)
_VIEWS_UNSAID = frozenset({"_unsafe_view"})


def op_cost(func, args, kwargs, out) -> Optional[tuple]:
    """An op's (FLOPs, bytes read and written, whether it runs in 16 bits); None for an op that moves nothing: a view,
    and a query of a tensor's metadata (`prim.device`, which a fake tensor dispatches: priced by their tensors' bytes,
    such queries were 1.7 s of an 8B step's 7.4 s at 65,536 tokens on the H200's roofline)."""
    if (
        _torch_api.returns_alias(func)
        or _torch_api.returns_no_tensor(func)
        or _torch_api.op_name(func) in _VIEWS_UNSAID
    ):
        return None
    tensors = [t for t in tensors_in(args) + tensors_in(kwargs) + tensors_in(out) if t.dtype.is_floating_point]
    moved = float(sum(t.numel() * t.element_size() for t in tensors))
    return _flops(func, args, kwargs, out), moved, bool(tensors) and tensors[0].element_size() == 2


def roofline(flops: float, moved: float, low: bool, device) -> float:
    """One op's seconds on `device`: the longer of its FLOPs at the device's rate (16-bit tensor cores, or fp32) and
    its bytes at the device's bandwidth (no overlap between ops, no launch costs)."""
    return max(flops / (device.flops_low if low else device.flops_fp32), moved / device.bandwidth)


class OpCosts:
    """Each op's cost (`op_cost`), kept so that any device's roofline can be priced after the run (`seconds`)."""

    def __init__(self):
        self.costs: List[tuple] = []

    def add(self, func, args, kwargs, out) -> None:
        cost = op_cost(func, args, kwargs, out)
        if cost is not None:
            self.costs.append(cost)

    def seconds(self, device) -> float:
        return sum(roofline(flops, moved, low, device) for flops, moved, low in self.costs)


def clock_for(device):
    """A count's clock (`StorageCount.clock`): each op's seconds on `device`'s roofline."""

    def clock(func, args, kwargs, out) -> float:
        cost = op_cost(func, args, kwargs, out)
        return 0.0 if cost is None else roofline(*cost, device)

    return clock


# Attention's kernels, priced by the package's own formula whatever the torch: FLOPs per b h_q s_q s_k d (h_q: the
# queries' heads; keys and values may have fewer, grouped-query attention, each shared by h_q / h_kv of them) and the
# argument holding the queries, the keys following it. Forward: the scores and their product with the values (2 + 2);
# backward: the scores again and the four products of the gradients (10: 2.5 times the forward). The causal half is not
# taken off (as torch's own counter). Torch's counter is not asked: before pytorch/pytorch#177169 (March 2026; torch
# 2.11, the GPU image's, is before it) it asserts that the keys have as many heads as the queries, so it raised on
# every grouped-query model (Llama 3, Qwen, Mistral) and the op was priced as free: an H200 run with torch 2.11 chose
# recomputing attention at 65,536 tokens where the same dry run with torch 2.13 keeps it in 15 layers of 32
# (BENCHMARKS.md).
_ATTENTION_FORWARD = (
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)
ATTENTION_FLOPS = {
    **{name: (4.0, 0) for name in _ATTENTION_FORWARD},
    **{f"{name}_backward": (10.0, 1) for name in _ATTENTION_FORWARD},
}


def _flops(func, args, kwargs, out) -> float:
    """An op's FLOPs: attention's kernels by `ATTENTION_FLOPS` (on the CPU as on a card), torch's own counter's formula
    elsewhere where it has one (matmuls, convolutions), 0 for the rest (elementwise ops are priced by their bytes) and
    where torch's formula cannot read the op's arguments."""
    from torch.utils.flop_counter import flop_registry

    attention = ATTENTION_FLOPS.get(_torch_api.op_name(func))
    if attention is not None:
        factor, at = attention
        q, k = args[at], args[at + 1]
        b, h, s_q, d = q.shape
        return factor * b * h * s_q * k.shape[-2] * d
    count = flop_registry.get(getattr(func, "_overloadpacket", None))
    if count is None:
        return 0.0
    try:
        return float(count(*args, **kwargs, out_val=out))
    except Exception:
        return 0.0
