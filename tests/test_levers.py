"""The lever protocol (`backends/torch/levers/protocol.py`): a lever is one module under `levers/` and one line of
registration. With a lever double that acts in layers and takes a parameter (`tests/doubles/stash.py`, shaped as
an offload: its work overlaps compute), the grammar names its layers and its parameter together and refuses bad
entries with the accepted form, the ORT backend refuses it, the policy holds it as `{name: option}`, the solver
searches the product of the levers' options around the layers' programme (overlapped work priced by what outruns
its window), and the backend builds, installs, reports and removes it whole. A copy of the package with the double
added under `levers/` and one registration line, nothing else, trains with it through every path."""

import ast
import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import tiny_decoder

from optimum_memopt.backends.torch import levers as levers_registry
from optimum_memopt.backends.torch.decide.budget import LeverChoice, fit, predict
from optimum_memopt.backends.torch.measure.profile import HEAD_PLACE
from optimum_memopt.plans import LeverOption, LeverPart, PlanError, parse_inline, parse_plans

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.join(os.path.dirname(HERE), "optimum_memopt")
TORCH_PKG = os.path.join(PKG, "backends", "torch")


@pytest.fixture
def stash(monkeypatch):
    """The double registered as the one line a lever adds (`levers.REGISTERED`)."""
    monkeypatch.setitem(levers_registry.REGISTERED, "Stash+", "doubles.stash")
    from doubles import stash

    return stash


# -- the grammar ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, layers, parameter, count",
    [
        ("Stash+:1:-1@0-7:copies4", "0-7", "copies4", -1),  # layers and a parameter together
        ("stash+:1:-1@0+5:Copies2", "0+5", "copies2", -1),  # one spelling
        ("Stash+:1:4@copies2", "", "copies2", 4),  # the first 4 layers
        ("Stash+:1:-1@copies2", "", "copies2", -1),  # every layer
        ("Stash+:1:-1@every2", "every2", "", -1),  # layers alone, the default parameter
        ("Stash+:1:-1", "", "", -1),
    ],
)
def test_an_entry_names_a_levers_layers_and_its_parameter_together(stash, text, layers, parameter, count):
    (entry,) = parse_inline(text)
    assert (entry.subgraph, entry.layers, entry.parameter, entry.apply_count) == ("Stash+", layers, parameter, count)
    assert parse_inline(str(entry)) == [entry]  # it writes back as it reads


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("Stash+:1:-1@0-1:tiles2", "has copy count 'tiles2'; expected 'copiesN' (N copies in flight), N from 1"),
        ("Stash+:1:-1@0-1:copies0", "has copy count 'copies0'"),
        ("Stash+:1:-1@0-1:", "has copy count ''"),
        ("Stash+:1:-1@", "has layer selector '' with an empty item"),
        (
            "Stash+:1:2@0-1:copies2",
            "gives both a count (2) and layers (@0-1); give one, as in 'Stash+:1:-1@0-1:copies2'",
        ),
        ("Stash+:1:-1@0-x:copies2", "has layer selector '0-x' with item '0-x'"),
        ("Stash+:1:0", "has apply count 0"),
        ("Stash+:2:-1", "optimization type 2; `Stash+` is 1 (on) or 0 (off)"),
        ("Stash+:1:-1@0-1:copies2,Stash+:1:-1@1:copies4", "both on layer 1"),
        ("Gelu+Stash+:1:-1", "names 'Stash+' with other parts: the layers' stashed inputs are a plan of their own"),
        ("Loss+:1:-1@0-1:chunks2", "names layers ('0-1'); a model has one head, so `Loss+` takes its chunking alone"),
    ],
)
def test_bad_lever_entries_are_refused_with_the_form_that_works(stash, text, fragment):
    with pytest.raises(PlanError) as e:
        parse_inline(text)
    assert fragment in str(e.value)
    assert "Stash+:1:-1" in str(e.value) or "Loss+:1:-1" in str(e.value) or "Gelu+:1:-1" in str(e.value)


def test_every_plan_string_accepted_before_reads_as_before():
    """The grammar's room for a parameter changes no entry accepted before it (op plans, layers, `Loss+`)."""
    for text in ["Gelu+:1:-1", "Gelu+:1:2", "Mul+silu+:1:-1@0-1", "Layer+:1:-1@every2", "Layer+:1:-1@0+5+9",
                 "Loss+:1:-1", "Loss+:1:-1@chunks8", "Loss+:1:-1@tokens1024", "Cast+:2:-1"]:  # fmt: skip
        (entry,) = parse_inline(text)
        assert str(entry) == text and entry.parameter == ("" if "Loss" not in text else text.partition("@")[2])


def test_the_ort_backend_refuses_a_lever(stash):
    from optimum_memopt.config import MemoryOptConfig

    with pytest.raises(ValueError, match=r"'Stash\+:1:-1@0:copies2'.*are the torch backend's"):
        MemoryOptConfig(plans="Gelu+:1:-1,Stash+:1:-1@0:copies2", backend="ort")


def test_the_policy_holds_each_lever_as_its_name_and_option(stash):
    from optimum_memopt.backends.torch.policy import RecomputePolicy

    policy = RecomputePolicy.from_plans(parse_plans("Layer+:1:-1@0,Stash+:1:2@copies4,Loss+:1:-1@chunks8"), 0, 4)
    # each option as data: a count resolved to its layers, the parameter a word and a number
    assert policy.levers == {
        "stash": LeverOption((LeverPart((0, 1), "copies", 4),)),
        "loss": LeverOption((LeverPart(None, "chunks", 8),)),
    }
    assert {name: str(o) for name, o in policy.levers.items()} == {"stash": "0-1:copies4", "loss": "chunks8"}
    assert [p.mode for p in policy.layers] == ["layer", "keep", "keep", "keep"] and not policy.requests[1:]
    two = RecomputePolicy.from_plans(parse_plans("Stash+:1:-1@0:copies2,Stash+:1:-1@2-3"), 0, 4)
    assert two.levers == {"stash": LeverOption((LeverPart((0,), "copies", 2), LeverPart((2, 3))))}
    assert str(two.levers["stash"]) == "0:copies2;2-3"
    assert stash.SYNTAX.plan_of(policy.levers["stash"]) == "Stash+:1:-1@0-1:copies4"
    assert stash.SYNTAX.plan_of(two.levers["stash"]) == "Stash+:1:-1@0:copies2,Stash+:1:-1@2-3"


# -- the solver ----------------------------------------------------------------------------------------------------
@pytest.mark.torch_backend
def test_the_solver_searches_the_product_of_the_levers_options_and_prices_overlap_past_its_window(stash):
    """Two levers, each with options moving the segments they act in: `fit` returns the least total cost among
    every combination of their options and the layers' choices whose predicted peak fits (brute force), with an
    offload-shaped option costing only what its copy runs past the compute it hides under."""
    import torch
    from test_torch_budget import L, gated_mlp, memory_of, whole
    from torch_engine import engine, keep, pair, step

    from optimum_memopt.backends.torch.decide.budget import freed_bytes
    from optimum_memopt.backends.torch.decide.solver import candidates

    _, model = pair(gated_mlp, n=L)
    state = engine(model, keep(L))
    step(model, torch.randn(64, 8))
    profile = state.profile
    per_layer = candidates(profile)
    q = freed_bytes(profile, whole())
    base = 10 << 20
    mem = memory_of([base + 1000] * L, base + 3 * sum(q), [base + 4000] * L, base)
    chunks4 = LeverOption((LeverPart(None, "chunks", 4),))
    heads = [LeverChoice("loss"), LeverChoice("loss", chunks4, "Loss+:1:-1@chunks4", ((HEAD_PLACE, sum(q)),), 0.004)]
    stashes = [
        LeverChoice("stash"),
        # hidden: its copy takes less than the compute it overlaps
        LeverChoice("stash", LeverOption(), "Stash+:1:-1", (("after the layers", sum(q)),), 0.0, 0, 0.001, 0.003),
        # past its window by 0.002 s
        LeverChoice("stash", LeverOption((LeverPart((0,), "copies", 2),)), "Stash+:1:-1@0:copies2",
                    (("after the layers", 2 * sum(q)),), 0.0, 0, 0.005, 0.003),
    ]  # fmt: skip
    assert [c.cost for c in stashes] == [0.0, 0.0, pytest.approx(0.002)]
    plain = predict(mem, q, [0] * L).peak_bytes
    for share in (0.0, 0.3, 0.6, 1.0):
        floor = min(
            predict(mem, q, [max(c.freed_bytes for c in o) for o in per_layer], levers=combo).peak_bytes
            for combo in itertools.product(heads, stashes)
        )
        budget = int(floor + share * (plain - floor))
        result = fit(profile, mem, budget, whole(), levers=[heads, stashes])
        best = None
        for combo in itertools.product(heads, stashes):
            for layers in itertools.product(*per_layer):
                if predict(mem, q, [c.freed_bytes for c in layers], levers=combo).peak_bytes <= budget:
                    t = sum(c.seconds for c in layers) + sum(c.cost for c in combo)
                    best = t if best is None or t < best else best
        assert result.choice is not None and result.recompute_seconds == pytest.approx(best), share
        assert result.predicted.peak_bytes <= budget and result.floor.peak_bytes == floor
        policy = result.policy()
        assert policy.levers == {c.lever: c.option for c in result.levers if c.option is not None}
        assert all(c.plan in result.config().split(",") for c in result.levers if c.plan)


# -- the backend: built, installed, reported, removed --------------------------------------------------------------
@pytest.mark.torch_backend
def test_a_lever_is_built_installed_reported_and_removed_whole(stash):
    import torch

    import optimum_memopt

    model = tiny_decoder()
    plain_hooks = [len(layer._forward_pre_hooks) for layer in model.model.layers]
    handle = optimum_memopt.optimize_memory(model, "Layer+:1:-1@0,Stash+:1:-1@1:copies2", reports_steps=True)
    lever = handle.levers["stash"]
    assert lever.option == LeverOption((LeverPart((1,), "copies", 2),)) and str(lever.option) == "1:copies2"
    assert handle.policy.levers == {"stash": lever.option}
    torch.manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        handle.step_done()
    assert lever.calls >= 2  # layer 1's forward, each step (its recompute under `Layer+` is layer 0's only)
    report = handle.report()
    assert "Stash+:1:-1@1:copies2" in report.requested and "Stash+:1:-1@1:copies2" in report.applied
    assert any(p.config == "Stash+:1:-1" for p in report.plans)
    assert any(n.startswith("`Stash+` (a double)") for n in report.notes)
    handle.remove()
    assert [len(layer._forward_pre_hooks) for layer in model.model.layers] == plain_hooks
    assert not lever.installed


def test_no_module_outside_levers_names_a_lever():
    """The backend, the engine, the planner, the table and the grammar loop over the registered levers: no module
    outside `levers/` keys a lever by its name or imports a lever's own module."""
    roots = [os.path.join(PKG, f) for f in ("plans.py", "config.py", "api.py", "trainer.py")]
    roots += [
        os.path.join(PKG, "callbacks", f) for f in os.listdir(os.path.join(PKG, "callbacks")) if f.endswith(".py")
    ]
    for folder, _, files in os.walk(TORCH_PKG):
        if "levers" not in os.path.relpath(folder, TORCH_PKG).split(os.sep):
            roots += [os.path.join(folder, f) for f in files if f.endswith(".py")]
    for path in roots:
        tree = ast.parse(open(path).read())
        for node in ast.walk(tree):
            where = f"{os.path.relpath(path, PKG)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value == "Loss+":
                raise AssertionError(f"{where} names the loss lever's plan")
            keyed = isinstance(node, ast.Subscript) and _named(node.value) and isinstance(node.slice, ast.Constant)
            got = (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get"
                and _named(node.func.value)
                and node.args
                and isinstance(node.args[0], ast.Constant)
            )
            if keyed or got:
                raise AssertionError(f"{where} keys a lever by its name")
            parts = node.module.split(".") if isinstance(node, ast.ImportFrom) and node.module else []
            if ("levers" in parts and parts[-1] != "levers") or (parts and parts[-1] in ("loss", "mlp", "head_form")):
                raise AssertionError(f"{where} imports a lever's module")
            if isinstance(node, ast.Attribute) and node.attr in ("loss", "head", "heads", "head_problem"):
                if _named(node.value, ("policy", "profile", "planner", "result", "state")):
                    raise AssertionError(f"{where} reaches the loss lever by a field of its own")


def _named(node, names=("levers", "lever_problems")) -> bool:
    """Whether `node` is a name or an attribute called one of `names`."""
    return (isinstance(node, ast.Name) and node.id in names) or (
        isinstance(node, ast.Attribute) and node.attr in names
    )


SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, {tests!r})
from helpers import tiny_decoder
import optimum_memopt
from optimum_memopt.config import MemoryOptConfig
from optimum_memopt.plans import parse_inline

out = {{"entry": str(parse_inline("Stash+:1:-1@0:copies2")[0])}}
try:
    MemoryOptConfig(plans="Stash+:1:-1@0:copies2", backend="ort")
except ValueError as e:
    out["ort"] = str(e)
model = tiny_decoder()
torch.manual_seed(0)
with optimum_memopt.optimize_memory(model, "Stash+:1:-1@0:copies2", reports_steps=True) as handle:
    for _ in range(2):
        ids = torch.randint(0, 128, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        handle.step_done()
    out["calls"] = handle.levers["stash"].calls
    out["rows"] = [p.config for p in handle.report().plans if p.config.startswith("Stash+")]
out["hooks_left"] = sum(len(layer._forward_pre_hooks) for layer in model.model.layers)
model = tiny_decoder()
handle = optimum_memopt.optimize_memory(model, "auto", budget_mb=10**6, say=lambda text: None, reports_steps=True)
for _ in range(3):
    ids = torch.randint(0, 128, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    handle.step_done()
out["candidates"] = sorted(handle.solver_figures()["lever_candidates"])
out["module"] = optimum_memopt.backends.torch.levers.module_of("Stash+").__file__
print(json.dumps(out))
"""


@pytest.mark.torch_backend
@pytest.mark.slow
def test_a_new_lever_is_one_module_in_levers_and_one_registration_line(tmp_path):
    """A copy of the package, the double written as `levers/stash.py` and its line added to `REGISTERED`, nothing
    else changed: its entries parse, the ORT backend refuses them, it trains installed and reported, comes off
    whole, and `auto` weighs its options beside the loss lever's."""
    copy = tmp_path / "optimum_memopt"
    shutil.copytree(PKG, copy, ignore=shutil.ignore_patterns("__pycache__"))
    levers = copy / "backends" / "torch" / "levers"
    shutil.copy(os.path.join(HERE, "doubles", "stash.py"), levers / "stash.py")
    registry = (levers / "__init__.py").read_text()
    line = '    "Loss+": "loss",\n'
    assert registry.count(line) == 1
    (levers / "__init__.py").write_text(registry.replace(line, line + '    "Stash+": "stash",\n'))
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=HERE)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["module"].startswith(str(levers))
    assert out["entry"] == "Stash+:1:-1@0:copies2"
    assert "'Stash+:1:-1@0:copies2'" in out["ort"] and "torch backend's" in out["ort"]
    assert out["calls"] >= 2 and out["rows"] and out["hooks_left"] == 0
    assert {"loss", "stash"} <= set(out["candidates"])
