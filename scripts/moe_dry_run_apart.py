"""Where a MoE dry run and the same step on real tensors part (the GPU kit's open question: fp32 experts on CUDA).

    python scripts/moe_dry_run_apart.py [--device cuda] [--dtype float32] [--archs qwen3_moe mixtral ...]

For each family (tests/test_moe.py's tiny configs), the plain step on fake tensors and on `--device`: each run's peak,
its parts, and per op the calls and the bytes the count grew by; the ops whose figures differ are printed. Then the
real step again with transformers' fallback experts kernel forced (the kernel the fake step takes for fp32), to tell a
kernel's choice from a counting difference. On CUDA the fake step runs this card's attention
kernels (`backends.torch.measure.attention`; `--cpu_attention`: the CPU's, as before that module, which is how its gap
was found).
"""

import argparse
import contextlib
import os
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from optimum_memopt.backends.torch import fake_step as dr  # noqa: E402
from optimum_memopt.planning.dry_run import dry_run  # noqa: E402


def by_op(run_once):
    """`run_once()` under a count that also keeps, per op, its calls and the bytes the count grew by."""
    grew = defaultdict(lambda: [0, 0])
    original = dr.PartsCount.__torch_dispatch__

    def logged(self, func, types, args=(), kwargs=None):
        before = self.current
        out = original(self, func, types, args, kwargs)
        entry = grew[dr._torch_api.op_name(func)]
        entry[0] += 1
        entry[1] += self.current - before
        return out

    dr.PartsCount.__torch_dispatch__ = logged
    try:
        result = run_once()
    finally:
        dr.PartsCount.__torch_dispatch__ = original
    return result, dict(grew)


@contextlib.contextmanager
def fallback_experts():
    from transformers.integrations import moe

    chosen = moe._can_use_grouped_mm
    moe._can_use_grouped_mm = lambda input, weight, offs: False
    try:
        yield
    finally:
        moe._can_use_grouped_mm = chosen


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--archs", nargs="*", default=["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "olmoe"])
    parser.add_argument("--cpu_attention", action="store_true", help="the fake step takes the CPU's attention kernel")
    args = parser.parse_args()
    from optimum_memopt.backends.torch.measure.attention import CudaKernels

    kernels = CudaKernels.here() if args.device == "cuda" and not args.cpu_attention else None
    from test_moe import moe

    if args.device == "cuda":
        torch.use_deterministic_algorithms(True, warn_only=True)
        from transformers.integrations import moe as kernels

        w = torch.zeros(4, 8, 8, device="cuda", dtype=getattr(torch, args.dtype))
        print(
            "grouped_mm chosen on real",
            args.dtype,
            "CUDA:",
            kernels._can_use_grouped_mm(
                torch.zeros(8, 8, device="cuda"), w, torch.tensor([2, 4, 6, 8], device="cuda")
            ),
            "; F.grouped_mm:",
            hasattr(torch.nn.functional, "grouped_mm"),
        )
    for arch in args.archs:
        spec = dr.StepSpec(moe(arch).config, batch=4, seq=16, dtype=args.dtype)
        fake, fake_ops = by_op(lambda: dry_run(spec, backend=False, kernels=kernels))
        real, real_ops = by_op(lambda: dry_run(spec, fake=False, device=args.device, backend=False))
        with fallback_experts():
            forced, _ = by_op(lambda: dry_run(spec, fake=False, device=args.device, backend=False))
        print(
            f"\n== {arch} {args.dtype}: fake {fake.peak_bytes}, real {real.peak_bytes} "
            f"(apart {real.peak_bytes - fake.peak_bytes:+d} B), real with the fallback kernel {forced.peak_bytes} "
            f"(apart {forced.peak_bytes - fake.peak_bytes:+d} B)"
        )
        print("  peak at: fake", fake.peak_at, "| real", real.peak_at, "| forced", forced.peak_at)
        print("  parts fake:", fake.parts)
        print("  parts real:", real.parts)
        for name in sorted(set(fake_ops) | set(real_ops)):
            f, r = fake_ops.get(name, [0, 0]), real_ops.get(name, [0, 0])
            if f != r:
                print(f"  {name:48s} fake {f[0]:4d} calls {f[1]:+9d} B | real {r[0]:4d} calls {r[1]:+9d} B")


if __name__ == "__main__":
    main()
