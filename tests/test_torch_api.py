"""Each private torch access of the torch backend (`backends/torch/_torch_api.py`) against the installed torch:
when a torch release moves one, this fails in CI, before a user's run does."""

import contextlib

import pytest
import torch

pytestmark = pytest.mark.torch_backend


def test_the_dispatch_mode_base_class_is_where_the_backend_imports_it():
    from torch.utils._python_dispatch import TorchDispatchMode

    from optimum_memopt.backends.torch import _torch_api

    assert _torch_api.TorchDispatchMode is TorchDispatchMode


def test_the_active_saved_tensor_hooks_can_be_read():
    from optimum_memopt.backends.torch import _torch_api

    assert hasattr(torch._C._autograd, "_top_saved_tensors_default_hooks")  # else the fallback gives None

    def pack(x):
        return x

    def unpack(x):
        return x

    assert _torch_api.top_saved_tensors_hooks() is None
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert _torch_api.top_saved_tensors_hooks() == (pack, unpack)


def test_op_schemas_say_which_outputs_alias_and_the_name_fallback_agrees():
    from optimum_memopt.backends.torch import _torch_api

    aten = torch.ops.aten
    assert hasattr(aten.gelu.default, "_schema") and hasattr(aten.gelu.default._schema.returns[0], "alias_info")
    cases = {aten.gelu.default: False, aten.mm.default: False, aten.view.default: True, aten.add_.Tensor: True}
    cases.update({aten.t.default: True, aten._unsafe_view.default: False})  # _unsafe_view: a fresh alias, unsaid
    for func, aliases in cases.items():
        assert _torch_api.returns_alias(func) is aliases, func

    class NoSchema:  # what the fallback sees if `_schema` goes away
        def __init__(self, func):
            self.overloadpacket = func.overloadpacket

    for func in (aten.gelu.default, aten.mm.default, aten.view.default, aten.add_.Tensor, aten.t.default):
        assert _torch_api.returns_alias(NoSchema(func)) is cases[func], func


def test_version_counters_count_in_place_changes():
    from optimum_memopt.backends.torch import _torch_api

    t = torch.zeros(2)
    before = _torch_api.version(t)
    t.add_(1)
    assert _torch_api.version(t) == before + 1
    assert _torch_api.op_name(torch.ops.aten.gelu.default) == "gelu"


def test_op_schemas_say_which_arguments_an_op_writes_and_the_name_fallback_agrees():
    from optimum_memopt.backends.torch import _torch_api

    aten = torch.ops.aten
    a, b, out = torch.zeros(2), torch.ones(2), torch.empty(2)
    assert _torch_api.written_args(aten.add_.Tensor, (a, b), {}) == [a]
    assert _torch_api.written_args(aten.add.out, (a, b), {"out": out}) == [out]
    assert _torch_api.written_args(aten.add.Tensor, (a, b), {}) == []
    assert aten.add_.Tensor._schema.arguments[0].alias_info.is_write

    class NoSchema:
        def __init__(self, func):
            self.overloadpacket = func.overloadpacket

    assert _torch_api.written_args(NoSchema(aten.mul_.Tensor), (a, b), {}) == [a]
    assert _torch_api.written_args(NoSchema(aten.mul.Tensor), (a, b), {}) == []


def test_a_views_base_can_be_read():
    from optimum_memopt.backends.torch import _torch_api

    w = torch.nn.Parameter(torch.randn(3, 4))
    assert hasattr(w.t(), "_base")  # else the fallback treats a parameter's view as a tensor of its own
    assert _torch_api.view_base(w.t()) is w and _torch_api.view_base(w) is w


def test_a_storage_is_referenced_weakly_past_the_tensor_that_made_it():
    """nn.Linear on a 3-D input: the matmul's output tensor dies at once, its storage lives on in `_unsafe_view`'s."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from optimum_memopt.backends.torch import _torch_api

    out = torch.randn(6, 4)
    ref = _torch_api.storage_ref(out)
    assert isinstance(ref, StorageWeakRef)  # else the fallback: a weak reference to the tensor object
    view = torch.ops.aten._unsafe_view.default(out, [2, 3, 4])
    del out
    assert not ref.expired()
    del view
    assert ref.expired()


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_around_the_code_is_seen_in_its_forward_and_recompute(reentrant):
    from torch.utils.checkpoint import checkpoint

    from optimum_memopt.backends.torch import _torch_api

    assert hasattr(torch._C, "_current_graph_task_id")  # else a reentrant recompute goes unseen
    seen = []

    def f(x):
        seen.append(_torch_api.foreign_recompute())
        return (x * 2).sin()

    x = torch.randn(3, requires_grad=True)
    checkpoint(f, x, use_reentrant=reentrant).sum().backward()
    if reentrant:  # its forward runs without grad (the backend's layers pass through); the recompute is seen
        assert seen == [None, "during a backward pass (a recompute: torch.utils.checkpoint with use_reentrant=True)"]
    else:
        assert seen == ["inside torch.utils.checkpoint", "inside torch.utils.checkpoint's recompute"]
    seen.clear()
    f(x).sum().backward()
    assert seen == [None]


def test_a_model_compiled_by_torch_compile_is_recognised():
    from torch import nn

    from optimum_memopt.backends.torch import _torch_api

    assert hasattr(torch._dynamo.eval_frame, "OptimizedModule")  # else the `_orig_mod` fallback decides
    model = nn.Sequential(nn.Linear(2, 2))
    assert _torch_api.compiled_by(model) is None
    assert _torch_api.compiled_by(torch.compile(model)) == ("OptimizedModule (torch.compile's wrapper of Sequential)")


def test_the_innermost_dispatch_mode_can_be_read():
    """The step readings leave their mode only where it is the innermost (leaving it under another would take the
    other off the stack in its place)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: F401 (the private name itself)

    from optimum_memopt.backends.torch import _torch_api

    outer, inner = _torch_api.TorchDispatchMode(), _torch_api.TorchDispatchMode()
    assert not _torch_api.dispatch_mode_on_top(outer)
    with outer:
        assert _torch_api.dispatch_mode_on_top(outer)
        with inner:
            assert not _torch_api.dispatch_mode_on_top(outer) and _torch_api.dispatch_mode_on_top(inner)
        assert _torch_api.dispatch_mode_on_top(outer)


def test_a_fake_storage_has_an_identity_its_views_share():
    """A dry run tells storages apart as a real run does: by `storage_identity` (a fake storage has no address)."""
    from optimum_memopt.backends.torch import _torch_api

    with _torch_api.fake_mode():
        a, b = torch.randn(4, 4), torch.randn(4, 4)
        assert _torch_api.is_fake(a)
        ids = {_torch_api.storage_identity(t.untyped_storage()) for t in (a, a.t(), a[1:], b)}
        assert len(ids) == 2 and 0 not in ids
    real = torch.randn(3)
    assert not _torch_api.is_fake(real)
    assert _torch_api.storage_identity(real.untyped_storage()) == _torch_api.storage_identity(
        real[1:].untyped_storage()
    )


def test_a_fake_tensors_device_is_answered_as_the_fake_mode_answers_it_and_not_passed_down():
    """The autograd engine asks `prim.device` of every tensor it takes; a mode of the backend answers it for a fake
    tensor as the fake mode would (its fake device, `meta` inside a kernel), and a mode under it never sees the query;
    every other op passes down."""
    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.measure.storages import StorageCount

    class Under(_torch_api.TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.asked, self.ops = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.prim.device.default:
                self.asked += 1
            else:
                self.ops += 1
            return func(*args, **(kwargs or {}))

    fake = _torch_api.fake_mode()
    with fake:
        x = torch.randn(4, 4, requires_grad=True)
    for answering in (False, True):
        under = Under()
        with fake, under, StorageCount() if answering else contextlib.nullcontext():
            assert torch.ops.prim.device.default(x) == torch.device("cpu") == x.device
            (x * 2).sum().backward()  # the engine asks each input's device
        assert under.ops > 0
        assert (under.asked == 0) if answering else (under.asked > 0)
    with fake:
        fake.in_kernel_invocation = True
        try:
            with StorageCount():
                assert torch.ops.prim.device.default(x) == torch.device("meta")
        finally:
            fake.in_kernel_invocation = False


def test_a_fake_splits_pieces_are_keyed_alike_in_the_fake_tensor_cache():
    """FakeTensor's cache keys an op by its inputs' storage offsets: the pieces of a split labels tensor each missed
    it in every op on them. `split_keyed_alike` views each piece of a fake tensor without gradient from its storage's
    start: the same storage (counted once), shapes and strides; an op on a second piece of the same size hits the
    cache. A real tensor, or one a gradient flows through, is split as it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from optimum_memopt.backends.torch import _torch_api

    with _torch_api.fake_mode():
        labels = torch.randint(0, 10, (1, 17))[..., 1:].reshape(-1)  # offset 1, as the shifted labels are
        plain, alike = labels.split(5), _torch_api.split_keyed_alike(labels, 5)
        assert [p.shape for p in alike] == [p.shape for p in plain] and len(alike) == 4
        assert [p.stride() for p in alike] == [p.stride() for p in plain]
        assert {p.storage_offset() for p in plain} == {1, 6, 11, 16} and {p.storage_offset() for p in alike} == {0}
        key = _torch_api.storage_identity(labels.untyped_storage())
        assert all(_torch_api.storage_identity(p.untyped_storage()) == key for p in alike)
        for pieces, misses_expected in ((plain, 1), (alike, 0)):
            pieces[0].ne(-100)  # the first piece of its size: in the cache from here on
            before = FakeTensorMode.cache_info().misses
            pieces[1].ne(-100)
            assert FakeTensorMode.cache_info().misses - before == misses_expected
        grads = torch.randn(16, requires_grad=True)
        assert [p.storage_offset() for p in _torch_api.split_keyed_alike(grads, 5)] == [0, 5, 10, 15]
    real = torch.arange(16)
    assert [p.storage_offset() for p in _torch_api.split_keyed_alike(real, 5)] == [0, 5, 10, 15]


def test_backward_is_told_from_forward():
    from optimum_memopt.backends.torch import _torch_api

    seen = []
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()
    x.register_hook(lambda g: seen.append(_torch_api.in_backward()))
    assert not _torch_api.in_backward()
    y.backward()
    assert seen == [True]


def test_a_wrapper_subclass_shows_the_tensors_it_wraps():
    from torch.testing._internal.two_tensor import TwoTensor

    from optimum_memopt.backends.torch import _torch_api

    a, b = torch.ones(4), torch.zeros(4)
    assert [t is x for t, x in zip(_torch_api.wrapped_tensors(TwoTensor(a, b)), (a, b))] == [True, True]
    assert _torch_api.wrapped_tensors(a) is None and _torch_api.wrapped_tensors(torch.nn.Parameter(a)) is None


def test_a_storage_resized_from_python_is_told_and_torchs_method_given_back():
    from optimum_memopt.backends.torch import _torch_api

    original = torch.UntypedStorage.resize_
    told = []
    _torch_api.watch_storage_resizes(told.append)
    try:
        storage = torch.empty(8).untyped_storage()
        storage.resize_(0)
        assert told == [storage] and storage.nbytes() == 0
    finally:
        _torch_api.watch_storage_resizes(None)
    assert torch.UntypedStorage.resize_ is original


def test_a_fake_process_group_runs_collectives_in_one_process():
    import torch.distributed as dist

    from optimum_memopt.backends.torch import _torch_api

    _torch_api.fake_process_group(4)
    try:
        assert dist.get_world_size() == 4 and dist.get_rank() == 0
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, torch.ones(2))  # moves nothing, and returns
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_whether_the_profiler_records_can_be_read():
    from optimum_memopt.backends.torch import _torch_api

    assert _torch_api.profiling() is False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert _torch_api.profiling() is True
    assert _torch_api.profiling() is False


def test_a_structure_of_tensors_is_flattened_and_made_again():
    """The order forward makes a layer's output again from its leaves (`fake_step._layers_replayed`): tuples, dicts
    and transformers' `ModelOutput`s are opened, other objects are leaves."""
    from transformers.modeling_outputs import BaseModelOutputWithPast

    from optimum_memopt.backends.torch import _torch_api

    marker = object()
    value = (BaseModelOutputWithPast(last_hidden_state=torch.ones(2)), {"a": torch.zeros(3), "b": 4}, marker)
    leaves, spec = _torch_api.flatten(value)
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, torch.Tensor, int, object] and leaves[3] is marker
    again = _torch_api.unflatten([torch.full((2,), 7.0), torch.zeros(3), 4, marker], spec)
    assert isinstance(again[0], BaseModelOutputWithPast) and again[0].last_hidden_state.tolist() == [7.0, 7.0]
    assert again[1]["b"] == 4 and again[2] is marker
