"""A dry run's alike layers counted once: a decoder's layers are most often one module repeated, and on fake tensors
each one's forward and backward dispatches the same ops to the same counts (the 8B plain step: 32 layers, each
forward 1,344,242,688 bytes above the last). Two of them are run and recorded, the count at each op's end and what
each leaves behind; the layers after them are replayed from the record (one autograd node each, its count walked
through the recorded points, the tensors it leaves made at the recorded sizes): the same peaks, parts and marks as
running them, at a small part of the time (`fake_step.run`, `replay_layers`).

The rules (tests/test_layer_replay.py):

- Fake tensors only, without sharding: the plain step's layers (their forwards replaced: `install`), under
  transformers' checkpointing too (a recorded layer's recompute runs inside its backward, so its stretch holds it; a
  call inside a backward is run as it is; a replayed layer saves nothing for a checkpoint to recompute), and those
  the engine runs (`call`), step one's too (a replayed layer's `LayerProfile` is its
  kind's record's, its own input and arguments apart). A layer a lever must run is run (`Lever.at_layer`:
  `RUN_ALWAYS`). What a lever does to a layer beyond the count's storages is in the record and done again for a
  replayed layer (`Lever.layer_recorded`, `layer_replayed`, `layer_backward`: an offloaded layer's copies counted on
  the host, fetched as backward reaches it, let go of in its backward); what a lever does as backward reaches a
  layer falls between two layers' stretches (a pre-hook of the output's node: `watch.as_node_runs`).
- Layers are alike where their modules are of the same classes with the same plain attributes (the one numbering
  the layers apart), the same parameters' and buffers' shapes, dtypes and trainability (`fingerprints`), and calls
  are alike where they give tensors of the same shapes, strides, dtypes and gradient flags and the same plain values
  (`_call`; an argument of another kind, a KV cache the layers fill, and the layer always runs). A kind: alike layers
  called alike, next to each other or not (Gemma 3: five sliding-window layers to one of full attention).
- A layer is replayed where its input (its first tensor argument) takes a gradient, its output is one tensor, and two
  layers of its kind ran for real before it, one after the other, with forward records that agree: the count at each
  op's end and at the return, by part, relative to the start; the storages made and kept, by size and part; the ops'
  costs and the attention kernels run; nothing made before the layer let go of; and the input held by the step after
  the next layer started, or not (the model's own code may hold the first layer's input).
- The last three layers of a kind run for real (their backwards come before the replayed layers'), their forwards as
  the kind's record, and their backwards recorded: the replayed layers' backward is the second-to-last's record (a
  layer given its gradient by a layer, not the head), which must agree with the third-to-last's. In a record, every
  storage the forward kept is let go of before the backward starts (autocast's cache of weights cast: the replayed
  layers' stand-ins go at the instant the kind's record's storages go), in the backward, or with the step's graph
  (attributes of a custom autograd node: the replayed layers' go with their own node); the gradient given is let go
  of or passed on as the input's; the parameters' gradients and the input's are made, and nothing else; the input,
  where the step held it, is let go of in the backward.
- Where a record does not hold as the step goes on, its figures cannot be exact: `ReplayMismatch`, and the step is
  run again without replay (`fake_step.run`).
"""

import copy
import dataclasses
import logging
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _torch_api
from ..nested import tensors_in

logger = logging.getLogger(__name__)

_PLAIN = (bool, int, float, str, type(None))
MARK = "mark"  # a point of a stretch that is a watch's mark inside a layer: (MARK, (its name, count, parts))
_MARKED = "_memopt_replay_marks"  # set on a watch whose marks inside layers go among recorded points
RUN_ALWAYS = "run always"  # what a lever does to a layer that a dry run must run, never replay (`Lever.at_layer`)


class ReplayMismatch(RuntimeError):
    """A recorded layer's backward did not do what the replayed layers' stand-in assumed: the step must run again
    without replay."""


def _plain(layer: nn.Module) -> Dict[tuple, object]:
    """A layer's modules' plain public attributes, by (module name, attribute)."""
    return {
        (name, key): value
        for name, module in layer.named_modules()
        for key, value in vars(module).items()
        if not key.startswith("_") and isinstance(value, _PLAIN)
    }


def fingerprints(layers: List[nn.Module]) -> List[tuple]:
    """What makes two layers alike (see the module's docstring), one for each layer: each module's class, its plain
    public attributes, its parameters' and buffers' shapes, dtypes and trainability. An attribute that numbers the
    layers (an int that is each layer's position in the list, plus one offset for all: transformers' `layer_idx`) is
    left out."""
    plain = [_plain(layer) for layer in layers]
    numbering = set()
    if len(layers) > 1:
        for key in plain[0]:
            values = [p.get(key) for p in plain]
            if all(type(v) is int for v in values) and len({v - i for i, v in enumerate(values)}) == 1:
                numbering.add(key)
    made = []
    for layer, attributes in zip(layers, plain):
        modules = []
        for name, module in layer.named_modules():
            own = tuple(sorted((k, v) for (n, k), v in attributes.items() if n == name and (n, k) not in numbering))
            params = tuple(
                (n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters(recurse=False)
            )
            buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers(recurse=False))
            modules.append((name, type(module).__qualname__, own, params, buffers))
        made.append(tuple(modules))
    return made


class _Unlike(Exception):
    pass


def _call(args, kwargs) -> Optional[tuple]:
    """A layer call's arguments as what makes two calls alike: each tensor's shape, strides, dtype, device and gradient
    flag, each plain value, the structure; None where an argument is an object of another kind (a KV cache the layers
    fill: what a replayed layer would not put in it), and the layer is never replayed."""

    def leaf(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.stride(), value.dtype, value.device.type, value.requires_grad)
        if isinstance(value, _PLAIN):
            return value
        if isinstance(value, (tuple, list)):
            return (type(value).__name__, tuple(leaf(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((k, leaf(v)) for k, v in value.items()))
        raise _Unlike

    try:
        return leaf(tuple(args)), leaf(dict(kwargs))
    except _Unlike:
        return None


@dataclass
class _Stretch:
    """One recorded stretch of a step (a layer's forward, or its backward): the count and its parts where it started,
    at each op's end, and where it ended; the op costs it added; the attention kernels it ran."""

    start: tuple
    points: list
    end: tuple
    costs: list
    kernels: Dict[str, int]

    def same_as(self, other: "_Stretch") -> bool:
        def relative(stretch):
            first, first_parts = stretch.start

            def shift(point):
                current, parts = point
                if current == MARK:
                    name, current, parts = parts
                    return name, shift((current, parts))
                return current - first, tuple(sorted((p, n - first_parts[p]) for p, n in parts.items()))

            return [shift(p) for p in stretch.points], shift(stretch.end)

        return relative(self) == relative(other) and self.costs == other.costs and self.kernels == other.kernels


@dataclass
class _Forward:
    """A recorded layer forward and what it leaves: its output's shape and part, the storages it keeps (bytes, part),
    its input's shape and dtype; where it stands for its kind, the storages themselves, watched: where one of them is
    let go of before the layer's backward (autocast's cache, the model's code), each replayed layer's stand-in for it
    is let go of at that instant too (`holders`)."""

    stretch: _Stretch
    out_shape: Tuple[tuple, torch.dtype]
    out_part: str
    kept: List[Tuple[int, str]]
    input_shape: Tuple[tuple, torch.dtype]
    input_held: Optional[bool] = None  # the input alive after the next layer started (held by the graph)
    storages: list = field(default_factory=list)  # weak references to the kept storages, in `kept`'s order
    gone: set = field(default_factory=set)  # the kept storages let go of so far (their places in `kept`)
    holders: list = field(default_factory=list)  # each replayed layer's stand-ins for them, by place
    profile: object = None  # the layer's `LayerProfile` as step one filled it in this forward (None: not step one)
    levers: Dict[str, object] = field(default_factory=dict)  # what each lever did beyond the count (`layer_recorded`)

    def watch(self) -> None:
        """Stand for the kind: each kept storage's end let go of the replayed layers' stand-ins for it."""
        for place, ref in enumerate(self.storages):
            storage = ref()
            if storage is not None:
                weakref.finalize(storage, self._storage_gone, place)

    def _storage_gone(self, place: int) -> None:
        self.gone.add(place)
        for held in self.holders:
            held.pop(place, None)

    def same_as(self, other: "_Forward") -> bool:
        return (
            self.stretch.same_as(other.stretch)
            and self.out_shape == other.out_shape
            and self.out_part == other.out_part
            and sorted(self.kept) == sorted(other.kept)
            and self.levers == other.levers
        )


@dataclass
class _Backward:
    """A recorded layer backward: its stretch; whether the gradient given let go of in it, or passed on as its input's;
    the part of its input's gradient; whether its input was let go of in it; its parameters' gradients' parts (None:
    no gradient)."""

    stretch: _Stretch
    given_freed: bool
    passed_on: bool
    input_grad_part: Optional[str]
    input_freed: bool
    grad_parts: List[Optional[str]] = field(default_factory=list)
    # what the forward kept and was let go of before its backward started (bytes, part): autocast's cache of weights
    # cast, what the model's code held
    early: List[Tuple[int, str]] = field(default_factory=list)
    # what the forward kept and its backward did not let go of (bytes, part): let go of with the step's graph (a
    # custom autograd node's own attributes), as `LayerReplay.graph_goes` and `graph_gone` check
    late: List[Tuple[int, str]] = field(default_factory=list)
    # how many tensors the levers made for the layer between its forward and its backward (an offload's fetched
    # copies: `Lever.layer_backward`), each let go of in the backward
    levers_made: int = 0

    def _facts(self) -> tuple:
        return (
            self.given_freed, self.passed_on, self.input_grad_part, self.input_freed, self.grad_parts, self.early,
            self.late, self.levers_made,
        )  # fmt: skip

    def same_as(self, other: "_Backward") -> bool:
        return self.stretch.same_as(other.stretch) and self._facts() == other._facts()


# a layer's profile as the recorder fills it before the layer runs (its own input, arguments and where the model lets
# go of its input): not copied from another layer's
_OWN_FIELDS = ("shape", "input_bytes", "arguments_bytes", "input_gone_at")


def _profiled_as(profile, recorded) -> None:
    """Step one's `LayerProfile` of a replayed layer filled as its kind's record's was in its forward (the ops' plans,
    bytes and seconds, the graph), its own fields apart (`_OWN_FIELDS`)."""
    for f in dataclasses.fields(profile):
        if f.name not in _OWN_FIELDS:
            setattr(profile, f.name, copy.deepcopy(getattr(recorded, f.name)))


class _Replayed(torch.autograd.Function):
    """A replayed layer: one autograd node standing for the layer's forward and backward (see the module's
    docstring)."""

    @staticmethod
    def forward(ctx, replay, kind, x, *params):
        forward = replay.forwards[kind]
        count = replay.count
        replay.walk(forward.stretch)
        shape, dtype = forward.out_shape
        with count.adopting_as(forward.out_part):
            out = torch.empty(shape, dtype=dtype, device=x.device)
        ctx.kept = {}  # by place in the record's `kept`; let go of where the record's are before backward
        for place, (nbytes, part) in enumerate(forward.kept):
            with count.adopting_as(part):
                ctx.kept[place] = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
        forward.holders.append(ctx.kept)
        ctx.replay, ctx.kind, ctx.device = replay, kind, x.device
        ctx.params = params
        if forward.input_held:
            ctx.save_for_backward(x)
        replay.replayed += 1
        return out

    @staticmethod
    def backward(ctx, given):
        replay, count = ctx.replay, ctx.replay.count
        backward = replay.backward_for(ctx.kind)
        late = list(backward.late)
        ctx.late = []  # let go of with the step's graph (this node's), as the recorded layers' were
        kept = replay.forwards[ctx.kind].kept
        for place, t in ctx.kept.items():
            if kept[place] in late:
                late.remove(kept[place])
                ctx.late.append(t)
            else:
                count.forget(t)
        ctx.kept.clear()
        made = [t for name, held in ctx.levers.items() for t in replay.levers[name].layer_backward(ctx.index, held)]
        if len(made) != backward.levers_made:
            raise ReplayMismatch(
                "a lever made a replayed layer other tensors before its backward than a recorded one's"
            )
        for t in made:  # let go of in the backward, as the record's were
            count.forget(t)
        del made
        if backward.given_freed:
            count.forget(given)
        if backward.input_freed:
            (x,) = ctx.saved_tensors
            count.forget(x)
            del x
        replay.walk(backward.stretch)
        ctx.levers = {}  # what the levers held for the layer goes with its backward (an offload's copies on the host)
        grads = []
        for p, part in zip(ctx.params, backward.grad_parts):
            if part is None:
                grads.append(None)
                continue
            with count.adopting_as(part):
                grad = torch.empty(tuple(p.shape), dtype=p.dtype, device=ctx.device)
            if p.grad is not None:  # added into the one kept (a later micro-batch): the record let go of it already
                count.forget(grad)
            grads.append(grad)
        if backward.passed_on:
            gx = given
        else:
            shape, dtype = replay.forwards[ctx.kind].input_shape
            with count.adopting_as(backward.input_grad_part):
                gx = torch.empty(shape, dtype=dtype, device=ctx.device)
        return (None, None, gx, *grads)


class LayerReplay:
    """A fake step's layers run, recorded or replayed (see the module's docstring): put on a plain step's layers
    (`install`, `remove`), or called by the engine for each layer it runs (`call`). `count`: the step's
    `fake_step.PartsCount`; `kernels`: the attention kernels' counts the step keeps (`attention._OnCuda.ran`), or
    None; `watch()`: the watch reading the step now, or None."""

    def __init__(
        self,
        layers: List[nn.Module],
        count,
        kernels: Optional[Dict[str, int]] = None,
        watch=None,
        variant_of=None,
        levers: Optional[Dict[str, object]] = None,
    ):
        self.layers = layers
        self.count = count
        self.kernels = kernels
        self.watch = watch or (lambda: None)  # the step's watch now, where one reads the step (`StepWatch`)
        self.replayed = 0  # layers replayed in the step
        prints = fingerprints(layers)
        self._alike: List[int] = [prints.index(p) for p in prints]  # each layer's first alike layer
        # what else a layer shares with those replayed from its kind's records (the engine's policy for it, the levers'
        # state on it: `RecomputeState.alike_by`); None: run always
        self.variant_of = variant_of or (lambda index: ())
        self.levers = levers or {}  # the engine's levers (`levers.protocol.Lever`): their part in a layer recorded
        self._tail: Optional[set] = None  # the last three layers of each kind, read at a micro-batch's first layer
        # the record standing for each kind: (the first alike layer, the call, the variant, whether step one profiles)
        self.forwards: Dict[tuple, _Forward] = {}
        self._seen: Dict[tuple, List[_Forward]] = {}  # the records of each kind's forwards
        self._backwards: Dict[tuple, List[_Backward]] = {}  # each kind's backward records, in backward's order
        self._checked: Dict[tuple, _Backward] = {}
        self._pending_input: Optional[tuple] = None  # the last recorded layer's input, to see if it lives on
        self._installed: List[Tuple[nn.Module, Optional[object]]] = []
        self._late: list = []  # the recorded layers' storages kept past their backwards (weak references)

    def reset(self) -> None:
        """Forget the records: a model forward starts (a micro-batch after the first finds its parameters' gradients
        made, and its layers' backwards add into them)."""
        self.forwards, self._seen, self._backwards, self._checked = {}, {}, {}, {}
        self._pending_input = None
        self._late = []
        self._tail = None

    def _tails(self) -> set:
        """The last three layers of each kind of layer and variant (their backwards are recorded), read where the
        micro-batch's first layer starts (the engine's policy for the step carried out by then)."""
        groups: Dict[tuple, List[int]] = {}
        for index in range(len(self.layers)):
            variant = self.variant_of(index)
            if variant is not None:
                groups.setdefault((self._alike[index], variant), []).append(index)
        return {i for members in groups.values() for i in members[-3:]}

    def graph_goes(self) -> None:
        """The backward has ended and the step's graph (its loss) is let go of next: what the recorded layers kept past
        their backwards must go with it (`graph_gone`), as the replayed layers' does; none may have gone before."""
        if any(ref() is None for ref in self._late):
            raise ReplayMismatch("what a layer's forward kept past its backward was let go of before the graph")

    def graph_gone(self) -> None:
        if any(ref() is not None for ref in self._late):
            raise ReplayMismatch("what a layer's forward kept past its backward lives on after the step's graph")

    def install(self) -> None:
        for index, layer in enumerate(self.layers):
            own = layer.__dict__.get("forward")
            self._installed.append((layer, own))
            layer.forward = partial(self._forward, index, layer.forward)

    def remove(self) -> None:
        for layer, own in self._installed:
            if own is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = own
        self._installed = []

    # -- the stretches ----------------------------------------------------------------------------------------------
    def _begin(self) -> tuple:
        """A stretch starts: its own list of points (a layer's backward ends where the next one's starts, the two
        marks at one instant in either order)."""
        count = self.count
        count.points = points = []
        costs = len(count.ops.costs) if count.ops is not None else 0
        return (count.current, dict(count.parts)), costs, dict(self.kernels or {}), count.alive(), points

    def _end(self, begun) -> Tuple[_Stretch, set, set]:
        start, costs, kernels, alive, points = begun
        count = self.count
        if count.points is points:
            count.points = None
        now = count.alive()
        ran = {k: n - kernels.get(k, 0) for k, n in (self.kernels or {}).items() if n != kernels.get(k, 0)}
        added = list(count.ops.costs[costs:]) if count.ops is not None else []
        stretch = _Stretch(start, points, (count.current, dict(count.parts)), added, ran)
        return stretch, now - alive, alive - now

    def walk(self, stretch: _Stretch) -> None:
        watch = self.watch()
        self.count.follow(stretch.start, stretch.points, stretch.end, watch.inside if watch is not None else None)
        if self.count.ops is not None:
            self.count.ops.costs.extend(stretch.costs)
        if self.kernels is not None:
            for k, n in stretch.kernels.items():
                self.kernels[k] = self.kernels.get(k, 0) + n

    # -- a layer's call ---------------------------------------------------------------------------------------------
    def _forward(self, index: int, original, *args, **kwargs):
        return self.call(index, lambda: original(*args, **kwargs), args, kwargs)

    def call(self, index: int, run, args, kwargs, profile=None):
        """Layer `index`'s training forward (`run()`, given `args` and `kwargs`): run, recorded or replayed (see the
        module's docstring). `profile`: the layer's `LayerProfile` step one fills as it runs (the engine's), which a
        replayed layer is given as its kind's record filled it."""
        layer = self.layers[index]
        if _torch_api.in_backward():  # a checkpoint's recompute of a recorded layer: part of its backward's stretch
            return run()
        self._see_pending_input()
        self._marks_recorded()
        if self._tail is None:
            self._tail = self._tails()
        variant = self.variant_of(index)
        x = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
        if variant is None or not (layer.training and torch.is_grad_enabled()) or x is None or not x.requires_grad:
            return run()
        call = _call(args, kwargs)
        if call is None:
            return run()
        kind = (self._alike[index], call, variant, profile is not None)
        if kind in self.forwards and index not in self._tail:
            params = [p for p in layer.parameters() if p.requires_grad]
            out = _Replayed.apply(self, kind, x, *params)
            node, records = out.grad_fn, self.forwards[kind].levers  # the node is the autograd function's context
            node.index = index
            node.levers = {
                name: lever.layer_replayed(index, records.get(name), node.kept, out)
                for name, lever in self.levers.items()
            }
            if profile is not None:
                _profiled_as(profile, self.forwards[kind].profile)
            return out
        return self._recorded(index, kind, run, x, profile)

    def _marks_recorded(self) -> None:
        """The step's watch (where one reads it: `auto`'s checks) has its marks inside a layer (a lever's module
        starting or ending: `StepWatch.inside`) put among a recorded stretch's points, where a replayed layer makes
        them again."""
        watch = self.watch()
        if watch is None or getattr(watch, _MARKED, False):
            return
        inside, count = watch.inside, self.count

        def marked(mark: str) -> None:
            inside(mark)
            if count.points is not None:  # the count as the mark read it (what a layer let go of since its last op)
                count.points.append((MARK, (mark, count.current, dict(count.parts))))

        watch.inside = marked
        setattr(watch, _MARKED, True)

    def _see_pending_input(self) -> None:
        """The last recorded layer's input: alive now (the next layer has started, the model's code let go of it),
        it is held by the step's graph."""
        if self._pending_input is None:
            return
        forward, ref, kind = self._pending_input
        self._pending_input = None
        forward.input_held = not ref.expired()
        seen = self._seen.get(kind, [])
        if self.forwards.get(kind) is forward and seen[-2].input_held != forward.input_held:
            self.forwards.pop(kind)  # the two records hold their inputs otherwise: none stands for the kind yet

    def _recorded(self, index: int, kind: tuple, run, x, profile):
        count = self.count
        begun = self._begin()
        x_id = count.identity(x)
        try:
            out = run()
        finally:
            stretch, made, freed = self._end(begun)
        if not isinstance(out, torch.Tensor) or freed or not out.requires_grad:
            return out  # not a layer the stand-in can stand for: it runs, never replayed
        out_id = count.identity(out)
        kept_ids = [(key, born) for key, born in made if (key, born) != out_id]
        forward = _Forward(
            stretch,
            (tuple(out.shape), out.dtype),
            count._part.get(out_id[0]),
            [(count._live[key], count._part.get(key)) for key, _ in kept_ids],
            (tuple(x.shape), x.dtype),
            storages=[count._refs[key] for key, _ in kept_ids],
            profile=profile,
            levers={name: lever.layer_recorded(index, count, kept_ids) for name, lever in self.levers.items()},
        )
        self._pending_input = (forward, _torch_api.storage_ref(x), kind)
        seen = self._seen.setdefault(kind, [])
        seen.append(forward)
        agree = len(seen) >= 2 and seen[-2].same_as(seen[-1]) and seen[-2].input_held is not None
        if kind not in self.forwards and agree:
            # two of a kind in a row agree: the later one's record stands for the kind (its input's fate is seen as
            # the next layer starts, before any layer is replayed; the model's code may hold the first layer's input)
            self.forwards[kind] = seen[-1]
            seen[-1].watch()
        if index in self._tail and kind in self.forwards:
            self._record_backward(index, kind, out, x, x_id, out_id, made, forward)
        return out

    def _record_backward(self, index, kind, out, x, x_id, out_id, made, forward) -> None:
        count = self.count
        params = [p for p in self.layers[index].parameters() if p.requires_grad]
        kept = set(made) - {out_id}
        # each kept storage's bytes and part, read now (one let go of before the backward is no longer counted then)
        state = {"sizes": {k: (count._live[k[0]], count._part.get(k[0])) for k in kept}}

        def starts(given):
            state["begun"] = self._begin()
            state["alive"] = state["begun"][3]
            state["given"] = count.identity(given)
            state["levers"] = {
                count.identity(t) for lever in self.levers.values() for t in lever.layer_backward(index, None)
            }

        def ends(grad):
            if "begun" not in state:
                return grad
            stretch, born, freed = self._end(state.pop("begun"))
            given, grad_id = state["given"], count.identity(grad)
            grad_ids = {count.identity(p.grad): p for p in params if p.grad is not None}
            levers_made = state.pop("levers")
            expected_freed = kept | {given, x_id} | levers_made
            expected_born = set(grad_ids) | {grad_id}
            record = _Backward(
                stretch,
                given_freed=given in freed,
                passed_on=grad_id == given,
                input_grad_part=count._part.get(grad_id[0]),
                input_freed=x_id in freed,
                grad_parts=[None if p.grad is None else count._part.get(count.identity(p.grad)[0]) for p in params],
                levers_made=len(levers_made),
            )
            early = kept - state["alive"]  # let go of before its backward started
            late = kept - freed - early  # kept past its backward: let go of with the step's graph, or wrong
            record.early = sorted(state["sizes"][k] for k in early)
            record.late = sorted(state["sizes"][k] for k in late)
            for key, _ in late:
                self._late.append(count._refs[key])
            if not (freed <= expected_freed and born <= expected_born and levers_made <= freed):
                record = None
            elif self.forwards.get(kind) is None:
                record = None
            elif not self.forwards[kind].same_as(forward):
                record = None
            self._backwards.setdefault(kind, []).append(record)
            return grad

        # the stretch starts after what the levers do as backward reaches the layer (an offload's fetch: a pre-hook of
        # the output's node, put on before this one), and ends at its input's hooks, before the layer below's levers
        node = out.grad_fn
        if node is None:
            out.register_hook(lambda grad: starts(grad))
        else:
            place = out.output_nr  # the output itself not held by its node's hook (the step may let go of it)
            node.register_prehook(lambda grads: starts(grads[place]))
        x.register_hook(ends)

    def backward_for(self, kind: tuple) -> _Backward:
        """The record a replayed layer of `kind` runs its backward by: the second of the kind's last three records
        (the last layer's gradient comes from the head), checked against the third; `ReplayMismatch` where they, or the
        forward's record, do not agree."""
        checked = self._checked.get(kind)
        if checked is not None:
            return checked
        records = self._backwards.get(kind, [])
        forward = self.forwards[kind]
        if len(records) < 3 or records[1] is None or records[2] is None or not records[1].same_as(records[2]):
            raise ReplayMismatch(f"the last layers' backwards of a run do not agree ({len(records)} recorded)")
        record = records[1]
        if bool(forward.input_held) != record.input_freed and forward.input_held is not None:
            raise ReplayMismatch("a layer's input is held through backward in one record and not in another")
        if sorted(forward.kept[place] for place in forward.gone) != record.early:
            raise ReplayMismatch("what a layer kept was let go of before its backward in one record and not another")
        self._checked[kind] = record
        return record
