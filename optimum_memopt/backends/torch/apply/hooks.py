"""The saved-tensor hooks of a layer's forward: for each tensor autograd saves, keep a recipe (when an op of the
policy made it and its inputs are kept anyway) or keep it as it is; unpack rebuilds it; `finish` folds what was
kept into the step-one profile.

Two things autograd does for saved tensors it stops doing once saved-tensor hooks are registered, and which these
hooks therefore do themselves:

* the version check: a tensor kept as it is and changed in place after it was saved raises at unpack, as plain
  PyTorch raises ("modified by an inplace operation"), instead of backward silently using the changed values.
  A planned output written to after it was saved is seen by the tracker (the op's schema says it writes) and
  raises the same error when backward asks for it; one changed before any save is kept as it is;
* the enclosing hooks: only the innermost hooks run, so a user's `torch.autograd.graph.save_on_cpu()` or an
  offloading hook around the step (TRL's) would never see a tensor saved inside a layer. Every tensor kept as it is
  is handed on to the hooks that were active when the layer started (checkpoint's own, at level 1), and unpacked
  through them; a planned output is not (its recipe stands in for it). A recipe whose input is such a tensor
  replays from what those hooks give back, never from a reference of its own: an offloading hook that moved the
  tensor to the host frees it on the device as it would in plain PyTorch, and the hooks see each tensor once (the
  recipe shares the save's package, unpacked once for both). When hooks of the user's take a tensor, they decide
  what it is worth at backward, as in plain PyTorch (which does not check versions through hooks either).
"""

import contextlib
import weakref
from typing import Dict, Optional, Sequence

import torch

from .. import _torch_api
from ..measure.graph import PARAM, LayerGraph, Node
from ..measure.profile import CHANGED_IN_PLACE, INPUT_NOT_KEPT, OTHER_DTYPE, ROUTING
from ..nested import tensors_in
from ..rule import KEPT, RecomputeRule
from .recipe import Recipe, StandIn, Stashed, changed_in_place
from .tracking import LayerRun, Made, TrackingMode, storage_bytes, storage_key


def _kept(run: LayerRun, t: Optional[torch.Tensor]) -> bool:
    """Whether autograd keeps this (live) tensor's storage as it is; a freed input (None) is not kept."""
    if t is None:
        return False
    ptr = storage_key(t)
    ref = run.kept.get(ptr)
    held = ref() if ref is not None else None
    return held is not None and storage_key(held) == ptr


def _changed_since_made(made, x: torch.Tensor) -> bool:
    return made.version != _torch_api.version(x) or (made.recipe is not None and made.index in made.recipe.changed)


class _LiveRule(RecomputeRule):
    """The recompute rule (`rule`) on the storages of a layer running now: a parameter or a tensor autograd keeps
    as it is is there at backward; a planned output is recomputable in turn if the op read it as it was made."""

    def __init__(self, run: LayerRun):
        self.run = run

    def has_recipe(self, made: Made) -> bool:
        return made.recipe is not None

    def planned(self, made: Made) -> bool:
        return made.call is not None

    def key(self, made: Made) -> int:
        return id(made)

    def sources(self, made: Made):
        for inp in made.inputs:
            if inp is None or _kept(self.run, inp.ref()):
                yield KEPT
            elif inp.maker is not None and inp.version == inp.maker.version:
                yield inp.maker
            else:
                yield None


def _recipe(run: LayerRun, made: Made) -> Recipe:
    """`made`'s recipe, built (once per op call) with each input as it is where autograd keeps it (or, where the
    hooks around the layer took it, what they give back), else a stand-in for the planned output it is, recomputed
    in turn."""
    if made.recipe is None:

        def stand_in(k: int, t: torch.Tensor):
            inp = made.inputs[k]
            if inp is None:
                return t
            if _kept(run, t):
                handed = run.handed.get(storage_key(t))
                if handed is not None and handed.saved_version == inp.version:
                    return FromHooks(handed, run.outer[1], t)
                return t
            return Stashed(_recipe(run, inp.maker), inp.maker.index, t, saved=False)

        made.recipe = made.call.to_recipe(stand_in)
        made.call = None
    return made.recipe


def pack(run: LayerRun, x: torch.Tensor):
    ptr = storage_key(x)
    made = run.made.get(ptr)
    stash = None
    if made is not None and made.storage.expired():
        made = None  # freed; the address now belongs to a storage made outside this layer
    # a storage's first save, by the storage (the record of the op that made it, else its address): an address alone
    # would take a storage made at a freed one's address for it (checkpoint drops what it saves at once, so a later
    # output of the same size can reuse the address) and leave it out of the layer's graph
    first = id(made) if made is not None else ptr
    if run.record is not None and not ptr:  # no storage to read: its bytes are counted nowhere, and said so
        name = type(x).__name__
        run.record.unread[name] = run.record.unread.get(name, 0) + 1
    if run.record is not None and ptr and first not in run.saved_keys:
        run.saved_keys.add(first)
        run.saves.append(made if made is not None else (ptr, storage_bytes(x)))
    if made is not None and made.recomputable is None:
        run.counted.append(made)
        # Changed in place since (dropout's mask on CPU: `bernoulli_` on `empty_like`'s output) or seen through
        # another dtype: the op alone does not give it back.
        if made.routing:
            made.why_not = ROUTING
        elif made.version != _torch_api.version(x):
            made.why_not = CHANGED_IN_PLACE
        elif x.dtype != made.dtype:
            made.why_not = OTHER_DTYPE
        elif made.recipe is None and not all(_kept(run, inp.ref()) for inp in made.inputs if inp is not None):
            if not (made.call is not None and _LiveRule(run).recomputable(made)):
                made.why_not = INPUT_NOT_KEPT
        made.recomputable = not made.why_not
        made.own = made.why_not not in (CHANGED_IN_PLACE, OTHER_DTYPE)
    if made is not None and _changed_since_made(made, x):
        pass  # changed in place since it was made: saved as it is now, not recomputed
    elif made is not None and made.recomputable and (made.call is not None or made.recipe is not None):
        stash = Stashed(_recipe(run, made), made.index, x)
    if stash is not None:
        run.stashed = True
        return stash
    if ptr:
        run.kept[ptr] = weakref.ref(x)
    if run.outer is not None:
        version = _torch_api.version(x)
        handed = Handed(run.outer[0](x), version if run.check_outer else None, version)
        if ptr:
            run.handed[ptr] = handed
        return handed
    return Kept(x)


def unpack(run: LayerRun, h):
    if isinstance(h, Handed):
        return h.give(run.outer[1])
    return h.materialize()


class Kept:
    """A tensor kept as it is, with its version when saved: given back only if unchanged since."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor):
        self.tensor, self.version = t, _torch_api.version(t)

    def materialize(self) -> torch.Tensor:
        changed_in_place(self.tensor, self.version)
        return self.tensor


class Handed:
    """What the enclosing saved-tensor hooks made of a tensor kept as it is; with checkpoint's hooks (level 1), the
    tensor's version when saved: the recomputed tensor must be at the same version when backward unpacks it (an
    in-place change replayed by the recompute would give backward the changed values).

    A recipe that reads the tensor shares the package (`FromHooks`): it is unpacked once, when the first of its
    holders (autograd, the recipes) asks, and the tensor given back is held until the last has had it."""

    __slots__ = ("packed", "version", "saved_version", "pending", "value")

    def __init__(self, packed, version: Optional[int], saved_version: int):
        self.packed, self.version, self.saved_version = packed, version, saved_version
        self.pending = 0  # holders still to be given the tensor, once a recipe shares it (0: autograd's alone)
        self.value: Optional[torch.Tensor] = None

    def share(self) -> None:
        self.pending = self.pending + 1 if self.pending else 2  # autograd's save and this recipe

    def _unpacked(self, unpack) -> torch.Tensor:
        t = unpack(self.packed)
        if self.version is not None:
            changed_in_place(t, self.version)
        return t

    def give(self, unpack) -> torch.Tensor:
        if self.pending == 0:  # not shared, or every holder had it (a second backward: retain_graph)
            return self._unpacked(unpack)
        if self.value is None:
            self.value = self._unpacked(unpack)
        t = self.value
        self.pending -= 1
        if self.pending == 0:
            self.value = None
        return t


class FromHooks(StandIn):
    """A recipe's input that the hooks around the layer took when autograd saved it: the recipe replays from what
    they give back (`Handed.give`). Where they gave back the tensor itself, a change in place after the save is an
    error, as for a recipe's input held directly."""

    __slots__ = ("handed", "unpack", "ref", "version")

    def __init__(self, handed: Handed, unpack, t: torch.Tensor):
        handed.share()
        self.handed, self.unpack = handed, unpack
        self.ref, self.version = weakref.ref(t), handed.saved_version

    def materialize(self) -> torch.Tensor:
        t = self.handed.give(self.unpack)
        if t is self.ref():
            changed_in_place(t, self.version)
        return t


def finish(run: LayerRun, outputs, inputs: Sequence) -> None:
    """After the layer's forward: fold what autograd kept into the profile. The layer's own outputs and inputs are
    left out: the next layer (or the caller) keeps them whatever this layer does."""
    if run.record is not None:
        skip = {storage_key(t) for t in tensors_in(outputs)} | {storage_key(t) for t in tensors_in(inputs)}
        for made in run.counted:
            if made.key in skip and not made.storage.expired():
                continue
            run.record.add(made.plan, made.nbytes, made.seconds, bool(made.recomputable), made.why_not)
            if made.recipe is not None:
                run.record.applied[made.plan] = run.record.applied.get(made.plan, 0) + made.nbytes
        first = next(iter(tensors_in(inputs)), None)
        run.record.graph = layer_graph(run, skip, storage_key(first) if first is not None else None)
    # Ops that were never kept by autograd do not need their inputs any longer (those whose storage was freed and
    # its address taken by a later op's included: step one's lists still hold them).
    for made in [*run.made.values(), *run.all_made, *run.counted]:
        made.call = None
    run.all_made, run.saves, run.counted = [], [], []
    run.made.clear()
    run.handed.clear()


def layer_graph(run: LayerRun, boundary: set, first: Optional[int] = None) -> LayerGraph:
    """Step one's record of the layer as a `LayerGraph`: storages made (and read from outside), their inputs, the
    order of the first saves; `boundary` holds the layer's own inputs' and outputs' storages, `first` its first
    argument's (`LayerGraph.input`)."""
    graph = LayerGraph()
    index: Dict[int, int] = {}  # id(Made) -> node
    outside: Dict[int, int] = {}  # storage key -> node

    def from_outside(key: int, nbytes: int) -> int:
        if key not in outside:
            outside[key] = len(graph.nodes)
            graph.nodes.append(Node("", nbytes, boundary=key in boundary))
        return outside[key]

    for made in run.all_made:
        index[id(made)] = len(graph.nodes)
        graph.nodes.append(
            Node(made.plan, made.nbytes, made.op, made.seconds, own=made.own,
                 boundary=made.key in boundary and not made.storage.expired(), routing=made.routing)
        )  # fmt: skip
    for made in run.all_made:
        edges = []
        for inp in made.inputs:
            if inp is None:
                edges.append((PARAM, True))
            elif inp.maker is not None and id(inp.maker) in index:
                edges.append((index[id(inp.maker)], inp.version == inp.maker.version))
            else:
                edges.append((from_outside(inp.key, inp.nbytes), True))
        graph.nodes[index[id(made)]].inputs = tuple(edges)
    for saved in run.saves:
        if isinstance(saved, tuple):
            graph.saved.append(from_outside(*saved))
        elif id(saved) in index:
            graph.saved.append(index[id(saved)])
    graph.input = outside.get(first, -1) if first is not None else -1
    return graph


def hooked(run: LayerRun):
    """The hooks alone around one layer's forward (a checkpointed layer outside step one: nothing to track)."""
    return torch.autograd.graph.saved_tensors_hooks(lambda x: pack(run, x), lambda h: unpack(run, h))


@contextlib.contextmanager
def tracked(run: LayerRun):
    """The tracker and the hooks around one layer's forward."""
    with TrackingMode(run), hooked(run):
        yield
