"""The plan before the GPU: tensor storages counted as CUDA counts them (`StorageCount`), a dry run of a training step
on fake tensors held to the same step run for real under the same count, `optimum_memopt.plan` and `memopt-plan`."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import free_port
from transformers import LlamaConfig

from optimum_memopt.backends.torch.measure.storages import BLOCK, StorageCount, block_bytes

pytestmark = pytest.mark.torch_backend


def tiny(layers=3, vocab=512):
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config.architectures = ["LlamaForCausalLM"]
    return config


# -- the count -------------------------------------------------------------------------------------------------------
def test_a_dry_run_holds_what_came_before_it_out_of_its_collections_unless_another_froze_objects():
    """`fake_step._collections_of_its_own`: where nothing is frozen, what lives when the dry run starts is frozen for
    its length and given back after; where something froze objects already (as this suite's conftest does between
    tests), nothing is changed, so their freeze is not undone."""
    import gc

    from optimum_memopt.backends.torch.fake_step import _collections_of_its_own

    gc.unfreeze()  # this worker's own freeze (conftest), made again after the test
    with _collections_of_its_own():
        assert gc.get_freeze_count() > 0  # the worker's modules, at least
    assert gc.get_freeze_count() == 0
    gc.freeze()
    frozen_again = gc.get_freeze_count()
    # the frozen count falls as frozen objects die (CI read 2 fewer inside once), and rises only by another freeze:
    # objects made after the freeze, alive throughout, would raise it by their number if the dry run froze again
    fresh = [object() for _ in range(10_000)]
    with _collections_of_its_own():
        inside = gc.get_freeze_count()
        assert 0 < inside <= frozen_again, (inside, frozen_again)  # not unfrozen, not frozen again
    after = gc.get_freeze_count()
    assert 0 < after <= inside, (after, inside)  # the conftest's freeze not undone
    del fresh


def test_storages_are_counted_in_cudas_blocks_and_given_back_when_freed():
    assert [block_bytes(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    with StorageCount() as count:
        a = torch.ones(1000)  # 4000 bytes -> 4096
        assert count.current == 4096
        view = a.view(10, 100).t()  # a view: the same storage, counted once
        b = a * 2
        assert count.current == 2 * 4096 and count.peak == 2 * 4096
        del b
        assert count.current == 4096 and count.peak == 2 * 4096
        count.reset_peak()
        assert count.peak == 4096
        del a
        assert count.current == 4096  # the view holds the storage
        del view
        assert count.current == 0


def test_a_tensor_made_before_the_count_is_counted_at_its_first_use_and_a_resize_is_followed():
    early = torch.zeros(256)  # 1024 bytes, made outside the count
    with StorageCount() as count:
        assert count.current == 0
        early.add_(1)
        assert count.current == 1024
        grown = torch.empty(0)
        grown.resize_(1024)
        assert count.current == 1024 + block_bytes(4096)
    del early, grown
    assert count.current == 0  # frees are seen with the count off too


def test_work_read_aside_reaches_no_peak_around_it():
    from optimum_memopt.backends.torch.measure.aside import held_aside

    with StorageCount() as count:
        kept = torch.ones(BLOCK // 4)
        count.reset_peak()
        held, _ = held_aside(lambda: torch.ones(10_000).sum(), "cpu")
        assert held >= block_bytes(40_000)
        assert count.peak == count.current == BLOCK
        del kept


# -- a dry run against the same step run for real ----------------------------------------------------------------------
CASES = {
    "eager": ({}, dict(backend=False)),
    "through the backend, nothing recomputed": ({}, dict()),
    "level 1": ({}, dict(level=1)),
    "transformers' checkpointing": ({}, dict(checkpointing=True)),
    "an op plan": ({}, dict(plans="MatMul+Mul+silu+:1:-1")),
    "mixed plans and Loss+": ({}, dict(plans="Layer+:1:-1@0,Mul+silu+:1:-1@1-2,Loss+:1:-1@chunks4")),
    "LoRA in bf16 autocast": (
        {"lora": {"r": 4}, "dtype": "bfloat16", "autocast": "bfloat16"},
        dict(plans="MatMul+:1:-1"),
    ),
    "gradient accumulation": ({"grad_accum": 2, "autocast": "bfloat16"}, dict(level=1)),
    "SGD": ({"optimizer": "sgd"}, dict(plans="Gelu+:1:-1,silu+:1:-1")),
}


def _segments(result):
    memory = result.profile.memory if result.profile is not None else None
    return None if memory is None else [(s.name, s.start_bytes, s.peak_bytes) for s in memory.segments]


def _within(a, b, share=0.01):
    return abs(a - b) <= share * max(a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_a_dry_run_counts_what_the_same_step_counts_for_real(case):
    """Fake tensors and real ones, one count: the whole run's peak, each step's, the parts at the peak, where it is,
    and every mark of step one within 1% (they are equal but for a few bytes of scalars the first fake run makes)."""
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    spec_kw, kw = CASES[case]
    spec = StepSpec(tiny(), batch=2, seq=128, **spec_kw)
    fake, real = dry_run(spec, fake=True, **kw), dry_run(spec, fake=False, **kw)
    assert _within(fake.peak_bytes, real.peak_bytes), (fake.peak_bytes, real.peak_bytes)
    assert _within(fake.before_training_bytes, real.before_training_bytes)
    assert all(_within(f, r) for f, r in zip(fake.step_peaks, real.step_peaks)), (fake.step_peaks, real.step_peaks)
    assert fake.peak_at == real.peak_at
    assert all(abs(fake.parts[p] - real.parts[p]) <= 0.01 * real.peak_bytes for p in real.parts), (
        fake.parts,
        real.parts,
    )
    if kw.get("backend", True) and not kw.get("checkpointing"):
        f, r = _segments(fake), _segments(real)
        assert f is not None and [s[0] for s in f] == [s[0] for s in r]
        assert all(_within(a[2], b[2]) and _within(a[1], b[1]) for a, b in zip(f, r)), (f, r)


def test_an_attention_mask_over_every_token_is_left_out_of_sdpa_as_the_real_step_leaves_it():
    """transformers reads a 2D attention mask's values and gives SDPA no mask where it attends to every token (a
    batch of packed blocks, README's main job): a fake mask has no values, and the fake step built a 4D mask and ran
    another kernel than the real step (the main job's dry run read 6.1 MiB over its step one). A run's own dry run
    reads its real mask first (`mask_attends_all`): the fake step then counts what the real one does."""
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    spec = StepSpec(tiny(), batch=2, seq=128)

    def batch():
        ids = torch.randint(0, 512, (2, 128))
        return (), {"input_ids": ids, "attention_mask": torch.ones(2, 128, dtype=torch.long), "labels": ids}

    real = dry_run(spec, fake=False, batch=batch)
    read = dry_run(spec, batch=batch, mask_attends_all=True)
    unread = dry_run(spec, batch=batch)
    assert read.peak_bytes == real.peak_bytes and read.step_peaks == real.step_peaks, (
        read.peak_bytes,
        real.peak_bytes,
    )
    assert unread.peak_bytes > real.peak_bytes  # the fake mask's kernel keeps more: what the reading is for


@pytest.mark.parametrize("plans, level", [("MatMul+Mul+silu+:1:-1,Loss+:1:-1@chunks2", 0), (None, 1)])
def test_a_dry_runs_step_one_is_what_a_real_cpu_run_reads_with_no_count_of_its_own(plans, level):
    """One unit by construction: a real training step on the CPU, run as a user runs it (no count entered around it:
    the backend's own reading, the process's tensor storages, `measure.live`), marks the same step one as a dry run
    of it on fake tensors: every segment's start and peak above the step's start within 1%. (The real process holds
    other tensors too, as a GPU's counter would: compared above the step's start.)"""
    import optimum_memopt
    from optimum_memopt.backends.torch.fake_step import _build, _materialize
    from optimum_memopt.backends.torch.measure.live import LIVE_HOW
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    spec = StepSpec(tiny(), batch=2, seq=128, optimizer="sgd")  # no optimizer state: the dry run primes it
    fake = dry_run(spec, plans=plans, level=level).profile.memory

    torch.manual_seed(0)
    model = _build(spec)
    _materialize(model, fakes=False)
    model.train()
    handle = optimum_memopt.optimize_memory(model, plans, level=level, reports_steps=True, say=lambda text: None)
    optimizer = torch.optim.SGD(model.parameters(), lr=5e-5)
    ids = torch.randint(0, spec.config.vocab_size, (spec.batch, spec.seq))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    handle.step_done()
    real = handle.profile.memory
    handle.remove()

    assert real.how == LIVE_HOW and [s.name for s in real.segments] == [s.name for s in fake.segments]
    for f, r in zip(fake.segments, real.segments):
        assert _within(f.start_bytes - fake.start_bytes, r.start_bytes - real.start_bytes), (
            f.name,
            (f.start_bytes - fake.start_bytes) / 2**20,
            (r.start_bytes - real.start_bytes) / 2**20,
        )
        assert _within(f.peak_bytes - fake.start_bytes, r.peak_bytes - real.start_bytes), (
            f.name,
            (f.peak_bytes - fake.start_bytes) / 2**20,
            (r.peak_bytes - real.start_bytes) / 2**20,
        )


def test_op_plans_lower_a_dry_runs_peak_as_they_lower_a_real_ones():
    """A fake storage has no address: the engine told storages apart by it, so no op plan freed anything under a
    dry run. Now each is told by its identity."""
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    spec = StepSpec(tiny(), batch=2, seq=128)
    eager = dry_run(spec)
    planned = dry_run(spec, plans="MatMul+Mul+silu+:1:-1")
    assert planned.parts["activations"] < 0.8 * eager.parts["activations"]


@pytest.mark.slow
def test_autos_choice_in_a_dry_run_keeps_its_budget_and_runs_the_same_for_real():
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    spec = StepSpec(tiny(), batch=2, seq=128)
    eager = dry_run(spec, backend=False)
    floor = dry_run(spec, plans="Layer+:1:-1,Loss+:1:-1")
    budget = (eager.peak_bytes + floor.peak_bytes) / 2 / 2**20
    auto = dry_run(spec, plans="auto", budget_mb=budget)
    assert auto.auto is not None and auto.auto["config"], auto.auto
    # the choice's step (a check after it may have gone over: a fake step's, which no card ran)
    answer = auto.step_peaks[auto.answer_step]
    assert answer == auto.fit.predicted.peak_bytes <= budget * 2**20, (auto.step_peaks, auto.answer_step, budget)
    assert auto.step_peaks[0] < eager.step_peaks[0]  # step one ran every layer recomputed whole
    fake, real = dry_run(spec, plans=auto.auto["config"]), dry_run(spec, plans=auto.auto["config"], fake=False)
    assert _within(fake.peak_bytes, real.peak_bytes)


@pytest.mark.slow
def test_the_forward_auto_runs_to_find_its_layers_order_is_no_part_of_the_peak():
    """Before its steps, a dry run of `auto` runs one forward to find the order the step runs its layers in, with the
    head whole (its logits, tokens x vocabulary, and their fp32 copy): its memory is no step's. With a vocabulary large
    beside the layers and a budget that keeps the head in chunks, that forward held more than any step `auto` ran,
    and the dry run read it as its peak, "step 0, before the layers" (Llama-3.1-8B LoRA at 65,536 tokens on an
    H100: 96,094 MiB, not fitting, for a choice whose steps peak at 67,307)."""
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    config = tiny(layers=2, vocab=8192)
    config.max_position_embeddings = 2048
    spec = StepSpec(config, batch=1, seq=2048)
    auto = dry_run(spec, plans="auto", budget_mb=60)  # the head in chunks at every step (whole: over 200 MiB)
    assert auto.peak_at.startswith("step ") and not auto.peak_at.startswith("step 0"), auto.peak_at
    assert auto.peak_bytes == max(auto.step_peaks) and auto.step_peaks[auto.answer_step] <= 60 * 2**20, (
        auto.step_peaks,
        auto.answer_step,
    )


def test_the_parts_add_up_to_the_peak():
    from optimum_memopt.planning.dry_run import PARTS, StepSpec, dry_run

    result = dry_run(StepSpec(tiny(), batch=2, seq=128), level=1)
    assert set(result.parts) == set(PARTS)
    assert sum(result.parts.values()) == result.peak_bytes
    params = _params(tiny())
    weights = sum(block_bytes(p.numel() * p.element_size()) for p in params)
    assert result.before_training_bytes == result.parts["weights"] >= weights
    # fused AdamW: two moments per parameter and its step count, a scalar on the device (one block each)
    assert result.parts["optimizer state"] == 2 * weights + len(params) * BLOCK


def _params(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return list(AutoModelForCausalLM.from_config(config).parameters())


# -- plan() and memopt-plan --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_plan_compares_every_way_and_writes_every_figure(tmp_path):
    import optimum_memopt

    # no search for the largest batch and sequence (`Plan.reach`: its own test below): under an L4's 24 GiB the tiny
    # model's batch search doubles for 17 dry runs
    plan = optimum_memopt.plan(tiny(), batch=2, seq=128, bf16=True, device="L4", budget_mb=None, search=False)
    names = [c.name for c in plan.configurations]
    assert names[:5] == [
        "eager",
        "transformers' checkpointing",
        "level 1 (every layer recomputed)",
        "Loss+ (the head in chunks)",
        "level 1 + Loss+",
    ]
    assert names[-1].startswith("auto")
    for c in plan.configurations:
        assert c.problem is None, (c.name, c.problem)
        assert c.fits is True and c.step_seconds > 0 and c.peak_mb > c.before_training_mb > 0
    table = plan.table()
    assert "L4: 24 GiB" in table and "fastest that fits" in table and "not seen by a dry run" in table
    assert plan.configurations[-1].choice is not None and "auto chose:" in table
    plan.write_json(str(tmp_path / "plan.json"))
    record = json.loads((tmp_path / "plan.json").read_text())
    first = record["configurations"][0]
    assert set(first) >= {"name", "flags", "peak_mb", "before_training_mb", "parts_mb", "fits", "step_seconds"}
    assert record["device"]["name"] == "L4" and record["budget_mb"] == pytest.approx(plan.device.budget_mb)


@pytest.mark.slow
def test_a_budget_nothing_fits_under_is_said(tmp_path):
    import optimum_memopt

    # the least memory a row reaches and `auto` (every row is dry-run alike; the search finds nothing under 1 MiB)
    plan = optimum_memopt.plan(tiny(), batch=2, seq=128, budget_mb=1, rows=["level 1 + Loss+", "auto"], search=False)
    assert [c.name for c in plan.configurations] == ["level 1 + Loss+", "auto"]
    assert all(c.fits is not True for c in plan.configurations)
    auto = plan.configurations[-1]
    assert auto.name == "auto" and auto.peak_mb is None and auto.problem
    said = next(line for line in plan.table().splitlines() if line.startswith("nothing fits:"))
    assert "train LoRA (`--use_peft`)" in said and "--fsdp 'full_shard auto_wrap' --num_processes 8" in said


def _cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "optimum_memopt.planning.cli", *args], capture_output=True, text=True, cwd=cwd
    )


_NO_FAKE_LEFT = """
import sys, torch
from transformers import LlamaConfig
from optimum_memopt.planning.dry_run import StepSpec, dry_run
from torch._subclasses.fake_tensor import FakeTensor
config = LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                     num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
dry_run(StepSpec(config, batch=1, seq=16), plans="Layer+:1:-1")
def faked(v):
    try:
        d = getattr(getattr(v, "__func__", v), "__defaults__", None)
        return isinstance(v, FakeTensor) or any(isinstance(x, FakeTensor) for x in (d if isinstance(d, tuple) else ()))
    except Exception:  # a lazy attribute that raises when read (torch.backends.cuda's without CUDA)
        return False
fake = []
for name, module in list(sys.modules.items()):
    for attr, value in list(getattr(module, "__dict__", {}).items()):
        inside = list(vars(value).items()) if isinstance(value, type) else []
        for where, v in [(attr, value)] + [(attr + "." + a, v) for a, v in inside]:
            if faked(v):
                fake.append(name + "." + where)
print("fake:", fake)
from peft.tuners.loha.layer import HadaWeight  # its `scale` default is a tensor made as the module is imported
w = [torch.ones(4, 2, requires_grad=True), torch.ones(2, 4), torch.ones(4, 2), torch.ones(2, 4)]
print("loha:", float(HadaWeight.apply(*w).sum()))
"""


@pytest.mark.slow
def test_a_dry_run_leaves_no_fake_tensor_in_the_process():
    """A fresh process's first dry run imports nothing under its fake mode: a module first imported there keeps fake
    tensors for the rest of the process (the package's callbacks, imported as the backend was put on the model, pulled
    in transformers' trainer and PEFT, whose LoHa then failed on real tensors: "Please convert all Tensors to
    FakeTensors first"). No module, class or function default holds a fake tensor after it, and LoHa's weight runs."""
    pytest.importorskip("peft")
    res = subprocess.run([sys.executable, "-c", _NO_FAKE_LEFT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "fake: []" in res.stdout and "loha: 64.0" in res.stdout, res.stdout


@pytest.mark.slow
def test_memopt_plan_reads_a_local_config_and_writes_json(tmp_path):
    folder = tmp_path / "model"
    tiny(layers=2).save_pretrained(folder)
    out = tmp_path / "plan.json"
    run = _cli("--model_name_or_path", str(folder), "--per_device_train_batch_size", "2", "--block_size", "64",
               "--bf16", "--use_peft", "--lora_r", "4", "--memory_budget_mb", "40", "--search", "false",
               "--json", str(out))  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "memopt-plan (a dry run on fake tensors)" in run.stdout and "LoRA r=4" in run.stdout
    record = json.loads(out.read_text())
    assert record["step"]["lora"]["r"] == 4 and record["step"]["dtype"] == "bfloat16"
    assert record["configurations"][-1]["fits"] is True


@pytest.mark.slow
def test_memopt_plan_shards_with_fsdp2_over_the_processes_given(tmp_path, capsys):
    """The command's `main` in this process (test_memopt_plan_reads_a_local_config_and_writes_json runs the command
    line itself)."""
    from optimum_memopt.planning.cli import main

    folder = tmp_path / "model"
    tiny(layers=2, vocab=1024).save_pretrained(folder)
    out = tmp_path / "plan.json"
    # no budget: no `auto` row, whose dry run checks its choices step by step (its sharded figures: test_multiprocess)
    common = ["--model_name_or_path", str(folder), "--per_device_train_batch_size", "2", "--block_size", "64",
              "--search", "false"]  # fmt: skip
    assert main([*common, "--json", str(tmp_path / "whole.json")]) == 0
    capsys.readouterr()
    assert main([*common, "--fsdp", "full_shard auto_wrap", "--num_processes", "4", "--json", str(out)]) == 0
    assert "FSDP2 over 4 processes (what rank 0 holds)" in capsys.readouterr().out
    sharded, unsharded = json.loads(out.read_text()), json.loads((tmp_path / "whole.json").read_text())
    assert sharded["step"]["fsdp"] == 4 and unsharded["step"]["fsdp"] == 1
    for a, b in zip(sharded["configurations"], unsharded["configurations"]):
        assert a["name"] == b["name"] and a["before_training_mb"] < b["before_training_mb"] / 3, (a, b)


@pytest.mark.parametrize(
    "args, said",
    [
        (["--device", "H300"], "`--device H300` is not in the device table; accepted: H100-80GB"),
        (["--device", "a100"], "`--device a100` is not in the device table"),
        (["--optim", "adamw_8bit"], "`--optim adamw_8bit` has no dry run here; accepted: adamw_torch_fused"),
        (["--per_device_train_batch_size", "0"], "`--per_device_train_batch_size 0` must be at least 1"),
        (["--bf16", "--fp16"], "`--bf16` and `--fp16` were both given"),
        (["--memory_opt_config", "Gelu+:x:-1"], "`--memory_opt_config` entry 'Gelu+:x:-1' has optimization type 'x'"),
        (["--memory_budget_mb", "-5"], "`--memory_budget_mb -5` must be above 0"),
        (["--fsdp", "hybrid_shard", "--num_processes", "8"], "`--fsdp hybrid_shard`: a dry run shards as FSDP2's"),
        (["--fsdp", "full_shard"], "`--fsdp full_shard` over one process shards nothing"),
        (["--num_processes", "0"], "`--num_processes 0` must be at least 1"),
        (["--deepspeed", "ds.json"], "`--deepspeed ds.json`: ZeRO's partitions are DeepSpeed's own code"),
    ],
)
def test_memopt_plan_refuses_bad_flags_before_anything_runs(tmp_path, capsys, args, said):
    """The command's `main` in this process (test_memopt_plan_reads_a_local_config_and_writes_json runs the command
    line itself)."""
    from optimum_memopt.planning.cli import main

    folder = tmp_path / "model"
    tiny(layers=1).save_pretrained(folder)
    code, stderr = main(["--model_name_or_path", str(folder), *args]), capsys.readouterr().err
    assert code == 2 and said in stderr, stderr


def test_memopt_plan_says_when_no_config_can_be_read(tmp_path, capsys):
    from optimum_memopt.planning.cli import main

    code, stderr = main(["--model_name_or_path", str(tmp_path / "missing")]), capsys.readouterr().err
    assert code == 2 and "no config could be read" in stderr and "config.json" in stderr


@pytest.mark.slow
def test_the_largest_batch_and_sequence_found_fit_and_one_more_does_not():
    """`Plan.reach`: each value found is checked by a dry run that fits, and the next value up (a batch more, 128
    tokens more) by one that does not, with the attention kernels of the card the plan is for (`backends.torch.measure.attention`:
    fp32 with as many key heads as query heads takes memory-efficient attention on the default H100, which keeps no
    probabilities, so the sequence can grow; with grouped heads the math path keeps them, and it cannot here). The
    plan dry-runs the floor's row alone (`rows`): which row is the floor is held by the tests around this one."""
    import optimum_memopt
    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    config = tiny(vocab=2048)
    config.max_position_embeddings, config.num_key_value_heads = 1 << 14, 4
    plan = optimum_memopt.plan(config, batch=2, seq=128, budget_mb=12, rows=["level 1 + Loss+ + MLP+ (8 tiles)"])
    reach = plan.reach
    # the least `auto` reaches: the layers recomputed whole, the head in chunks, the MLPs in 8 tiles
    assert reach["under"] == "level 1 + Loss+ + MLP+ (8 tiles)" and reach["batch"] > 2 and reach["seq"] > 128, reach
    floor = dict(
        plans="Layer+:1:-1,Loss+:1:-1,MLP+:1:-1@tiles8", kernels=CudaKernels(DEVICES[DEFAULT_DEVICE].capability)
    )
    budget = 12 * 2**20
    spec = StepSpec(config, batch=2, seq=128)
    # the search's own dry runs count the peak alone (no lever measured after the step, no table): the same peak as a
    # whole dry run's at the size found (held here, at the batch), so the rest is checked by such runs
    whole = dry_run(_with(spec, "batch", reach["batch"]), **floor)
    for field, step in (("batch", 1), ("seq", 128)):
        found = reach[field]
        alone = dry_run(_with(spec, field, found), **floor, peak_only=True)
        assert alone.peak_bytes <= budget and alone.report is None
        assert dry_run(_with(spec, field, found + step), **floor, peak_only=True).peak_bytes > budget
        if field == "batch":
            assert (alone.peak_bytes, alone.parts, alone.peak_at, alone.step_peaks) == (
                whole.peak_bytes,
                whole.parts,
                whole.peak_at,
                whole.step_peaks,
            ) and (whole.report is not None)
    # a dry run's levers measured on fake tensors: nothing of their time is a run's start (`levers_measured_s`)
    assert whole.profile.levers.keys() >= {"loss", "mlp"} and whole.report.levers_measured_s == {}
    assert not any("of the run's start" in note for note in whole.report.notes)
    assert f"auto fits up to batch {reach['batch']:,} at 128 tokens" in plan.table()


def _with(spec, field, value):
    from dataclasses import replace

    return replace(spec, **{field: value})


def test_work_read_aside_is_in_neither_the_steps_peak_nor_its_time():
    """The loss lever measures its ways after step one, aside: a dry run's peak, parts and roofline are the step's."""
    from optimum_memopt.backends.torch.fake_step import PartsCount
    from optimum_memopt.backends.torch.measure.op_costs import OpCosts

    count = PartsCount()
    count.ops = OpCosts()
    with count:
        a = torch.ones(1024)
        count.aside += 1
        b = torch.ones(1 << 20) @ torch.ones(1 << 20)
        count.aside -= 1
        c = a * 2
    # a and c, and b: the scalar the work aside left (its inputs, 4 MiB each, never reached the top)
    assert count.top == 2 * 4096 + 512 and len(count.ops.costs) == 2, (count.top, count.ops.costs)
    del b, c


# -- sharding across processes ----------------------------------------------------------------------------------------
def fsdp_spec(processes=2):
    """The step the FSDP2 tests plan: every layer and the model sharded over `processes` (worker_plan.py runs it for
    real on two)."""
    from optimum_memopt.planning.dry_run import StepSpec

    return StepSpec(tiny(vocab=1024), batch=2, seq=64, fsdp=processes)


def test_a_dtensor_is_counted_by_the_shard_it_wraps_and_fsdp2s_resizes_are_followed():
    """A wrapper subclass's own storage is as big as the whole tensor and holds nothing: counted, it put the whole
    model back into a sharded one's count (1.98 MB became 2.23 MB for eight shards of a tiny Llama). FSDP2 frees a
    layer's gathered weights by resizing their storage to 0, which no op shows."""
    from torch.testing._internal.two_tensor import TwoTensor

    with StorageCount() as count:
        pair = TwoTensor(torch.ones(1024), torch.ones(1024))  # a wrapper of two storages of 4096 bytes
        doubled = pair * 2  # made by an op: the count sees the wrappers, and counts what they wrap
        assert doubled.untyped_storage().nbytes() == 4096 and count.current == 4 * 4096  # not 6 * 4096
        del pair, doubled
        assert count.current == 0
        count.reset_peak()
        gathered = torch.empty(2048)
        assert count.current == 8192
        gathered.untyped_storage().resize_(0)  # as FSDP2 frees a layer's weights after its forward
        assert count.current == 0
        gathered.untyped_storage().resize_(8192)  # and gathers them again for its backward
        assert count.current == count.peak == 8192
    assert "_memopt_resize_" not in vars(torch.UntypedStorage)  # torch's own method given back with no count on


@pytest.mark.slow
def test_fsdp2_holds_a_shard_of_the_weights_on_each_process():
    """Each of eight processes holds an eighth of the weights (padded to even shards), and its step gathers one
    layer at a time."""
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    whole = dry_run(fsdp_spec(1), backend=False)
    sharded = dry_run(fsdp_spec(8), backend=False)
    weights = sum(p.numel() * p.element_size() for p in _params(tiny(vocab=1024)))
    assert whole.before_training_bytes >= weights
    assert weights / 8 <= sharded.before_training_bytes <= weights / 8 + 64 * BLOCK, sharded.before_training_bytes
    assert sharded.parts["optimizer state"] < whole.parts["optimizer state"] / 6
    assert sharded.peak_bytes < whole.peak_bytes
    assert sum(sharded.parts.values()) == sharded.peak_bytes
    # at the peak (the head and loss) the model's own weights are gathered whole beside the shards: weights too
    assert sharded.parts["weights"] > sharded.before_training_bytes
    assert sharded.parts["head and loss"] == whole.parts["head and loss"]
    # the whole model built before sharding never reaches the device: no peak before training, however little the
    # step holds (level 1 on sixteen layers: its shards, its optimizer's state and two layers gathered at a time)
    wide = tiny(layers=16, vocab=128)
    wide.hidden_size, wide.intermediate_size = 256, 1024
    floor = dry_run(StepSpec(wide, batch=1, seq=16, fsdp=8), level=1)
    whole_model = sum(p.numel() * p.element_size() for p in _params(wide))
    assert floor.peak_at.startswith("step 1") and floor.peak_bytes < whole_model, (floor.peak_at, floor.peak_bytes)


_DDP_BUCKETS = """
import os, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoConfig, AutoModelForCausalLM
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
ddp = DistributedDataParallel(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1])))
print(sum(int(n) for n in ddp._get_ddp_logging_data()["bucket_sizes"].split(", ")))
dist.destroy_process_group()
"""


@pytest.mark.loopback  # its one-process group's rendezvous port
@pytest.mark.slow
def test_ddp_holds_its_gradient_buckets_beside_the_gradients(tmp_path):
    """Several processes without `--fsdp` are DDP's: each holds the whole model and, from DDP's start, its gradient
    buckets (a flat copy of every trained gradient). The dry run's buckets are as big as a real DDP's say they are."""
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    config = tiny(layers=2, vocab=1024)
    alone = dry_run(StepSpec(config, batch=2, seq=64), backend=False)
    replicated = dry_run(StepSpec(config, batch=2, seq=64, ddp=2), backend=False)
    grads = sum(p.numel() * p.element_size() for p in _params(config) if p.requires_grad)
    buckets = replicated.before_training_bytes - alone.before_training_bytes
    assert buckets == block_bytes(grads), (buckets, grads)  # one flat bucket of fp32
    assert replicated.peak_bytes == alone.peak_bytes + buckets and replicated.peak_at == alone.peak_at
    assert replicated.parts["gradients"] == alone.parts["gradients"] + buckets
    config.save_pretrained(tmp_path)
    real = subprocess.run(
        [sys.executable, "-c", _DDP_BUCKETS, str(tmp_path), str(free_port())], capture_output=True, text=True
    )
    assert real.returncode == 0, real.stderr
    assert block_bytes(int(real.stdout.split()[-1])) == buckets, (real.stdout, buckets)
    with pytest.raises(ValueError, match="FSDP2 .* or replicates with DDP, not both"):
        StepSpec(config, fsdp=2, ddp=2)


@pytest.mark.slow
def test_memopt_plan_over_several_processes_without_fsdp_is_ddps(tmp_path, capsys):
    from optimum_memopt.planning.cli import main

    folder = tmp_path / "model"
    tiny(layers=2, vocab=1024).save_pretrained(folder)
    # no budget: the step's record and its words, not `auto`'s choice
    common = ["--model_name_or_path", str(folder), "--per_device_train_batch_size", "2", "--block_size", "64",
              "--search", "false"]  # fmt: skip
    assert main([*common, "--num_processes", "4", "--json", str(tmp_path / "ddp.json")]) == 0
    assert "DDP over 4 processes (each: the whole model and DDP's gradient buckets)" in capsys.readouterr().out
    record = json.loads((tmp_path / "ddp.json").read_text())
    assert record["step"]["ddp"] == 4 and record["step"]["fsdp"] == 1


@pytest.mark.slow
def test_autos_row_is_its_choices_step_which_a_runs_step_one_runs():
    """`auto`'s dry run measures step one with every layer recomputed whole (each MLP whole) and runs its choices in
    the steps after, its answer in the last; a training run's `auto` starts from a dry run of its own step and runs
    the choice from step one. Where
    the choice tiles the MLPs at a length whose untiled step does not fit, the row is the choice's step (it fits),
    not the measuring step (Llama-3.1-8B LoRA at 131,072 tokens on an H100 read 79,551 MiB, "no", for a choice of
    tiled MLPs), and how far `auto` reaches is searched from the least it reaches: the MLPs tiled too."""
    import optimum_memopt

    config = tiny(layers=2, vocab=256)
    config.intermediate_size, config.max_position_embeddings = 1792, 1024
    config.num_attention_heads = config.num_key_value_heads = 1  # the MLP, not eager attention's scores, is the most
    floors = ["level 1 + Loss+", "level 1 + Loss+ + MLP+ (8 tiles)"]  # the rows read here, and `auto`'s (`rows`)
    rows = {c.name: c for c in optimum_memopt.plan(config, batch=1, seq=1024, rows=floors).configurations}
    untiled, tiled = rows[floors[0]].peak_mb, rows[floors[1]].peak_mb
    assert tiled < untiled - 1, (tiled, untiled)
    budget = (tiled + untiled) / 2
    plan = optimum_memopt.plan(config, batch=1, seq=1024, budget_mb=budget, rows=[*floors, "auto"])
    auto = plan.configurations[-1]
    assert auto.name == "auto" and "MLP+" in auto.choice, (auto.choice, auto.problem)
    assert auto.fits and auto.peak_mb <= budget and not auto.peak_at.startswith("step 1,"), (
        auto.peak_mb,
        auto.peak_at,
    )
    assert sum(auto.parts_mb.values()) == pytest.approx(auto.peak_mb)
    table = plan.table()
    assert "(its row: the choice's step, which a run's step one runs)" in table
    assert plan.reach["under"] == "level 1 + Loss+ + MLP+ (8 tiles)" and plan.reach["batch"] >= 1, plan.reach


@pytest.mark.slow
def test_mlps_drawing_several_dropout_masks_are_no_floor_auto_reaches():
    """LoRA with dropout on the MLP's projections: each MLP draws three masks a forward, which tiles draw in another
    order, so `auto` never tiles them. The tiled row keeps its figures, with a note that says so, and how far `auto`
    reaches is searched from the least it does reach: every layer recomputed whole and the head in chunks."""
    import optimum_memopt

    lora = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.1, "target_modules": ["gate_proj", "up_proj", "down_proj"]}
    floors = ["level 1 + Loss+", "level 1 + Loss+ + MLP+ (8 tiles)"]  # the rows read here, and `auto`'s (`rows`)
    plan = optimum_memopt.plan(
        tiny(layers=2, vocab=256), batch=1, seq=128, lora=lora, budget_mb=1e4, rows=[*floors, "auto"]
    )
    rows = {c.name: c for c in plan.configurations}
    tiled = rows[floors[1]]
    assert tiled.peak_mb is not None and tiled.note.startswith("`auto` does not tile these MLPs: each draws 3 ")
    assert tiled.note.endswith("`--lora_dropout 0` lets it, where the masks are LoRA's")
    assert "MLP+" not in (rows["auto"].choice or "")
    assert plan.reach["under"] == "level 1 + Loss+", plan.reach
    # each size dry-run once: the sequence's cap (256) is twice the plan's and the search's prediction, run once
    sizes = [(k, run[k]) for run in plan.reach["runs"] for k in ("batch", "seq") if k in run]
    assert len(sizes) == len(set(sizes)) and ("seq", 256) in sizes, plan.reach["runs"]
    assert f"level 1 + Loss+ + MLP+ (8 tiles): {tiled.note}" in plan.table()
    # the note is the tiled row's alone
    without = optimum_memopt.plan(
        tiny(layers=2, vocab=256), batch=1, seq=128, lora={**lora, "lora_dropout": 0.0}, rows=floors[1:]
    )
    assert [c.note for c in without.configurations] == [None]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen3_moe", "lfm2", "bart", "gemma3", "rwkv"])
def test_the_order_forward_with_layers_replayed_reads_what_the_full_one_reads(kind):
    """The forward that finds the layers a step runs (`fake_step.layer_order`) runs each layer once for each form of
    call and makes its output again for the others: the layers run, in their order, and where the model's own code
    lets go of each layer's input read the same as a forward running every layer, on families whose layers return a
    tensor, a tuple, carry a state (RWKV) or route to experts, and a VLM on text alone (Gemma 3, its tower left out);
    with four layers alike, three are replayed (fewer fake ops)."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
    import families

    from optimum_memopt.backends.torch import _torch_api, fake_step
    from optimum_memopt.backends.torch.apply.layers import find_layers

    families.SMALL.update(num_hidden_layers=4, num_layers=4, n_layer=4, n_layers=4, decoder_layers=4)
    try:
        with torch.device("meta"):
            model = families.build(kind)
    finally:
        families.SMALL.update(num_hidden_layers=2, num_layers=2, n_layer=2, n_layers=2, decoder_layers=2)
    layers = find_layers(model)
    vocab = model.config.get_text_config().vocab_size

    class Ops(_torch_api.TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.n += 1
            return func(*args, **(kwargs or {}))

    read = {}
    with _torch_api.fake_mode(), fake_step._experts_kernel():  # an MoE's experts as a dry run runs them
        fake_step._materialize(model)
        model.train()
        ids = torch.randint(0, min(vocab, 256), (2, 16))
        for replayed in (False, True):
            gone = {}
            Ops.n = 0
            with Ops():
                running = fake_step.layer_order(
                    model, layers, lambda: model(input_ids=ids, labels=ids), gone, replayed
                )
            read[replayed] = (running, gone, Ops.n)
    assert read[True][:2] == read[False][:2]
    assert read[True][1], "no layer's input was seen let go of"
    assert read[True][2] < read[False][2]
