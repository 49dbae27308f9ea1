"""The backend seam: the trainer and the arguments speak no ORT, each backend checks its own flags, one ZeRO-stage
reader serves every route, parsing loads no recompute engine, the torch backend's modules keep their jobs (import
directions), and a
configured backend that is missing from the trained model stops the run."""

import ast
import json
import os
import subprocess
import sys

import pytest
from helpers import ClsData, make_args, tiny_model
from transformers import Trainer

from optimum_memopt import MemoptTrainer, MemoptTrainingArguments
from optimum_memopt._deepspeed import zero_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "optimum_memopt")
TORCH_PKG = os.path.join(PKG, "backends", "torch")


def _imports(path):
    tree = ast.parse(open(path).read())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            out += [base] + [f"{base}.{a.name}" if node.module else f"{base}{a.name}" for a in node.names]
    return out


@pytest.mark.parametrize("module", ["trainer.py", "trainer_args.py"])
def test_the_trainer_and_the_arguments_import_nothing_of_a_backend(module):
    imported = _imports(os.path.join(PKG, module))
    assert not [n for n in imported if ".backends.ort" in n or ".backends.torch" in n or "onnxruntime" in n]


# The torch backend's modules by job, one package each: applying a policy to a running layer, measuring the step,
# deciding what to recompute (what any plan would do, the solver, the planner, the table); beside them the words the
# three share (plan names, the recompute rule, the policy model, nested arguments) and the glue to the seam.
JOBS = {
    "apply": {"engine", "clock", "recorder", "hooks", "recipe", "checkpoint", "tracking", "layers", "routing"},
    "measure": {
        "watch",
        "profile",
        "graph",
        "aside",
        "ways",
        "storages",
        "live",
        "op_costs",
        "attention",
        "dropout",
        "replay",
    },
    "decide": {"solver", "budget", "planner", "report", "from_plan", "messages"},
}
SHARED = {"names", "rule", "policy", "nested", "steps", "sharding"}
# the fake step drives the whole backend (wrapped, stepped, planned) on fake tensors: glue, as the backend is
GLUE = {"backend", "__init__", "needs", "_torch_api", "ranks", "fake_step"}
# Levers beyond a layer's recompute, above the three jobs: the protocol, and a package each (its option, its
# mechanism, its measurement on the shared harness `measure.ways`, its rows and options).
LEVERS = {
    "levers": {"__init__", "protocol"},
    "levers/loss": {"__init__", "option", "head_form", "chunks", "lever", "measure"},
    "levers/mlp": {"__init__", "option", "tiles", "lever", "measure"},
    "levers/offload": {"__init__", "option", "mover", "lever", "measure"},
}


def _modules():
    """Every module of the torch backend as (package or "", name)."""
    out = set()
    for folder, _, files in os.walk(TORCH_PKG):
        rel = os.path.relpath(folder, TORCH_PKG)
        for f in files:
            if f.endswith(".py"):
                out.add(("" if rel == "." else rel, f[:-3]))
    return out


def _key(parts):
    """The backend's module at `parts` (a path under it) as (package or "", name), a package as its `__init__`;
    None where there is none."""
    path = os.path.join(TORCH_PKG, *parts)
    if os.path.isfile(path + ".py"):
        return ("/".join(parts[:-1]), parts[-1])
    if os.path.isdir(path):
        return ("/".join(parts), "__init__")
    return None


def _torch_imports(package, name):
    """The backend's own modules that `package/name` imports, as (package or "", name), and whether it imports torch
    itself. Relative imports are resolved from the module's own place; `from X import y` is module X.y where there is
    one, else X."""
    path = os.path.join(TORCH_PKG, package, f"{name}.py")
    here = ["optimum_memopt", "backends", "torch"] + (package.split("/") if package else [])
    mine, torch_itself = set(), False
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            torch_itself |= any(a.name == "torch" or a.name.startswith("torch.") for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                torch_itself |= node.module == "torch" or (node.module or "").startswith("torch.")
                continue
            base = here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])
            if base[:3] != ["optimum_memopt", "backends", "torch"]:
                continue
            inside = base[3:]
            for a in node.names:
                # a name of the backend's face (`__init__`, which imports its modules lazily) is no module's
                key = (_key(inside + [a.name]) or _key(inside)) if inside else (_key([a.name]) or ("", a.name))
                if key is not None:
                    mine.add(key)
    return mine, torch_itself


def _jobs(mine):
    """The top packages (a job's, `levers`, or "" for the backend's own modules) of `mine`."""
    return {p.split("/")[0] for p, _ in mine}


def test_the_torch_backend_is_grouped_by_job():
    expected = {(job, n) for job, names in JOBS.items() for n in names} | {(job, "__init__") for job in JOBS}
    expected |= {("", n) for n in SHARED | GLUE} | {(p, n) for p, names in LEVERS.items() for n in names}
    assert _modules() == expected
    assert not os.path.exists(os.path.join(PKG, "backends", "torch_recompute.py"))


def _of(job):
    return sorted((job, n) for n in JOBS[job])


@pytest.mark.parametrize("module", _of("apply") + _of("measure") + _of("decide"))
def test_no_job_reaches_a_lever(module):
    """A lever uses the three jobs; none of them knows a lever (the backend installs it, the planner is handed it)."""
    mine, _ = _torch_imports(*module)
    assert not _jobs(mine) & {"levers"}, (module, mine)


@pytest.mark.parametrize("module", _of("measure"))
def test_measuring_reaches_neither_applying_nor_deciding(module):
    """The readings and step one's records are forms the other two fill and read: they import neither."""
    mine, _ = _torch_imports(*module)
    assert not _jobs(mine) & {"apply", "decide"}, (module, mine)


@pytest.mark.parametrize("module", _of("decide"))
def test_deciding_never_reaches_the_engine(module):
    """What any plan would do, the solver and the planner work on step one's figures: they import no module that
    runs a layer (the planner drives the engine through the state it is handed)."""
    mine, _ = _torch_imports(*module)
    assert not _jobs(mine) & {"apply"}, (module, mine)


@pytest.mark.parametrize("module", _of("apply"))
def test_applying_never_reaches_the_solver(module):
    """The engine takes a policy and records step one; it never asks the solver, the budget or the planner."""
    mine, _ = _torch_imports(*module)
    assert not _jobs(mine) & {"decide"}, (module, mine)


@pytest.mark.parametrize(
    "module",
    [
        ("", "rule"),
        ("", "policy"),
        ("measure", "graph"),
        ("measure", "profile"),
        ("decide", "solver"),
        ("decide", "budget"),
        ("decide", "report"),
        ("decide", "messages"),
    ],
)
def test_the_what_if_model_is_pure(module):
    """The rule, the policy, step one's graph and profile, the solver, the budget and the table import no torch, and
    of the backend only each other and the plan names."""
    mine, torch_itself = _torch_imports(*module)
    pure = {
        ("", "rule"),
        ("", "policy"),
        ("", "names"),
        ("measure", "graph"),
        ("measure", "profile"),
        ("decide", "solver"),
        ("decide", "budget"),
    }
    assert not torch_itself and mine <= pure, (module, mine - pure)


# What sits above the backends and drives them: the package's face, the Trainer, the planner of `memopt-plan`, the
# advisor. A backend is handed what it needs from them (`fake_step.Instruments`: the wrap, the clock's device).
ABOVE = ("optimum_memopt", "optimum_memopt.api", "optimum_memopt.trainer", "optimum_memopt.trainer_args",
         "optimum_memopt.planning", "optimum_memopt.advisor")  # fmt: skip


def _absolute_imports(path):
    """Every module `path` imports (at its top or inside a function), as an absolute dotted name: a `from X import y`
    gives X.y (y a module or a name of X's)."""
    parts = os.path.relpath(path, ROOT)[: -len(".py")].split(os.sep)
    package = parts[:-1]  # a module's package, or an __init__'s own: where its relative imports start
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = (package[: len(package) - node.level + 1] if node.level else []) + (
                node.module.split(".") if node.module else []
            )
            out += [".".join(base + [a.name]) for a in node.names]
    return out


def _module(dotted):
    path = os.path.join(ROOT, *dotted.split("."))
    return os.path.exists(path + ".py") or os.path.isdir(path)


def test_the_grammar_imports_no_backend():
    """`plans.py` reads the levers' plan words from registries registered with it (`register_levers`: the package's
    face registers the torch backend's), so it imports no backend, at its top or inside a function (issue 54: it
    imported the torch levers' registry, the one arrow up)."""
    imported = _absolute_imports(os.path.join(PKG, "plans.py"))
    assert not [m for m in imported if m.startswith("optimum_memopt.backends")], imported
    import optimum_memopt.plans as plans

    assert "optimum_memopt.backends.torch.levers" in plans.LEVER_REGISTRIES
    assert plans.lever_syntax("loss+").plan == "Loss+" and plans.lever_named("mlp").plan == "MLP+"


def test_no_backend_reaches_above_itself():
    """No module under `backends/` imports the package itself, its face (`api`), the Trainer and its arguments,
    `planning` or the advisor: what the torch backend's dry run needs from above is handed to it (issue 53: the dry
    run reached `optimum_memopt.optimize_memory` from inside, and `planning` imported the backend back)."""
    found = {}
    for folder, _, files in os.walk(os.path.join(PKG, "backends")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                names = _absolute_imports(path)
                up = [n for n in names if n in ABOVE or any(n.startswith(a + ".") for a in ABOVE[1:])]
                # a name of the package's face (`from optimum_memopt import optimize_memory`), not one of its modules
                up += [n for n in names if n.count(".") == 1 and n.startswith("optimum_memopt.") and not _module(n)]
                if up:
                    found[os.path.relpath(path, PKG)] = sorted(set(up))
    assert not found, found
    # and the fake step is what both callers run: `memopt-plan`'s dry run hands it the package's wrap
    from optimum_memopt.backends.torch import fake_step
    from optimum_memopt.planning import dry_run

    assert dry_run.run is fake_step.run and dry_run.StepSpec is fake_step.StepSpec


def test_the_torch_backend_has_no_import_circle():
    """Its modules' imports (at the top or inside a function) form no circle: the fake step, which the planner runs,
    takes the engine's attribute from `apply.layers` and the search's length from the planner it is handed (issue 53:
    the dry run, the planner and the backend imported each other round)."""
    graph = {m: _torch_imports(*m)[0] - {m} for m in _modules()}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError(f"an import circle: {' -> '.join('/'.join(p) for p in path[path.index(m) :] + [m])}")
        if m in done:
            return
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if n in graph:
                visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_private_torch_names_are_reached_from_one_module_only():
    """`torch._C`, `torch.utils._python_dispatch`, `._schema`, `._version`: only `_torch_api.py` touches them."""
    import re

    private = re.compile(
        r"torch\._C\b|_python_dispatch|\._schema\b|\._version\b|_top_saved_tensors_default_hooks|\._base\b"
    )
    for package, name in _modules():
        if name == "_torch_api":
            continue
        text = open(os.path.join(TORCH_PKG, package, f"{name}.py")).read()
        assert not private.findall(text), (package, name)


@pytest.mark.slow
def test_building_the_arguments_loads_no_recompute_engine():
    code = (
        "import json, sys\n"
        "from optimum_memopt import MemoptTrainingArguments\n"
        "MemoptTrainingArguments(output_dir='unused', report_to='none', use_cpu=True, memory_opt_backend='torch',"
        " memory_opt_config='Gelu+:1:-1')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('optimum_memopt.backends'))))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    if res.returncode != 0 and "torch >= 2.5" in res.stderr:
        pytest.skip("the torch backend needs the modern stack")
    assert res.returncode == 0, res.stderr
    loaded = json.loads(res.stdout.strip().splitlines()[-1])
    engine = {"tracking", "hooks", "recipe", "engine", "checkpoint", "_torch_api"}
    assert not [m for m in loaded if m.rsplit(".", 1)[-1] in engine], loaded


# -- one ZeRO-stage reader, every route ------------------------------------------------------------------------
@pytest.fixture
def no_accelerate_env(monkeypatch):
    for var in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(var, raising=False)


def _zero3_file(tmp_path):
    path = tmp_path / "ds_zero3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_batch_size": "auto"}))
    return str(path)


ROUTES = ["deepspeed path", "deepspeed dict", "accelerate config file", "accelerate zero_stage"]


def _route(route, tmp_path, monkeypatch):
    """The `--deepspeed` value for a route (None for accelerate's), with accelerate's environment set as `accelerate
    launch --config_file` sets it; and how the message names the route."""
    if route == "deepspeed path":
        return _zero3_file(tmp_path), "`--deepspeed`"
    if route == "deepspeed dict":
        return {"zero_optimization": {"stage": 3}}, "`--deepspeed`"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    if route == "accelerate config file":
        path = _zero3_file(tmp_path)
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", path)
        return None, f"accelerate's deepspeed_config_file '{path}'"
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    return None, "accelerate's zero_stage"


@pytest.mark.both_stacks  # each stack's accelerate and DeepSpeed
@pytest.mark.parametrize("route", ROUTES)
def test_the_zero_stage_is_read_from_every_route(route, tmp_path, monkeypatch, no_accelerate_env):
    deepspeed, via = _route(route, tmp_path, monkeypatch)
    assert zero_stage(deepspeed) == (3.0, via)


@pytest.mark.both_stacks
def test_no_deepspeed_is_no_stage(no_accelerate_env):
    assert zero_stage(None) == (None, "")


@pytest.mark.torch_backend
@pytest.mark.parametrize("route", ROUTES)
def test_zero3_is_taken_by_the_torch_backend_whatever_the_route(route, tmp_path, monkeypatch, no_accelerate_env):
    """The torch backend trains under ZeRO-3 (tests/test_multiprocess.py): no route refuses it."""
    deepspeed, via = _route(route, tmp_path, monkeypatch)
    kwargs = {"deepspeed": deepspeed} if deepspeed is not None else {}
    args = MemoptTrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, memory_opt_backend="torch",
        memory_opt_level=1, **kwargs,
    )  # fmt: skip
    assert args.memory_opt.backend == "torch" and args.memory_opt.level == 1
    assert zero_stage(args.deepspeed)[0] == 3


@pytest.mark.both_stacks
@pytest.mark.parametrize("route", ROUTES)
def test_zero3_is_refused_by_the_ort_backend_whatever_the_route(route, tmp_path, monkeypatch, no_accelerate_env):
    deepspeed, via = _route(route, tmp_path, monkeypatch)
    kwargs = {"deepspeed": deepspeed} if deepspeed is not None else {}
    with pytest.raises(ValueError, match=rf"^{_re(via)} selects ZeRO stage 3, which ORTModule cannot run"):
        MemoptTrainingArguments(
            output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, memory_opt_backend="ort", **kwargs
        )


def _re(text):
    import re

    return re.escape(text)


# -- names that say what they mean -------------------------------------------------------------------------------
def test_use_ort_is_the_switchs_deprecated_name_said_once_on_rank_0(tmp_path, caplog):
    """`--use_ort false` is `--memory_opt_backend none`, `--use_ort true` the default; either is said deprecated once
    (a warning the trainer logs on rank 0), and contradicting `--memory_opt_backend` is refused naming both."""
    import logging

    off = MemoptTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, use_ort=False)
    assert off.memory_opt_backend == "none" and not off.memory_opt_on and off.memory_opt.entries == []
    said = "`--use_ort false` is deprecated and will be removed: pass `--memory_opt_backend none`"
    assert [n for n in off.memory_opt_warnings if said in n] == off.memory_opt_warnings[:1]
    on = MemoptTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, use_ort=True)
    assert on.memory_opt_on and "`--use_ort true` is deprecated" in on.memory_opt_warnings[0]
    plain = MemoptTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    assert not any("deprecated" in n for n in plain.memory_opt_warnings + plain.memory_opt_notes)
    with caplog.at_level(logging.INFO, logger="optimum_memopt"):
        MemoptTrainer(model=tiny_model("deberta"), args=off)
    assert sum(said in r.getMessage() for r in caplog.records) == 1
    for use_ort, backend in ((False, "torch"), (True, "none")):
        with pytest.raises(ValueError, match=rf"`--use_ort {str(use_ort).lower()}` .* say opposite things"):
            MemoptTrainingArguments(
                output_dir="unused", report_to="none", use_cpu=True, use_ort=use_ort, memory_opt_backend=backend
            )


def test_backend_none_is_plain_pytorch_like_use_ort_false_said_deprecated():
    args = MemoptTrainingArguments(output_dir="unused", report_to="none", use_cpu=True, memory_opt_backend="none")
    assert not args.memory_opt_on and args.memory_opt_summary == "plain PyTorch (no backend)"
    with pytest.raises(
        ValueError, match=r"^`--memory_opt_config` configure .* but `--memory_opt_backend none` trains"
    ):
        MemoptTrainingArguments(
            output_dir="unused",
            report_to="none",
            use_cpu=True,
            memory_opt_backend="none",
            memory_opt_config="Gelu+:1:-1",
        )


# -- never train silently without the backend ----------------------------------------------------------------------
class SkipsTheWrap(MemoptTrainer):
    """What a transformers release that stopped calling `_wrap_model` the way the hook expects would do."""

    def _wrap_model(self, model, training=True, dataloader=None):
        return Trainer._wrap_model(self, model, training=training, dataloader=dataloader)


@pytest.mark.torch_backend
def test_a_model_the_backend_never_wrapped_stops_training_with_the_reason(tmp_path):
    import transformers

    args = make_args(tmp_path, "--max_steps", "1", "--memory_opt_backend", "torch", "--memory_opt_level", "1")
    trainer = SkipsTheWrap(model=tiny_model("bert"), args=args, train_dataset=ClsData())
    with pytest.raises(RuntimeError, match=rf"transformers {_re(transformers.__version__)} trained a model that did"):
        trainer.train()
    assert trainer.backend_model is None and trainer.ort_model is None


@pytest.mark.torch_backend
def test_backend_model_is_the_wrapped_model(tmp_path):
    args = make_args(tmp_path, "--max_steps", "1", "--memory_opt_backend", "torch", "--memory_opt_level", "1")
    trainer = MemoptTrainer(model=tiny_model("bert"), args=args, train_dataset=ClsData())
    trainer.train()
    assert trainer.backend_model is trainer.plain_model and trainer.ort_model is trainer.backend_model


@pytest.mark.parametrize(
    "old, new",
    [("compat", "transformers_releases"), ("model_compat", "eager_attention"), ("offline", "offline_defaults")],
)
def test_renamed_modules_stay_importable_under_their_old_names_and_say_so(old, new):
    """An old name is the new module itself, and its first import warns (FutureWarning) naming the new one."""
    import importlib
    import sys
    import warnings

    renamed = importlib.import_module(f"optimum_memopt.{new}")
    sys.modules.pop(f"optimum_memopt.{old}", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert importlib.import_module(f"optimum_memopt.{old}") is renamed
    said = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert said == [
        f"optimum_memopt.{old} is deprecated and will be removed: import optimum_memopt.{new} (the same module)"
    ]
    names = [n for n in vars(renamed) if not n.startswith("_") and callable(getattr(renamed, n))]
    assert names, new
    module = {}
    exec(f"from optimum_memopt.{old} import {names[0]} as found", module)
    assert module["found"] is getattr(renamed, names[0])


@pytest.mark.parametrize(
    "name,needs", [("ort", "ONNX Runtime Training"), ("torch", "torch >= 2.5 (the modern stack)")]
)
def test_each_backend_owns_its_refusal(name, needs, monkeypatch):
    """What a backend needs, and the way out, are the backend's words; the trainer only raises them."""
    from optimum_memopt.backends import get_backend

    backend = get_backend(name)
    monkeypatch.setattr(backend, "problem", lambda: "the reason")
    assert backend.refusal() == (
        f"`--memory_opt_backend {name}` needs {needs}: the reason. Or pass `--memory_opt_backend none` to train in "
        f"plain PyTorch"
    )
    assert backend.refusal(by_default=True).startswith(f"`--memory_opt_backend {name}` (the default here) needs")
    monkeypatch.setattr(backend, "problem", lambda: None)
    assert backend.refusal() is None
    trainer = open(os.path.join(PKG, "trainer.py")).read()
    assert needs not in trainer and "ONNX Runtime Training" not in trainer
