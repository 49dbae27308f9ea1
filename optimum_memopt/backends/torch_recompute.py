"""The torch backend: the same recompute plans on current PyTorch, without ONNX Runtime.

It changes nothing in the model's structure: each transformer layer's `forward` is replaced, on the instance,
by one that runs the original under this backend's machinery while the model trains (grad enabled,
`model.training`); evaluation, `state_dict`, `save_pretrained` and DDP / DeepSpeed see the model as it was.

**Level 0, plans** (`Gelu+:1:-1`): while a layer runs forward, a `TorchDispatchMode` sees each aten op and
the storage its outputs create, and `saved_tensors_hooks` see every tensor autograd saves for backward.
When autograd saves a tensor whose storage an op of an enabled plan created (the output of `gelu`, say), and
every input of that op is a parameter or a tensor autograd already keeps for backward, the hook keeps a
*recipe* instead (the op, its inputs, the RNG state for random ops); the output is freed, and backward
recomputes it from the recipe when it needs it. Like ONNX Runtime's plans, only the planned ops run twice,
the saving is the planned outputs' bytes, and the values are bitwise those of the first run (the same kernel
on the same inputs, the same RNG state), so losses equal plain PyTorch.

Why not `torch.utils.checkpoint` with a selective policy (`create_selective_checkpoint_contexts`): under it,
backward re-runs the layer's Python code from its start, and every op the policy does not cache runs again.
To re-run only the planned ops, the policy must cache every other op's output, including outputs that plain
PyTorch frees at once (attention scores before the softmax, dense outputs before dropout): that costs more
memory than the plan saves on BERT-style layers. Caching only what autograd keeps instead re-runs every
matmul whose output autograd does not keep. docs/DESIGN.md has the figures.

**Level 1**: `torch.utils.checkpoint` (non-reentrant, RNG state preserved) around each transformer layer:
whole layers recomputed, what `--gradient_checkpointing` does, with this backend's report.

**The report**: during the first training step the same hooks record, for every layer, which op created
each storage autograd kept and its bytes; grouped by operator into plans named in the grammar of
`optimum_memopt.plans` (ONNX Runtime's operator names where one corresponds, `OP_NAMES`), with the number of
layers that hold it and the bytes for that batch. Storages that cannot be recomputed from tensors kept anyway
(their op's inputs would have to be kept instead) are named in the report's notes, not offered as plans.
"""

import logging
import weakref
from dataclasses import dataclass, field
from functools import partial
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from packaging import version
from torch import nn

from ..plans import FoundPlan, PlanEntry, PlanReport, Unmatched, match_requests
from .base import Backend, WrapSettings

logger = logging.getLogger(__name__)

MIN_TORCH = "2.5"

# ONNX Runtime operator names and the aten ops (overload packets) they correspond to. A plan names an operator
# by either: `Gelu+` and `gelu+` are the same plan here. The report uses the first ORT name listed for an op,
# and the aten name for ops with no ORT counterpart (`silu+`).
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


def torch_problem() -> Optional[str]:
    if version.parse(torch.__version__.split("+")[0]) < version.parse(MIN_TORCH):
        return (
            f"the torch backend needs torch >= {MIN_TORCH} (installed: {torch.__version__}); install the modern stack "
            f"with `pip install 'optimum-memopt[torch]'` (or `-c constraints-torch.txt`, see README)"
        )
    return None


# -- finding the transformer layers ------------------------------------------------------------------------
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


# -- recipes ---------------------------------------------------------------------------------------------------
def _tensors(value) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # tensor subclasses without storage
        return 0


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return 0


class _Recipe:
    """How to recompute one op's outputs: the op, its inputs (kept alive by autograd anyway), the RNG state."""

    __slots__ = ("func", "args", "kwargs", "rng", "versions", "value", "pending", "__weakref__")

    def __init__(self, func, args, kwargs, rng):
        self.func, self.args, self.kwargs, self.rng = func, args, kwargs, rng
        self.versions = [t._version for t in _tensors((args, kwargs))]
        self.value = None
        self.pending = 0

    def outputs(self):
        if self.value is None and self.args is None:
            raise RuntimeError(
                f"optimum-memopt torch backend: the output of {self.func} was recomputed and released already; a "
                f"second backward through the same graph (retain_graph=True) is not supported with plans, use "
                f"`--memory_opt_level 1` or no plans for it"
            )
        if self.value is None:
            now = [t._version for t in _tensors((self.args, self.kwargs))]
            if now != self.versions:
                raise RuntimeError(
                    f"optimum-memopt torch backend: an input of {self.func} was modified in place after the forward "
                    f"pass, so its output cannot be recomputed for backward; drop the plan for "
                    f"{plan_name(self.func.overloadpacket.__name__)!r}"
                )
            with torch.no_grad():
                if self.rng is None:
                    self.value = self.func(*self.args, **self.kwargs)
                else:
                    cpu_state, device, device_state = self.rng
                    devices = [device] if device is not None else []
                    with torch.random.fork_rng(devices=devices, device_type=device.type if device else "cuda"):
                        torch.set_rng_state(cpu_state)
                        if device is not None:
                            torch.get_device_module(device.type).set_rng_state(device_state, device)
                        self.value = self.func(*self.args, **self.kwargs)
        return self.value

    def release(self):
        self.pending -= 1
        if self.pending <= 0:
            self.value = None
            self.args = self.kwargs = None


class _Stashed:
    """What autograd holds instead of a planned output: the recipe and the saved tensor's geometry."""

    __slots__ = ("recipe", "index", "size", "stride", "offset")

    def __init__(self, recipe, index, t):
        self.recipe, self.index = recipe, index
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def materialize(self) -> torch.Tensor:
        outs = self.recipe.outputs()
        out = outs[self.index] if isinstance(outs, (tuple, list)) else outs
        if out.size() != self.size or out.stride() != self.stride or out.storage_offset() != self.offset:
            out = out.as_strided(self.size, self.stride, self.offset)
        self.recipe.release()
        return out


@dataclass
class _Made:
    """A storage an op created during this layer's forward."""

    plan: str
    ref: object  # weakref to the output tensor
    nbytes: int
    version: int
    index: int
    inputs: List[Optional[object]]  # a weak reference to each tensor input; None for parameters
    call: Optional[tuple] = None  # (func, args, kwargs, rng) when the op belongs to a plan applied here
    recipe: Optional[_Recipe] = None
    recomputable: Optional[bool] = None  # decided when autograd first keeps it


@dataclass
class LayerRecord:
    """What the first training step showed of one layer: the bytes autograd kept for backward, by plan, split
    by whether they can be recomputed from tensors kept anyway, and the bytes this run replaced by recipes."""

    recomputable: Dict[str, int] = field(default_factory=dict)
    not_recomputable: Dict[str, int] = field(default_factory=dict)
    applied: Dict[str, int] = field(default_factory=dict)
    shape: Tuple[int, ...] = ()


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad)


class _Run:
    """One layer's forward pass under the backend: what the dispatch mode and the saved-tensor hooks share."""

    def __init__(self, apply: Set[str], record: Optional[LayerRecord], outer_hooks=None):
        self.apply = apply
        self.record = record
        self.made: Dict[int, _Made] = {}
        # storages autograd keeps as they are, with a weak reference to the tensor kept: a node freed during the
        # forward (an unused output's) frees what it kept, and its address may be reused by a later storage
        self.kept: Dict[int, object] = {}
        self.counted: List[_Made] = []  # each storage autograd kept, once, as it was first kept
        self.outer = outer_hooks  # level 1: checkpoint's own hooks, to which ours hand every tensor

    # -- the dispatch mode's side
    def on_op(self, func, args, kwargs, out, rng) -> None:
        name = plan_name(func.overloadpacket.__name__)
        applying = name in self.apply
        if not (applying or self.record is not None):
            return
        if any(r.alias_info is not None for r in func._schema.returns):
            return  # views and in-place ops create no storage
        inputs = [None if _is_param(t) else weakref.ref(t) for t in _tensors((args, kwargs))]
        for i, t in enumerate(_tensors(out)):
            ptr = _ptr(t)
            if not ptr:
                continue
            known = self.made.get(ptr)
            if known is not None and known.ref() is not None and _ptr(known.ref()) == ptr:
                continue  # an op that returns an alias without saying so in its schema (`_unsafe_view`)
            call = (func, args, kwargs, rng) if applying else None
            self.made[ptr] = _Made(name, weakref.ref(t), _nbytes(t), t._version, i, inputs, call)

    # -- the saved-tensor hooks' side
    def _kept(self, t: Optional[torch.Tensor]) -> bool:
        """Whether autograd keeps this (live) tensor's storage as it is; a freed input is not kept."""
        if t is None:
            return False
        ptr = _ptr(t)
        ref = self.kept.get(ptr)
        held = ref() if ref is not None else None
        return held is not None and _ptr(held) == ptr

    def pack(self, x: torch.Tensor):
        ptr = _ptr(x)
        made = self.made.get(ptr)
        stash = None
        if made is not None and made.ref() is None:
            made = None  # freed; the address now belongs to a storage made outside this layer
        if made is not None and made.recomputable is None:
            self.counted.append(made)
            # Changed in place since (dropout's mask on CPU: `bernoulli_` on `empty_like`'s output) or seen through
            # another dtype: the op alone does not give it back.
            same = made.version == x._version and x.dtype == made.ref().dtype
            made.recomputable = same and all(ref is None or self._kept(ref()) for ref in made.inputs)
        if made is not None:
            if made.call is not None and made.recomputable and self.outer is None:
                if made.recipe is None:
                    made.recipe = _Recipe(*made.call)
                    made.call = None  # the recipe holds the inputs now
                made.recipe.pending += 1
                stash = _Stashed(made.recipe, made.index, x)
            elif made.recipe is not None and self.outer is None:
                made.recipe.pending += 1
                stash = _Stashed(made.recipe, made.index, x)
        if stash is None and ptr:
            self.kept[ptr] = weakref.ref(x)
        if self.outer is not None:
            return self.outer[0](x)
        return stash if stash is not None else x

    def unpack(self, h):
        if self.outer is not None:
            return self.outer[1](h)
        return h.materialize() if isinstance(h, _Stashed) else h

    def finish(self, outputs, inputs: Sequence) -> None:
        """After the layer's forward: fold what autograd kept into the record. The layer's own outputs and inputs
        are left out: the next layer (or the caller) keeps them whatever this layer does."""
        if self.record is not None:
            skip = {_ptr(t) for t in _tensors(outputs)} | {_ptr(t) for t in _tensors(inputs)}
            for made in self.counted:
                alive = made.ref()
                if alive is not None and _ptr(alive) in skip:
                    continue
                bucket = self.record.recomputable if made.recomputable else self.record.not_recomputable
                bucket[made.plan] = bucket.get(made.plan, 0) + made.nbytes
                if made.recipe is not None:
                    self.record.applied[made.plan] = self.record.applied.get(made.plan, 0) + made.nbytes
        # Ops that were never kept by autograd do not need their inputs any longer.
        for made in self.made.values():
            made.call = None
        self.made.clear()


class _Mode(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, run: _Run):
        super().__init__()
        self.run = run

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rng = None
        planned = plan_name(func.overloadpacket.__name__) in self.run.apply
        if planned and torch.Tag.nondeterministic_seeded in func.tags:
            device = next((t.device for t in _tensors((args, kwargs)) if t.device.type != "cpu"), None)
            device_state = torch.get_device_module(device.type).get_rng_state(device) if device is not None else None
            rng = (torch.get_rng_state(), device, device_state)
        out = func(*args, **kwargs)
        self.run.on_op(func, args, kwargs, out, rng)
        return out


def _outer_saved_tensor_hooks():
    """The saved-tensor hooks active now (torch.utils.checkpoint's, inside a checkpointed layer), or None."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return None
    return top(False)


# -- the backend ---------------------------------------------------------------------------------------------
class RecomputeState:
    """Attached to the model as `_memopt_recompute`: the layers, what each applies, what step one recorded."""

    def __init__(self, layers: List[nn.Module], apply: List[Set[str]], level: int):
        self.layers = layers
        self.apply = apply  # per layer: plan names recomputed there
        self.level = level
        self.records: Optional[List[LayerRecord]] = None  # filled by the first training forward
        self._recording: Optional[List[LayerRecord]] = None
        self.originals: List = [layer.forward for layer in layers]
        self._own_forward = ["forward" in vars(layer) for layer in layers]  # set on the instance before us

    def install(self) -> None:
        for i, layer in enumerate(self.layers):
            layer.forward = partial(self.layer_forward, i)

    def uninstall(self) -> None:
        """Give each layer its `forward` back (a model wrapped again, by another trainer, starts clean)."""
        for layer, original, own in zip(self.layers, self.originals, self._own_forward):
            if own:
                layer.forward = original
            else:
                vars(layer).pop("forward", None)

    def layer_forward(self, index: int, *args, **kwargs):
        layer = self.layers[index]
        original = self.originals[index]
        if not (layer.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if index == 0 and self.records is None and self._recording is None:
            self._recording = [LayerRecord() for _ in self.layers]
        record = self._recording[index] if self._recording is not None else None
        if record is not None and not record.shape:
            first = next(iter(_tensors(args) or _tensors(kwargs)), None)
            record.shape = tuple(first.shape) if first is not None else ()
        if self.level == 1:
            out = self._checkpointed(original, record, args, kwargs)
        elif self.apply[index] or record is not None:
            run = _Run(self.apply[index], record)
            with _Mode(run), torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                out = original(*args, **kwargs)
            run.finish(out, (args, kwargs))
        else:
            out = original(*args, **kwargs)
        if record is not None and index == len(self.layers) - 1:
            self.records, self._recording = self._recording, None
        return out

    def _checkpointed(self, original, record, args, kwargs):
        from torch.utils.checkpoint import checkpoint

        if record is None:
            return checkpoint(original, *args, use_reentrant=False, **kwargs)
        first = [True]

        def recorded(*a, **k):
            if not first[0]:  # the recomputation in backward
                return original(*a, **k)
            first[0] = False
            outer = _outer_saved_tensor_hooks()
            if outer is None:
                return original(*a, **k)
            run = _Run(set(), record, outer_hooks=outer)
            with _Mode(run), torch.autograd.graph.saved_tensors_hooks(run.pack, run.unpack):
                out = original(*a, **k)
            run.finish(out, (a, k))
            return out

        return checkpoint(recorded, *args, use_reentrant=False, **kwargs)


def _layer_apply(entries: Sequence[PlanEntry], n_layers: int) -> Tuple[List[Set[str]], List[str]]:
    """Per layer, the plan names recomputed there (`RequestApplyCount` N: the first N layers), and the requests
    that name no operator this backend knows."""
    apply: List[Set[str]] = [set() for _ in range(n_layers)]
    unknown = []
    for entry in entries:
        if not entry.enabled:
            continue
        names, bad = canonical_ops(entry.subgraph)
        unknown += bad
        count = n_layers if entry.apply_count == -1 else min(entry.apply_count, n_layers)
        for i in range(count):
            apply[i].update(names)
    return apply, unknown


class TorchBackend(Backend):
    name = "torch"

    def __init__(self):
        self._mine = weakref.WeakSet()  # the states this backend installed

    def problem(self) -> Optional[str]:
        return torch_problem()

    def wrap(self, model: nn.Module, settings: WrapSettings) -> nn.Module:
        layers = find_layers(model)
        if not layers:
            raise ValueError(
                f"the torch backend recomputes inside transformer layers, but found no list of repeated layers in "
                f"{type(model).__name__} (an nn.ModuleList of blocks); train it with `--use_ort false`"
            )
        previous = vars(model).get("_memopt_recompute")
        if isinstance(previous, RecomputeState):  # wrapped before (another trainer): start from the model itself
            previous.uninstall()
            layers = find_layers(model)
        apply, _ = _layer_apply(settings.entries, len(layers))  # unknown names: warned in the report
        state = RecomputeState(layers, apply, settings.level)
        state.install()
        model._memopt_recompute = state
        self._mine.add(state)
        return model

    def find(self, model) -> Optional[nn.Module]:
        """The model this backend wrapped, inside DDP / DeepSpeed wrappers; a model another trainer's backend
        wrapped is not this one's."""
        for _ in range(8):
            if model is None:
                return None
            state = getattr(model, "__dict__", {}).get("_memopt_recompute")
            if isinstance(state, RecomputeState) and state in self._mine:
                return model
            model = getattr(model, "module", None)
        return None

    def describe(self, wrapped: nn.Module) -> str:
        state: RecomputeState = wrapped._memopt_recompute
        what = "whole layers checkpointed" if state.level == 1 else "planned ops recomputed from kept inputs"
        return f"{type(wrapped).__name__} with the torch backend ({len(state.layers)} layers, {what})"

    def plan_report(self, wrapped: nn.Module, settings: WrapSettings) -> Optional[PlanReport]:
        state: RecomputeState = wrapped._memopt_recompute
        if state.records is None:
            return None
        n = len(state.layers)
        totals: Dict[str, int] = {}
        freq: Dict[str, int] = {}
        applied_layers: Dict[str, int] = {}
        blocked: Dict[str, int] = {}
        for rec in state.records:
            # At level 1 whole layers are recomputed: everything they keep is freed, recomputable alone or not.
            kept = dict(rec.recomputable)
            if state.level == 1:
                for name, b in rec.not_recomputable.items():
                    kept[name] = kept.get(name, 0) + b
            else:
                for name, b in rec.not_recomputable.items():
                    blocked[name] = blocked.get(name, 0) + b
            for name, b in kept.items():
                totals[name] = totals.get(name, 0) + b
                freq[name] = freq.get(name, 0) + 1
                if state.level == 1 or name in rec.applied:
                    applied_layers[name] = applied_layers.get(name, 0) + 1
        plans = []
        for name in sorted(totals, key=lambda k: -totals[k]):
            on = name in applied_layers
            plans.append(
                FoundPlan(
                    config=f"{name}+:1:-1",
                    enabled=on,
                    frequency=freq[name],
                    saving_bytes=float(totals[name]),
                    saving_symbolic="",
                    applied_count=applied_layers.get(name, 0),
                )
            )
        requested = [str(e) for e in settings.entries if e.enabled]
        canonical = []
        unknown_notes = []
        for e in settings.entries:
            if not e.enabled:
                continue
            names, bad = canonical_ops(e.subgraph)
            canonical += [PlanEntry(f"{nm}+", e.optimization_type, e.apply_count) for nm in names]
            if bad:
                unknown_notes.append(
                    Unmatched(
                        str(e),
                        [p.config for p in plans[:3]],
                        similar=False,
                        reason=f"{', '.join(map(repr, bad))}: no operator the torch backend knows (an ONNX Runtime "
                        f"name of its table in docs/DESIGN.md, or an aten op name)",
                    )
                )
        notes = []
        if state.level == 1:
            notes.append(
                "level 1: every layer is checkpointed whole (torch.utils.checkpoint); the table shows what the layers "
                "would otherwise keep for backward"
            )
        if blocked:
            listed = ", ".join(f"{k} {blocked[k] / 2**20:.2f}" for k in sorted(blocked, key=lambda k: -blocked[k]))
            notes.append(
                f"kept for backward but not recomputable from tensors kept anyway (an input of the op that made them "
                f"is not kept, or they were changed in place since), MiB over all layers: {listed}"
            )
        shape = state.records[0].shape if state.records else ()
        dims = {"layers": n}
        if len(shape) >= 2:
            dims.update({"batch": int(shape[0]), "sequence": int(shape[1])})
        report = PlanReport(
            backend=self.name,
            optimizer_enabled=bool(state.level == 1 or any(state.apply)),
            level=state.level,
            requested=requested,
            applied=[str(e) for e in canonical] if state.level == 0 else [f"{p.config}" for p in plans],
            plans=plans,
            dims=dims,
            notes=notes,
        )
        if state.level == 0:
            origin = {}
            for e in settings.entries:
                for nm in canonical_ops(e.subgraph)[0]:
                    origin[f"{nm}+:{e.optimization_type}"] = str(e)
            unmatched = match_requests(canonical, plans)
            for u in unmatched:
                head, opt, count = u.requested.rsplit(":", 2)
                key = f"{head}:{opt}"
                if origin.get(key, u.requested) != u.requested:
                    u.reason = f"{head} here"
                    u.requested = origin[key]
                name = head.rstrip("+")
                if name in blocked:
                    u.reason = ", ".join(
                        filter(
                            None,
                            [
                                u.reason,
                                f"its {blocked[name] / 2**20:.2f} MiB are kept for backward but cannot be recomputed "
                                f"from tensors kept anyway",
                            ],
                        )
                    )
            report.unmatched = unknown_notes + unmatched
        return report
