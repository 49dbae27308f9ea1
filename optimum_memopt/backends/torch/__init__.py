"""The torch backend: recompute plans on current PyTorch, without ONNX Runtime.

It changes nothing in the model's structure: each transformer layer's `forward` is replaced, on the instance,
by one that runs the original under the engine while the model trains (grad enabled, `model.training`);
evaluation, `state_dict`, `save_pretrained` and DDP / DeepSpeed see the model as it was.

**Planned ops** (`Gelu+:1:-1`): while a layer runs forward, a dispatch mode (`tracking`) sees each aten op and the
storage its outputs create, and saved-tensor hooks (`hooks`) see every tensor autograd saves for backward. When
autograd saves a tensor whose storage an op of the layer's policy created (the output of `gelu`, say), and every
input of that op is a parameter or a tensor autograd already keeps for backward, the hook keeps a *recipe*
(`recipe`) instead: the op, its inputs, the RNG state for random ops. The output is freed, and backward recomputes
it when it needs it. Only the planned ops run twice, the saving is the planned outputs' bytes, and the values are
bitwise those of the first run (same kernel, same inputs, same RNG state), so losses equal plain PyTorch.

**Whole layers** (`--memory_opt_level 1`, or a layer's policy `layer`): `torch.utils.checkpoint` around the layer
(`checkpoint`).

**Measure, decide, apply apart**: step one is profiled into a `ModelProfile` (`profile`: bytes per plan and
layer, recomputable or not and why, op times); a `RecomputePolicy` (`policy`: per layer keep / ops / whole layer,
each op with the request it came from) decides; the engine (`engine`) applies it; the table (`report`) is built
from the profile and the policy. docs/DESIGN.md has the reasoning and the figures.

This module stays light (no engine imported): the arguments ask it whether the backend can run.
"""

from .needs import MIN_TORCH, torch_problem

__all__ = ["MIN_TORCH", "torch_problem", "TorchBackend", "RecomputePolicy", "LayerPolicy", "ModelProfile"]


def __getattr__(name):
    if name == "TorchBackend":
        from .backend import TorchBackend

        return TorchBackend
    if name in ("RecomputePolicy", "LayerPolicy"):
        from . import policy

        return getattr(policy, name)
    if name == "ModelProfile":
        from .measure.profile import ModelProfile

        return ModelProfile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
