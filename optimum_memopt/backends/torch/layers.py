"""Finding a model's transformer layers, and replacing their `forward` on the instance (and giving it back).
Replacing the instance's `forward` leaves the module tree, `state_dict` keys and DDP / DeepSpeed wrapping alone."""

from typing import Callable, List

from torch import nn


def find_layers(model: nn.Module) -> List[nn.Module]:
    """The model's transformer layers, in order: the `nn.ModuleList`s whose items are the model's repeated
    blocks (`_no_split_modules` where the model names them, else the longest list of one module class)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    layers = [item for lst in lists if all(type(i).__name__ in names for i in lst) for item in lst]
    if layers:
        return layers
    uniform = [lst for lst in lists if len({type(i) for i in lst}) == 1 and any(True for _ in lst[0].parameters())]
    if not uniform:
        return []
    return list(max(uniform, key=len))


class LayerForwards:
    """The layers' own `forward`s, kept while ours is installed on each instance."""

    def __init__(self, layers: List[nn.Module]):
        self.layers = layers
        self.originals = [layer.forward for layer in layers]
        self._own = ["forward" in vars(layer) for layer in layers]  # set on the instance before us

    def install(self, forward: Callable[[int], Callable]) -> None:
        """`forward(i)` is the callable that replaces layer i's forward."""
        for i, layer in enumerate(self.layers):
            layer.forward = forward(i)

    def uninstall(self) -> None:
        """Give each layer its `forward` back (a model wrapped again, by another trainer, starts clean)."""
        for layer, original, own in zip(self.layers, self.originals, self._own):
            if own:
                layer.forward = original
            else:
                vars(layer).pop("forward", None)
