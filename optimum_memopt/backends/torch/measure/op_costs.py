"""What an op costs on a device: its FLOPs and the bytes it reads and writes (`op_cost`), priced on a device's
roofline (`roofline`: the longer of the two at the device's rates). The clock a count times ops by (`clock_for`: what
the engine's profile and the levers' measurements weigh recompute by, on fake tensors where no op really runs) and
the costs of a whole step kept to be priced on any device after it (`OpCosts`). A device is any object with
`flops_low` (16-bit tensor cores), `flops_fp32` and `bandwidth` (bytes a second): `planning.devices.Device`."""

from typing import List, Optional

from .. import _torch_api
from ..nested import tensors_in


def op_cost(func, args, kwargs, out) -> Optional[tuple]:
    """An op's (FLOPs, bytes read and written, whether it runs in 16 bits); None for a view (it moves nothing)."""
    if _torch_api.returns_alias(func):
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


# The CPU's attention kernels (what a dry run on the CPU device runs), priced as the GPU's: (FLOPs per b h s_q s_k d,
# the argument holding the queries; the keys follow it)
_CPU_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": (4.0, 0),
    "_scaled_dot_product_flash_attention_for_cpu_backward": (10.0, 1),
}


def _flops(func, args, kwargs, out) -> float:
    """An op's FLOPs: torch's own counter's formula where it has one (matmuls, convolutions, the GPU's attention
    kernels), the CPU's attention kernels as the GPU's (4 b h s_q s_k d forward, 2.5 times that backward, the causal
    half not taken off), 0 elsewhere (elementwise ops are priced by their bytes)."""
    from torch.utils.flop_counter import flop_registry

    packet = getattr(func, "_overloadpacket", None)
    count = flop_registry.get(packet)
    if count is not None:
        try:
            return float(count(*args, **kwargs, out_val=out))
        except Exception:
            return 0.0
    attention = _CPU_ATTENTION.get(_torch_api.op_name(func))
    if attention is not None:
        factor, at = attention
        q, k = args[at], args[at + 1]
        b, h, s_q, d = q.shape
        return factor * b * h * s_q * k.shape[-2] * d
    return 0.0
