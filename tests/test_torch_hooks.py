"""The torch engine's saved-tensor hooks do what autograd does for saved tensors without hooks: a tensor changed in
place after it was saved is an error (plain PyTorch's), and the hooks around the step (`save_on_cpu`, an offloading
hook) still see every tensor kept as it is. At op level, without a Trainer; through the Trainer in
tests/test_backend_torch.py."""

import contextlib
import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch_engine import Counting, engine, ops, pair, step

from optimum_memopt.backends.torch.apply.tracking import is_param
from optimum_memopt.backends.torch.policy import LayerPolicy, RecomputePolicy

pytestmark = pytest.mark.torch_backend

INPLACE = "modified by an inplace operation"


def gated(block, x):
    """A gated MLP that changes `u` in place after `g * u` saved it."""
    g = F.silu(x @ block.w)
    u = x @ block.w.t()
    h = g * u
    u.add_(0.5)
    return h @ block.w


def keep(n=1):
    return RecomputePolicy([LayerPolicy() for _ in range(n)])


def test_plain_pytorch_raises_on_the_in_place_change():
    plain, _ = pair(gated)
    with pytest.raises(RuntimeError, match=INPLACE):
        step(plain, torch.randn(4, 8))


@pytest.mark.parametrize(
    "policy, message",
    [
        (
            ops("Mul", "silu"),
            r"\[torch.FloatTensor \[4, 8\]\], last changed by AddBackward0, is at version 1; expected ",
        ),
        (keep(), r"at version 1; expected version 0"),
        # `u` is planned itself: its recipe would give back the unchanged value, the change is seen by the tracker
        (ops("MatMul"), r"output 0 of aten.mm.default \(shape \[4, 8\]\), recomputed for backward, was changed by "),
        (RecomputePolicy.from_plans([], 1, 1), r"at version 1; expected version 0"),
    ],
    ids=["Mul+silu", "keep", "MatMul", "level1"],
)
def test_a_saved_tensor_changed_in_place_raises_in_every_step(policy, message):
    """Level 1: the recompute replays `u.add_` (checkpoint re-runs the layer up to the last tensor backward needs,
    here the final matmul's input), so the recomputed `u` is the changed one; plain torch checkpointing would use it
    without a word."""
    _, planned = pair(gated)
    state = engine(planned, policy)
    with pytest.raises(RuntimeError, match=INPLACE + ".*" + message):
        step(planned, torch.randn(4, 8))  # step one: recorded, through the backend's hooks
    assert state.profile is not None
    with pytest.raises(RuntimeError, match=INPLACE):
        step(planned, torch.randn(4, 8))  # a later step


def test_level_1_gives_the_forward_values_where_the_recompute_stops_before_the_change():
    """The change comes after the last tensor backward needs: checkpoint's recompute stops before it, so backward
    gets the values the forward used (the true gradient; plain PyTorch would raise)."""

    def unchanged(block, x):
        g = F.silu(x @ block.w)
        return (g * (x @ block.w.t())) @ block.w

    def change_last(block, x):
        g = F.silu(x @ block.w)
        u = x @ block.w.t()
        out = (g * u) @ block.w
        u.add_(0.5)
        return out

    plain, _ = pair(unchanged)
    _, layered = pair(change_last)
    engine(layered, RecomputePolicy.from_plans([], 1, 1))
    x = torch.randn(4, 8)
    for seed in (0, 1):  # the recorded step and a later one
        got, want = step(layered, x, seed), step(plain, x, seed)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(got, want))


def three_ops(block, x):
    return F.gelu(x @ block.w) @ block.w.t()


@pytest.mark.parametrize("planned_policy, planned_bytes", [(keep(2), 0), (ops("Gelu", n=2), 2 * 4 * 8 * 4)])
def test_the_hooks_around_the_step_see_every_tensor_kept_as_it_is(planned_policy, planned_bytes):
    plain, planned = pair(three_ops, n=2)
    engine(planned, planned_policy)
    x = torch.randn(4, 8)
    for seed in (0, 1):  # the recorded step and a later one
        with Counting() as outer_plain:
            want = step(plain, x, seed)
        with Counting() as outer_planned:
            got = step(planned, x, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert outer_planned.nbytes == outer_plain.nbytes - planned_bytes
        assert outer_planned.tensors == outer_plain.tensors - (2 if planned_bytes else 0)


@pytest.mark.parametrize("policy", [ops("Gelu", n=2), keep(2)], ids=["Gelu", "keep"])
def test_save_on_cpu_around_a_planned_step_gives_the_same_gradients(policy):
    plain, planned = pair(three_ops, n=2)
    engine(planned, policy)
    x = torch.randn(4, 8)
    for seed in (0, 1):
        with torch.autograd.graph.save_on_cpu():
            want = step(plain, x, seed)
        with torch.autograd.graph.save_on_cpu():
            got = step(planned, x, seed)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_a_new_storage_at_a_freed_planned_outputs_address_is_not_taken_for_it():
    """A planned output is freed once stashed, and a later op's output may get its address and be changed in place
    (dropout's mask on CPU: `bernoulli_` on `empty_like`'s output; seen on BERT with 8 MiB blocks). Only a write to
    the planned output itself, still alive, marks it changed. The allocator's reuse is not reproducible on demand,
    so the tracker is handed the situation directly."""
    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.apply.recipe import Recipe
    from optimum_memopt.backends.torch.apply.tracking import LayerRun, Made, storage_key

    aten = torch.ops.aten
    run = LayerRun(frozenset({"MatMul"}), None)
    run.stashed = True
    a, w = torch.randn(4, 8), torch.randn(8, 8)
    mask = torch.empty(4, 8)  # now at the address the freed planned output had

    dead = _torch_api.storage_ref(torch.randn(4, 8))  # the planned output, freed
    assert dead.expired()
    made = Made("MatMul", dead, 128, 0, 0, [], recipe=Recipe(aten.mm.default, (a, w), {}, None))
    run.made[storage_key(mask)] = made
    run.on_op(aten.bernoulli_.float, (mask, 0.5), {}, mask, None)
    assert made.recipe.changed == {}
    alive = aten.mm.default(a, w)  # the planned output itself, alive, written to: marked
    made.storage = _torch_api.storage_ref(alive)
    run.made[storage_key(alive)] = made
    run.on_op(aten.add_.Tensor, (alive, 1.0), {}, alive, None)
    assert made.recipe.changed == {0: "aten.add_.Tensor"}


class Offloading:
    """A user's offloading hooks around the step (as TRL's or `save_on_cpu`): each tensor saved is copied and the
    original let go of, so what stays alive after the forward is what something else holds. Records every package's
    unpacks and the bytes given."""

    def __init__(self, planned=None):
        self.taken, self.unpacks, self.nbytes = [], {}, 0
        self.planned, self.planned_bytes = planned, 0  # `Planned`: the bytes given of the storages its ops made

    def __enter__(self):
        def pack(t):
            if is_param(t):
                return ("param", t)
            self.taken.append(weakref.ref(t))
            self.nbytes += t.numel() * t.element_size()
            if self.planned is not None and self.planned.made(t):
                self.planned_bytes += t.numel() * t.element_size()
            return (len(self.taken), t.detach().clone())

        def unpack(package):
            key, t = package
            if key != "param":
                self.unpacks[key] = self.unpacks.get(key, 0) + 1
            return t

        self._cm = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        self._cm.__enter__()
        return self

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)

    def alive(self):
        gc.collect()
        return sorted(tuple(r().shape) for r in self.taken if r() is not None)


class Planned(torch.utils._python_dispatch.TorchDispatchMode):
    """Plain PyTorch's run, noting the storages the planned ops (aten mul and silu) make inside the decoder layers
    (the final norm's are not the plans')."""

    def __init__(self, layers):
        super().__init__()
        self.storages = {}  # address -> a weak reference to the storage made there (a freed one's address is reused)
        self.inside, self.layers, self.handles = False, layers, []

    def __enter__(self):
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *_: setattr(self, "inside", True)))
            self.handles.append(layer.register_forward_hook(lambda *_: setattr(self, "inside", False)))
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.inside and func.overloadpacket.__name__ in ("mul", "silu") and isinstance(out, torch.Tensor):
            self.storages[out.untyped_storage().data_ptr()] = StorageWeakRef(out.untyped_storage())
        return out

    def made(self, t: torch.Tensor) -> bool:
        ref = self.storages.get(t.untyped_storage().data_ptr())
        return ref is not None and not ref.expired()


@pytest.mark.slow
def test_an_offloading_hook_around_a_planned_step_frees_what_it_takes_as_plain_pytorch_does():
    """A recipe's input that autograd saved goes through the hooks around the step, and the recipe replays from what
    they give back: under `Mul+,silu+` on a Llama, an offloading hook leaves on the device exactly what it leaves in
    plain PyTorch (before: every recipe input stayed, 21 tensors here), sees plain's saves but the planned outputs'
    (counted in plain by the storage their op made), unpacks each package once, and the gradients are plain's."""
    from helpers import CausalData, small_decoder

    from optimum_memopt.plans import parse_plans

    plain = small_decoder("llama", layers=2)
    planned = copy.deepcopy(plain)
    engine(planned, RecomputePolicy.from_plans(parse_plans("Mul+:1:-1,silu+:1:-1"), 0, 2))
    data = CausalData()
    batch = {k: torch.stack([data[i][k] for i in range(4)]) for k in data[0]}
    for seed in (0, 1, 2):  # the recorded step and later ones
        runs = {}
        for name, model in (("plain", plain), ("planned", planned)):
            model.train()
            model.zero_grad()
            torch.manual_seed(seed)
            seen = Planned(model.model.layers) if name == "plain" else None
            with Offloading(seen) as hooks, seen or contextlib.nullcontext():
                loss = model(**batch).loss
            alive = hooks.alive()
            loss.backward()
            runs[name] = (hooks, alive, seen, [p.grad.clone() for p in model.parameters()])
        (plain_hooks, plain_alive, seen, plain_grads), (hooks, alive, _, grads) = runs["plain"], runs["planned"]
        assert alive == plain_alive
        assert set(hooks.unpacks.values()) == {1} and len(hooks.unpacks) == len(hooks.taken)
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
        assert plain_hooks.planned_bytes > 0
        assert hooks.nbytes == plain_hooks.nbytes - plain_hooks.planned_bytes


def _scaled_branch(block, x):
    """A LoRA branch's shape: `x @ w.t()` scaled by a `mul` whose output is only added (nothing saves either), then
    more made after it (`sin`), where the step peaks."""
    return (x @ block.w + (x @ block.w.t()) * 0.5).sin()


def test_a_planned_op_no_save_asks_for_lets_its_inputs_go_with_its_outputs():
    """A planned call keeps its inputs for the recipe it may have to make, until one of its outputs is saved; once its
    outputs are all freed unsaved, it lets them go. Held to the layer's end before (16 MiB in a layer of README's main
    job, where LoRA scales its branch with a `mul`), the branch's output lifted every later op of the layer above
    plain PyTorch. Counted in tensor storages after every op of a later step's forward, the planned layer holds what
    plain holds, but at the op that reads the `mul`'s output (the add): there the branch's output is still held,
    as it is let go of with that output."""
    from optimum_memopt.backends.torch.measure.storages import StorageCount

    class AfterEachOp(StorageCount):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            self.seen.append((str(func), self.current))
            return out

    plain, planned = pair(_scaled_branch)
    engine(planned, ops("Mul"))
    x = torch.randn(1 << 14, 8)
    branch = x.nbytes
    for model in (plain, planned):
        step(model, x)  # step one, profiled: its watch reads (and resets) the count it finds on
    runs = []
    for model in (plain, planned):
        with AfterEachOp("cpu") as count:
            count.seen = []
            loss = model(x.clone().requires_grad_(True)).sum()
        loss.backward()  # (the planned layer's backward recomputes: other ops)
        runs.append(count.seen)
    assert [op for op, _ in runs[0]] == [op for op, _ in runs[1]]
    more = [(op, held - plain) for (op, plain), (_, held) in zip(*runs) if held != plain]
    assert more == [("aten.add.Tensor", branch)], more
