"""Plan names: ONNX Runtime's operator names and the aten ops (overload packets) they stand for.

A plan names an operator by either: `Gelu+` and `gelu+` are the same plan here. The report uses the first ORT
name listed for an op, and the aten name for ops with no ORT counterpart (`silu+`).
"""

from typing import Dict, List, Tuple

import torch

OP_NAMES: Dict[str, Tuple[str, ...]] = {
    "Gelu": ("gelu",),
    "BiasGelu": ("gelu",),
    "FastGelu": ("gelu",),
    "Softmax": ("_softmax", "softmax", "_safe_softmax"),
    "BiasSoftmax": ("_softmax", "softmax", "_safe_softmax"),
    "Dropout": ("native_dropout",),
    "BitmaskDropout": ("native_dropout",),
    "BiasDropout": ("native_dropout",),
    "LayerNormalization": ("native_layer_norm",),
    "SkipLayerNormalization": ("native_layer_norm",),
    "SimplifiedLayerNormalization": ("_fused_rms_norm", "rms_norm"),
    "MatMul": ("mm", "addmm", "bmm", "baddbmm", "matmul"),
    "FusedMatMul": ("mm", "addmm", "bmm", "baddbmm", "matmul"),
    "Gemm": ("mm", "addmm", "bmm", "baddbmm", "matmul"),
    "Add": ("add",),
    "Sub": ("sub", "rsub"),
    "Mul": ("mul",),
    "Div": ("div",),
    "Cast": ("_to_copy",),
    "Where": ("where",),
    "Tanh": ("tanh",),
    "Sigmoid": ("sigmoid",),
    "Exp": ("exp",),
    "Pow": ("pow",),
    "Sqrt": ("sqrt",),
    "Neg": ("neg",),
    "Concat": ("cat",),
    "ReduceMean": ("mean",),
    "ReduceSum": ("sum",),
    "Gather": ("embedding", "index_select", "gather"),
    # scaled dot-product attention, whichever kernel runs it: a plan made where one runs (a dry run on the CPU's
    # fake tensors) recomputes the one that runs where it is applied (flash, memory-efficient or cuDNN on CUDA)
    "Attention": (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_fused_attention_overrideable",
    ),
}
# ORT operators that only reshape or re-index: in PyTorch they are views, which create no storage, so a plan
# part naming one adds nothing to recompute (`Reshape+Where+BiasSoftmax+` recomputes `where` and the softmax).
VIEW_NAMES = ("Reshape", "Transpose", "Squeeze", "Unsqueeze", "Expand", "Slice", "Identity", "Flatten")
_PLAN_OF_OP: Dict[str, str] = {}
for _ort, _ops in OP_NAMES.items():
    for _op in _ops:
        _PLAN_OF_OP.setdefault(_op, _ort)


def plan_name(op: str) -> str:
    """The plan name of an aten op (overload packet name): its ORT name where one corresponds."""
    return _PLAN_OF_OP.get(op, op)


def canonical_ops(subgraph: str) -> Tuple[List[str], List[str]]:
    """The plan names a requested subgraph stands for here, and the parts that name no operator this backend
    knows (neither an ORT name of `OP_NAMES`, a view, nor an aten op)."""
    names, unknown = [], []
    ort_lower = {k.lower(): k for k in OP_NAMES}
    views = {v.lower() for v in VIEW_NAMES}
    for part in (p for p in subgraph.split("+") if p):
        low = part.lower()
        if low in views:
            continue
        if low in ort_lower:
            name = plan_name(OP_NAMES[ort_lower[low]][0])
        elif hasattr(torch.ops.aten, part) or hasattr(torch.ops.aten, low):
            name = plan_name(part if hasattr(torch.ops.aten, part) else low)
        else:
            unknown.append(part)
            continue
        if name not in names:
            names.append(name)
    return names, unknown
