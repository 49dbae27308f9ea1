import gc
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_DISABLED", "true")

import pytest  # noqa: E402
import torch  # noqa: E402

from optimum_memopt.backends import ort as _ort  # noqa: E402
from optimum_memopt.backends import torch as _torch_backend  # noqa: E402

# Two stacks (docs/ort-stack.md, "Two stacks"): the ORT stack (torch 2.4, onnxruntime-training) and the modern stack (torch
# >= 2.5, no ORT). Each test runs once (tests/README.md): on the modern stack, unless it is marked `ort` (it needs
# ONNX Runtime Training or its defaults: the ORT stack only) or `both_stacks` (what it checks depends on the stack it
# runs on: the ORT stack's transformers, accelerate or DeepSpeed range, or the backend that stack trains with).
ORT_STACK = _ort.is_installed()
TORCH_BACKEND = _torch_backend.torch_problem() is None

# Under pytest-xdist each worker is a process of its own on one of the machine's cores: one thread each (and in the
# processes a test starts), not every worker's torch spreading over every core.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# A worker runs hundreds of tests in one process, and what they leave alive (imported modules, fixtures, caches) makes
# every full garbage collection longer: accelerate's `free_memory` at the end of each Trainer run, and the budget
# planner before each step it measures, collect in full (0.25 s each in a fresh worker, more later; 21% of
# tests/test_backend_torch.py's time). So after collection and after each test, the garbage is collected and what
# lives is frozen (`gc.freeze`): a later collection scans what the test running made. What a test makes is collected
# as without this (nothing it made is frozen before its teardown); a reference cycle among frozen objects let go
# later (a module fixture's) is not freed, which a worker's lifetime affords.
def _freeze_what_lives():
    gc.collect()
    gc.freeze()


def pytest_collection_finish(session):
    _freeze_what_lives()


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's fixtures finalized first
    _freeze_what_lives()


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the `xdist_group` marks this adds
def pytest_collection_modifyitems(config, items):
    skip_ort = pytest.mark.skip(reason="needs the ORT stack (onnxruntime-training, torch <= 2.4): its own CI suite")
    skip_torch = pytest.mark.skip(reason="needs torch >= 2.5 (the modern stack): its own CI suite")
    skip_once = pytest.mark.skip(reason="the same on either stack: runs once, on the modern stack (tests/README.md)")
    for item in items:
        marked = {m.name for m in item.iter_markers()}
        if "ort" in marked and not ORT_STACK:
            item.add_marker(skip_ort)
        if "torch_backend" in marked and not TORCH_BACKEND:
            item.add_marker(skip_torch)
        if ORT_STACK and not marked & {"ort", "both_stacks"}:
            item.add_marker(skip_once)
        # A test that binds a port on the loopback (a process group's rendezvous) runs on one worker, one at a time:
        # a port found free and then bound by another worker's launch is a failure by chance.
        if marked & {"multiprocess", "loopback"}:
            item.add_marker(pytest.mark.xdist_group("loopback"))
        # A module whose tests share a module-scoped fixture that costs a run (a saved model, a plain run to hold the
        # others to) runs on one worker, which builds it once: on two, each would build it.
        elif "one_worker" in marked:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))


@pytest.fixture
def recomputed(monkeypatch):
    """The ops the torch backend's recipes recompute, by name (`gelu`, `mm`), one entry per computation."""
    from optimum_memopt.backends.torch.apply import recipe

    calls = []
    real = recipe.Recipe.outputs

    def counting(self):
        if self.value is None:
            calls.append(self.func.overloadpacket.__name__)
        return real(self)

    monkeypatch.setattr(recipe.Recipe, "outputs", counting)
    return calls


@pytest.fixture
def recomputed_as_first(monkeypatch):
    """Each planned output the torch backend recomputes, against the tensor the first forward made: a list of
    (op name, dtype made, dtype recomputed, bitwise equal), one entry per tensor backward asked for."""
    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.apply import recipe

    made, seen = {}, []
    real_init, real_materialize = recipe.Stashed.__init__, recipe.Stashed.materialize

    def init(self, r, index, t, saved=True):
        real_init(self, r, index, t, saved)
        made[id(self)] = (_torch_api.op_name(r.func), t.detach().clone())

    def materialize(self):
        out = real_materialize(self)
        name, first = made.pop(id(self))
        seen.append((name, first.dtype, out.dtype, torch.equal(first, out)))
        return out

    monkeypatch.setattr(recipe.Stashed, "__init__", init)
    monkeypatch.setattr(recipe.Stashed, "materialize", materialize)
    return seen
