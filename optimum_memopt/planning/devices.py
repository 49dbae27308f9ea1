"""The devices a plan is made for: each card's memory and its rates, as NVIDIA's data sheets give them (dense, no
sparsity: BF16/FP16 tensor-core FLOP/s with FP32 accumulation, FP32 FLOP/s without tensor cores, memory bandwidth),
and the link to the host's memory the card sits on (its PCIe generation at x16, one way: what an offload's copies
run at, at best).

What a step can hold on a card is less than its memory: the CUDA context takes some, with what an op holds inside
itself (`CONTEXT_GIB`, a round figure: about 0.5 GiB for the context on an H100, and an attention backward's or a
reduction's scratch: 65 and 128 MiB in the GPU kit's decoder), and the caching allocator's fragmentation takes a
share of the rest (`FRAGMENTATION`). Both are stated beside every plan that uses them, and a budget given in MiB
replaces them.

cuBLAS's workspaces are tensors' blocks in the caching allocator, counted by CUDA's `memory_allocated` from a
thread's first matmul on, one for each thread that runs them (a training step's forward and autograd's backward):
`WORKSPACES_MIB`, which a dry run for a card counts in `other` from the start. Measured on an H200 (torch 2.11, CUDA
13.0, the default `CUBLAS_WORKSPACE_CONFIG`; docs/GPU.md): 32 MiB a thread, 65 MiB made in all by a small product
with and without a bias, forward and backward (`measure.live.make_library_workspaces`); counted for every card here
(torch's default is smaller before Hopper: an upper figure there).
"""

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

GIB_MIB = 1024.0
CONTEXT_GIB = 1.0
FRAGMENTATION = 0.05
WORKSPACES_MIB = 65.0  # cuBLAS's, the forward's thread and autograd's: measured on an H200 (docs/GPU.md)


PCIE4, PCIE5 = 32e9, 64e9  # PCIe 4.0 and 5.0 at x16, bytes/s each way (64 and 128 GB/s both ways together)


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float  # the card's memory (its "80 GB" is 80 GiB of HBM)
    flops_low: float  # BF16/FP16 tensor-core FLOP/s, dense, FP32 accumulation
    flops_fp32: float  # FP32 FLOP/s (no TF32: PyTorch's matmuls run in full FP32 unless TF32 is allowed)
    bandwidth: float  # memory bandwidth, bytes/s
    capability: Tuple[int, int] = (9, 0)  # CUDA compute capability: which attention kernels it runs (`attention`)
    host_link: float = PCIE4  # bytes/s each way between the card and the host's memory (PCIe x16, its data sheet's)
    host_link_name: str = "PCIe 4.0 x16"

    @property
    def budget_mb(self) -> float:
        """What a step's tensors can hold, in MiB: the memory less the context, less the fragmentation's share."""
        return (self.memory_gib - CONTEXT_GIB) * GIB_MIB * (1.0 - FRAGMENTATION)

    def describe_budget(self) -> str:
        return (
            f"{self.name}: {self.memory_gib:g} GiB; {self.budget_mb:,.0f} MiB for the step's tensors "
            f"({CONTEXT_GIB:g} GiB left to the CUDA context and the libraries' workspaces, {FRAGMENTATION:.0%} of the "
            f"rest to the allocator's fragmentation; `--memory_budget_mb` sets it)"
        )


T = 1e12
DEVICES: Dict[str, Device] = {
    d.name: d
    for d in (
        Device("H100-80GB", 80, 989.4 * T, 66.9 * T, 3.35e12, (9, 0), PCIE5, "PCIe 5.0 x16"),  # H100 SXM5
        Device("H200", 141, 989.4 * T, 66.9 * T, 4.8e12, (9, 0), PCIE5, "PCIe 5.0 x16"),  # H200 SXM
        Device("A100-80GB", 80, 312 * T, 19.5 * T, 2.039e12, (8, 0)),  # A100 SXM4 80GB
        Device("A100-40GB", 40, 312 * T, 19.5 * T, 1.555e12, (8, 0)),  # A100 SXM4 40GB
        Device("L40S", 48, 362.05 * T, 91.6 * T, 0.864e12, (8, 9)),
        Device("L4", 24, 121 * T, 30.3 * T, 0.3e12, (8, 9)),
        Device("RTX-4090", 24, 165.2 * T, 82.6 * T, 1.008e12, (8, 9)),
    )
}


DEFAULT_DEVICE = "H100-80GB"  # whose roofline times a dry run's ops where no device is named (recompute's ranking)


def device(name: str) -> Device:
    """The device named (case and `-`/`_`/space ignored: `h100`, `H100 80GB`, `a100_40gb`)."""
    key = _key(name)
    found = [d for d in DEVICES.values() if _key(d.name) == key]
    if not found:
        found = [d for d in DEVICES.values() if _key(d.name).startswith(key)]
    if len(found) == 1:
        return found[0]
    raise ValueError(
        f"`--device {name}` is not in the device table; accepted: {', '.join(DEVICES)} (as in `--device H100-80GB`), "
        f"or give `--memory_budget_mb` instead"
    )


def _key(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def find(name: Optional[str]) -> Optional[Device]:
    return None if name is None else device(name)
