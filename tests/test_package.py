"""The package as a whole: importing it is light and leaves the process alone; its structure keeps its promises."""

import ast
import json
import os
import subprocess
import sys

import pytest

PKG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "optimum_memopt")


def _modules():
    for root, _, files in os.walk(PKG):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PKG), ast.parse(open(path).read())


@pytest.mark.both_stacks  # onnxruntime and DeepSpeed installed (the ORT stack) and not loaded
@pytest.mark.slow
def test_import_is_light_and_changes_nothing():
    code = (
        "import json, logging, os, sys, time\n"
        # transformers 5's arguments import torch._inductor, which sets TORCHINDUCTOR_CACHE_DIR: not the plugin's doing
        "import transformers.training_args\n"
        "env = dict(os.environ); handlers = list(logging.getLogger().handlers)\n"
        "t = time.perf_counter()\n"
        "import optimum_memopt\n"
        "from optimum_memopt import MemoptTrainingArguments, MemoryOptConfig, parse_plans\n"
        "took = time.perf_counter() - t\n"
        "print(json.dumps({'took': took, 'loaded': [m for m in ('deepspeed', 'onnxruntime', 'matplotlib', "
        "'transformers.trainer') if m in sys.modules], 'env_same': env == dict(os.environ), "
        "'root_handlers_same': handlers == logging.getLogger().handlers, "
        "'own_handlers': len(logging.getLogger('optimum_memopt').handlers)}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["loaded"] == []  # DeepSpeed, ORT, matplotlib and the Trainer load on first use
    assert out["env_same"] and out["root_handlers_same"] and out["own_handlers"] == 0
    print(f"import optimum_memopt + arguments: {out['took']:.2f} s")  # the figure, for the log; no timed assertion


def test_only_the_ort_backend_imports_onnxruntime():
    importers = set()
    for rel, tree in _modules():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(n == "onnxruntime" or n.startswith("onnxruntime.") for n in names):
                importers.add(rel)
    assert importers == {os.path.join("backends", "ort.py")}


def test_no_memopt_variable_is_read_and_no_logging_is_configured():
    for rel, tree in _modules():
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert not any(s.startswith("MEMOPT_") for s in strings), rel
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attrs & {"basicConfig", "addHandler", "use"}, rel  # no handler, no matplotlib.use
        # `propagate` may be read (callbacks.base asks whether a handler will show a record), never set
        set_attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)}
        assert "propagate" not in set_attrs, rel
        imported = {a.name for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        assert "matplotlib.pyplot" not in imported and "pyplot" not in imported, rel


def test_one_plan_string_parser():
    # every split of a plan string on ':' happens in the grammar module
    for rel, tree in _modules():
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "split"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value == ":"
            ):
                assert rel == "plans.py", f"{rel}:{node.lineno} splits a plan string itself"


def test_the_trainer_hook_overrides_only_what_it_documents():
    tree = dict(_modules())["trainer.py"]
    mixin = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MemoptTrainerMixin")
    methods = {n.name for n in mixin.body if isinstance(n, ast.FunctionDef)}
    from transformers import Trainer

    overridden = {m for m in methods if hasattr(Trainer, m)}
    assert overridden == {
        "__init__",
        "train",
        "_wrap_model",
        "training_step",
        "compute_loss",
        "_save",
        "_load_best_model",
        "_load_rng_state",
        "log",
        "get_optimizer_cls_and_kwargs",
    }
