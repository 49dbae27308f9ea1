"""One step's profile (benchmarks/step_profile.py, decoder.py's `--profile_step`): the figures a card's run is read by
where `auto`'s choice is slower than a fixed recipe. Its arithmetic on a trace made by hand (kernels, copies hidden
under another stream's kernels, the backend's recompute marks), the marks the backend puts in a profile (and only
while torch's profiler records), and the decoder's flag on the CPU."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.torch_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import step_profile  # noqa: E402

from optimum_memopt.backends.torch.apply.recipe import RECOMPUTE_LAYER, RECOMPUTE_OPS  # noqa: E402


def _span(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": args.get("stream", 1), "args": args}


def test_a_trace_made_by_hand_sums_to_its_figures():
    events = [
        _span("kernel", "gemm", 0, 100, stream=7),
        _span("kernel", "gemm", 150, 100, stream=7),
        _span("kernel", "flash_bwd", 300, 400, stream=7),
        # a copy out on its own stream: 50 us of it under the first gemm, 50 under the second, 50 under none
        _span("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 50, 150, stream=20, bytes=4096),
        # a copy back under nothing of another stream (a kernel of its own stream does not hide it)
        _span("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 800, 100, stream=20, bytes=4096),
        _span("kernel", "own", 800, 100, stream=20),
        _span("gpu_user_annotation", RECOMPUTE_OPS, 0, 200, stream=7),
        _span("gpu_user_annotation", RECOMPUTE_OPS, 100, 200, stream=7),  # overlapping spans counted once
        _span("user_annotation", RECOMPUTE_OPS, 0, 30),
        _span("user_annotation", RECOMPUTE_OPS, 40, 20),
        _span("cpu_op", "aten::mm", 0, 10),
        {"ph": "i", "cat": "kernel", "name": "an instant", "ts": 5},  # not a span: left out
    ]
    got = step_profile.summarize(events, wall_ms=2.5)
    assert got["wall_ms"] == 2.5
    assert got["device"]["kernels_ms"] == pytest.approx(0.7)
    assert got["device"]["by_stream"] == pytest.approx({"7": 0.6, "20": 0.1})
    assert got["device"]["top"][0] == {"name": "flash_bwd", "count": 1, "ms": pytest.approx(0.4)}
    assert got["device"]["top"][1] == {"name": "gemm", "count": 2, "ms": pytest.approx(0.2)}
    assert got["copies"]["DtoH"] == {"count": 1, "bytes": 4096, "ms": pytest.approx(0.15), "hidden_ms": 0.1}
    assert got["copies"]["HtoD"] == {"count": 1, "bytes": 4096, "ms": pytest.approx(0.1), "hidden_ms": 0.0}
    assert got["marks"][RECOMPUTE_OPS] == {"count": 2, "host_ms": 0.05, "device_ms": 0.3}
    assert got["marks"][RECOMPUTE_LAYER] == {"count": 0, "host_ms": 0.0, "device_ms": 0.0}
    assert got["cpu_ops"] == [{"name": "aten::mm", "count": 1, "ms": 0.01}]
    table = step_profile.side_by_side(got, got)
    assert "recompute ops device (ms)" in table and "flash_bwd" in table and "copies DtoH hidden (ms)" in table


def test_intervals_merge_and_cover():
    merged = step_profile.union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert merged == [(0, 3), (5, 9)]
    assert step_profile.covered(merged, 2, 6) == 2  # 2-3 and 5-6
    assert step_profile.covered(merged, 10, 12) == 0 and step_profile.covered(merged, -5, 20) == 7


def _tiny_step(plans):
    from transformers import LlamaConfig, LlamaForCausalLM

    import optimum_memopt

    config = LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         vocab_size=128, max_position_embeddings=64, use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    optimum_memopt.optimize_memory(model, plans)
    ids = torch.randint(0, 128, (2, 32))
    return lambda: model(input_ids=ids, labels=ids).loss.backward()


@pytest.mark.parametrize("plans, mark", [("Layer+:1:-1", RECOMPUTE_LAYER), ("silu+Mul+:1:-1", RECOMPUTE_OPS)])
def test_the_backend_marks_its_recompute_in_a_profile_and_only_there(plans, mark):
    from optimum_memopt.backends.torch.apply.recipe import marked

    step = _tiny_step(plans)
    step()  # step one: the backend measures
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = [e.name for e in prof.events()]
    other = RECOMPUTE_OPS if mark == RECOMPUTE_LAYER else RECOMPUTE_LAYER
    assert names.count(mark) >= 2 and other not in names  # one a layer recomputed (or an op), each layer
    # outside a profile the mark is no range at all
    with marked(mark) as inside:
        assert inside is None


@pytest.mark.slow
def test_the_decoder_profiles_the_step_asked_for(tmp_path):
    out = tmp_path / "prof.json"
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "decoder.py"), "--output_dir", str(tmp_path / "o"),
               "--preset", "tiny", "--seq", "64", "--max_steps", "3", "--per_device_train_batch_size", "2",
               "--report_to", "none", "--use_cpu", "--memory_opt_backend", "torch", "--memory_opt_config",
               "Layer+:1:-1", "--profile_step", "2", "--profile_out", str(out)]  # fmt: skip
    res = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["step"] == 2 and got["on"] == "cpu" and got["wall_ms"] > 0
    assert got["marks"][RECOMPUTE_LAYER]["count"] == 2 and got["marks"][RECOMPUTE_LAYER]["host_ms"] > 0
    assert any(op["name"] == "aten::mm" for op in got["cpu_ops"])


@pytest.mark.slow
def test_the_decoders_first_step_can_be_shorter_and_auto_plans_again_for_the_rest(tmp_path):
    """`--first_seq`: the first step's samples shorter than the rest, in order; `auto` chooses for the first and plans
    again for the longer, as a card's run of it reads (docs/GPU.md)."""
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "decoder.py"), "--output_dir", str(tmp_path / "o"),
               "--preset", "tiny", "--seq", "128", "--first_seq", "64", "--max_steps", "3",
               "--per_device_train_batch_size", "2", "--report_to", "none", "--use_cpu", "--memory_opt_backend",
               "torch", "--memory_opt_config", "auto", "--memory_budget_mb", "1000000"]  # fmt: skip
    res = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    said = res.stdout + res.stderr
    assert "a batch of 2 x 128 tokens (256) runs next, more than the 2 x 64 (128)" in said, said[-3000:]
    assert said.count("a dry run of step one in") == 1, said[-3000:]
    assert said.count("a dry run of the step of 2 x 128 tokens in") == 1, said[-3000:]
    assert said.count("the step of 2 x 128 tokens ran the dry run's choice and keeps it") == 1, said[-3000:]
