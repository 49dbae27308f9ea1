"""Finding a model's transformer layers, and replacing their `forward` on the instance (and giving it back).
Replacing the instance's `forward` leaves the module tree, `state_dict` keys and DDP / DeepSpeed wrapping alone."""

from typing import Callable, List, Optional

from torch import nn

STATE = "_memopt_recompute"  # the attribute of the wrapped model that holds the engine's state (`RecomputeState`)


def _block_list(module: nn.Module) -> bool:
    """An `nn.ModuleList` of modules, or an `nn.Sequential` of blocks (each a module of modules: a plain `Linear,
    GELU, Linear` stack is one block's insides, not a list of blocks)."""
    if isinstance(module, nn.ModuleList):
        return len(module) > 0
    if isinstance(module, nn.Sequential):
        return len(module) > 0 and all(any(True for _ in item.children()) for item in module)
    return False


def find_layers(model: nn.Module) -> List[nn.Module]:
    """The model's transformer layers, in order: the `nn.ModuleList`s (or `nn.Sequential`s of blocks) whose items
    are the model's repeated blocks (`_no_split_modules` where the model names them, else the longest list of one
    module class)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    lists = [m for m in model.modules() if _block_list(m)]
    layers = [item for lst in lists if all(type(i).__name__ in names for i in lst) for item in lst]
    if layers:
        return layers
    uniform = [lst for lst in lists if len({type(i) for i in lst}) == 1 and any(True for _ in lst[0].parameters())]
    if not uniform:
        return []
    return list(max(uniform, key=len))


def towers(model: nn.Module, layers: List[nn.Module]) -> List[str]:
    """Where the layer list comes from, where it comes from more than one list (a vision tower's blocks beside the
    language model's layers): one line a list, `layers 0-1: model.vision_tower.encoder.layers (SiglipEncoderLayer)`.
    Nothing for one list: its layers are the model's, in order."""
    names = {id(m): n for n, m in model.named_modules()}
    groups: List[list] = []  # [parent path, first, last, class names]
    for i, layer in enumerate(layers):
        path = names.get(id(layer), "").rpartition(".")[0] or "?"
        if groups and groups[-1][0] == path and groups[-1][2] == i - 1:
            groups[-1][2] = i
            groups[-1][3].add(type(layer).__name__)
        else:
            groups.append([path, i, i, {type(layer).__name__}])
    if len(groups) < 2:
        return []
    return [
        f"layer{'s' if b > a else ''} {a}{f'-{b}' if b > a else ''}: {path} ({', '.join(sorted(kinds))})"
        for path, a, b, kinds in groups
    ]


def repeated(layers: List[nn.Module]) -> List[List[int]]:
    """The positions of each module found at several positions of the layer list (`nn.ModuleList([block] * 2)`:
    one module run twice a step)."""
    at: dict = {}
    for i, layer in enumerate(layers):
        at.setdefault(id(layer), []).append(i)
    return [positions for positions in at.values() if len(positions) > 1]


def distinct(layers: List[nn.Module]) -> List[nn.Module]:
    """The layer list with each module once, at its first position: a module runs one forward of ours, which each
    of its uses calls."""
    seen: set = set()
    return [layer for layer in layers if not (id(layer) in seen or seen.add(id(layer)))]


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


def whole_layers_flag(indexes: List[int], n_layers: int) -> str:
    """Our flag for whole-layer recompute of these layers."""
    if indexes == list(range(n_layers)):
        return "`--memory_opt_level 1`"
    step = indexes[1] - indexes[0] if len(indexes) > 1 else 0
    if step > 1 and indexes == list(range(0, n_layers, step)):
        return f"`--memory_opt_config 'Layer+:1:-1@every{step}'`"
    return f"`--memory_opt_config 'Layer+:1:-1@{'+'.join(map(str, indexes))}'`"


def run_order_problem(calls: List[int], kinds: List[str], owner: str) -> Optional[str]:
    """Why a step that ran the layer list's layers (`kinds`: each one's class name) in the order `calls` (their
    indices, one per layer forward) cannot be measured layer by layer (the watch follows a step's layers in the list's
    order, once each; some may be left out); None where it can."""

    def names(ks) -> str:
        return ", ".join(f"{k} ({kinds[k]})" for k in ks)

    again = sorted({k for k in calls if calls.count(k) > 1})
    if again:
        return (
            f"a step of {owner} runs layers {names(again)} several times each ({len(calls)} layer forwards for "
            f"{len(set(calls))} layers), and step one is measured layer by layer, once each"
        )
    back = next((i for i in range(1, len(calls)) if calls[i] < calls[i - 1]), None)
    if back is not None:
        return (
            f"a step of {owner} runs layer {names([calls[back]])} after layer {names([calls[back - 1]])}, against "
            f"the order the layer list holds them in, and step one is measured over the layers in the list's order"
        )
    return None


def checkpointed_elsewhere(model: nn.Module, layers: List[nn.Module]) -> Optional[str]:
    """Why the model's layers are already recomputed by something other than this backend (transformers' activation
    checkpointing turned on, or torch's `checkpoint_wrapper` around them), which would recompute them twice over;
    None when nothing is."""
    wrapped = [i for i, layer in enumerate(layers) if hasattr(layer, "_checkpoint_wrapped_module")]
    if wrapped:
        return (
            f"{len(wrapped)} of {type(model).__name__}'s {len(layers)} layers are wrapped in torch's "
            f"`checkpoint_wrapper` (FSDP's `activation_checkpointing`, `fsdp_config={{'activation_checkpointing': "
            f"True}}` or `fsdp_activation_checkpointing: true` in accelerate's config, or a script's own "
            f"`apply_activation_checkpointing`), so with the torch backend they would be recomputed twice over; "
            f"turn it off and pass {whole_layers_flag(wrapped, len(layers))} for the same recompute, or pass "
            f"`--memory_opt_backend none` to keep it"
        )
    on = [i for i, layer in enumerate(layers) if getattr(layer, "gradient_checkpointing", False) is True]
    if not on:
        return None
    return (
        f"transformers' activation checkpointing is on in {len(on)} of {type(model).__name__}'s {len(layers)} layers "
        f"(`model.activation_checkpointing_enable()` or `gradient_checkpointing_enable()` was called on it: by the "
        f"script, by PEFT's `prepare_model_for_kbit_training`, or by a trainer given `gradient_checkpointing=True`), "
        f"so with the torch backend they would be recomputed twice over; call `model.activation_checkpointing_"
        f"disable()` and pass {whole_layers_flag(on, len(layers))} for the same recompute, or pass "
        f"`--memory_opt_backend none` to keep transformers' checkpointing"
    )
