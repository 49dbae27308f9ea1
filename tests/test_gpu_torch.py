"""The torch backend on CUDA: dropout's random state replayed on the GPU, autocast (bf16 / fp16), the CUDA memory
phases, the loss lever (`Loss+`) in fp32 and bf16, `auto` under a budget with its picture and planning again for a
longer batch, the layers' saved tensors
offloaded (`Offload+`), and DeepSpeed ZeRO-2 with fp16 and DeepSpeed's FusedAdam. Skipped where no CUDA device is present; the CPU side of the same code runs in
test_backend_torch.py, test_torch_loss.py and test_torch_budget.py (`scripts/gpu_check.sh` runs these and
test_random_streams.py on the GPU)."""

import csv
import json
import os

import pytest
import torch
from helpers import ClsData, LossRecordingTrainer, Tokens, make_args, tiny_decoder
from test_attention import attention_cases, attention_inputs, case_name
from test_backend_torch import build_model

from optimum_memopt.backends.torch.measure.live import held_outside, make_library_workspaces
from optimum_memopt.backends.torch.names import canonical_ops

pytestmark = [pytest.mark.torch_backend, pytest.mark.gpu]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

STEPS = 12


def _train(out, *flags, dropout=0.0, steps=STEPS):
    args = make_args(out, "--max_steps", str(steps), "--logging_steps", "4", *flags)
    trainer = LossRecordingTrainer(model=build_model("bert", dropout=dropout), args=args, train_dataset=ClsData(n=96))
    trainer.train()
    return trainer


def _report(out):
    return json.loads((out / "memory_plans.json").read_text())


def _found(out):
    """Every plan the first step found on this device (run with an unknown request, so nothing is applied)."""
    _train(out, "--memory_opt_backend", "torch", "--memory_opt_config", "Nothing+:1:-1", dropout=0.1, steps=1)
    return sorted(p["config"] for p in _report(out)["plans"] if not p.get("lever"))  # the layers' plans


@needs_cuda
def test_cuda_dropout_replays_its_random_state(tmp_path):
    """On CUDA dropout is one fused op (`native_dropout`); every plan the table finds, dropout's included, is
    recomputed with the generator state of its forward: losses equal plain PyTorch's under the same seed."""
    torch.backends.cuda.matmul.allow_tf32 = False
    found = _found(tmp_path / "probe")
    assert any(p.startswith("Dropout+") for p in found), found
    eager = _train(tmp_path / "eager", "--memory_opt_backend", "none", dropout=0.1).losses
    plans, claimed = [], set()
    for plan in sorted(
        found, key=lambda p: not p.startswith("Dropout+")
    ):  # each op in one plan (the flag refuses one named twice)
        names = set(canonical_ops(plan.split(":")[0])[0])
        if not names & claimed:
            plans.append(plan)
            claimed |= names
    run = _train(
        tmp_path / "run", "--memory_opt_backend", "torch", "--memory_opt_config", ",".join(plans), dropout=0.1
    )
    assert max(abs(a - b) for a, b in zip(run.losses, eager)) <= 1e-5, (run.losses, eager)
    on = {p["config"] for p in _report(tmp_path / "run")["plans"] if p["enabled"]}
    assert any(p.startswith("Dropout+") for p in on), on


@needs_cuda
def test_cuda_library_workspaces_are_made_once_and_counted_as_held():
    """cuBLAS's workspaces (one for this thread, one for autograd's) are blocks CUDA's counter reads and no storage
    shows: `auto` makes them before its dry run of step one, so that what the process holds outside the step counts
    them (else step one's check reads them over the prediction)."""
    device = torch.device("cuda")
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    model = torch.nn.Linear(64, 64).to(device)
    before = held_outside(model, (), device)
    made = make_library_workspaces(device)
    if clear is not None:
        assert made >= 2**20, made  # 65 MiB on an H200: 32 a thread, and 1 more
    assert make_library_workspaces(device) == 0  # made once
    assert held_outside(model, (), device) == before + made


@needs_cuda
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_autocast_plans_and_level_1(tmp_path, precision):
    """Under autocast the recipes hold the ops as dispatched (already in half precision): the recomputed values are
    the forward's, so losses equal the plain autocast run's; level 1 reruns the layer under the same autocast."""
    eager = _train(tmp_path / "eager", "--memory_opt_backend", "none", f"--{precision}").losses
    for name, flags in [
        ("plans", ["--memory_opt_config", "Gelu+:1:-1,LayerNormalization+:1:-1"]),
        ("l1", ["--memory_opt_level", "1"]),
        # CUDA's attention kernels return None among their outputs, which the CPU's do not
        ("attention", ["--memory_opt_config", "Attention+:1:-1"]),
    ]:
        run = _train(tmp_path / name, "--memory_opt_backend", "torch", f"--{precision}", *flags)
        assert max(abs(a - b) for a, b in zip(run.losses, eager)) <= 1e-4, (name, run.losses, eager)
        assert any(p["enabled"] for p in _report(tmp_path / name)["plans"])


@needs_cuda
def test_cuda_memory_phases_are_read_from_the_allocator(tmp_path):
    _train(tmp_path, "--memory_opt_backend", "torch", "--memory_opt_config", "Gelu+:1:-1", "--print_memory_stats")
    rows = list(csv.DictReader(open(tmp_path / "memory_phases.csv")))
    assert rows and all(r["device"] == "cuda" and float(r["reserved_mb"]) > 0 for r in rows)
    by_step = {}
    for r in rows:
        by_step.setdefault(int(r["step"]), {})[r["phase"]] = float(r["in_use_mb"])
    # activations are held from the end of forward until backward frees them
    assert all(p["post_forward"] > p["pre_forward"] for p in by_step.values() if len(p) == 4)


def _decoder_run(out, *flags, steps=6, batch=8):
    """The tests' Llama-style decoder (3 layers, hidden 128, vocabulary 512, 256 tokens a row) on CUDA."""
    args = make_args(
        out, "--max_steps", str(steps), "--logging_steps", "1", "--per_device_train_batch_size", str(batch), *flags
    )
    trainer = LossRecordingTrainer(model=tiny_decoder(), args=args, train_dataset=Tokens(n=steps * batch))
    trainer.train()
    return trainer


@needs_cuda
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_loss_lever_trains_as_the_models_own_head(tmp_path, precision):
    """`Loss+` on CUDA: one chunk gives the plain run's losses (bitwise in fp32), four chunks the same to the chunked
    sum's roundings; the head's ways are measured after step one on the GPU, the model's own head among them (never
    with more memory than step one's peak left free), and the table shows their rows."""
    torch.backends.cuda.matmul.allow_tf32 = False
    half = ["--bf16"] if precision == "bf16" else []
    plain = _decoder_run(tmp_path / "plain", "--memory_opt_backend", "none", *half).losses
    one = _decoder_run(tmp_path / "one", "--memory_opt_backend", "torch", "--memory_opt_config",
                       "Layer+:1:-1@0,Loss+:1:-1@chunks1", *half)  # fmt: skip
    four = _decoder_run(tmp_path / "four", "--memory_opt_backend", "torch", "--memory_opt_config",
                        "Layer+:1:-1@0,Loss+:1:-1@chunks4", *half)  # fmt: skip
    if precision == "fp32":
        assert one.losses == plain, (one.losses, plain)
    else:  # bf16: the first step exact, later ones within bf16's roundings of the chunked gradients
        assert one.losses[0] == plain[0] and max(abs(a - b) for a, b in zip(one.losses, plain)) <= 1e-2
    tolerance = 1e-5 if precision == "fp32" else 1e-2
    assert max(abs(a - b) for a, b in zip(four.losses, plain)) <= tolerance, (four.losses, plain)
    lever = four.memopt_handle.levers["loss"]
    assert lever.calls == 6 and lever.last["chunks"] == 4
    profile = four.memopt_handle.profile
    head = profile.levers.get("loss")  # the head's measure (levers/loss/measure.py), or why there is none
    assert head is not None and head.ran == "Loss+:1:-1@chunks4", profile.lever_problems.get("loss")
    assert head.option("") is not None or "" in head.why_not  # the whole head run, or said why not
    rows = [p for p in _report(tmp_path / "four")["plans"] if p.get("lever") == "loss"]
    assert rows and any(p["enabled"] and p["config"] == "Loss+:1:-1@chunks4" for p in rows)


@needs_cuda
def test_cuda_auto_meets_its_budget_and_draws_its_picture(tmp_path):
    """`auto` on CUDA (tensor bytes in the caching allocator, its peak counter reset at each mark): with room to
    spare it recomputes nothing; under a budget halfway from the least recompute reaches to eager's peak it chooses
    recompute, every check measures within the budget, the losses are the roomy run's to the chunked loss's
    roundings, and the picture and `solver.json` are written."""
    torch.backends.cuda.matmul.allow_tf32 = False
    roomy = _decoder_run(tmp_path / "roomy", "--memory_opt_backend", "torch", "--memory_opt_config", "auto",
                         "--memory_budget_mb", "100000")  # fmt: skip
    planner = roomy.memopt_handle.planner
    assert planner.device == "cuda" and planner.fits[0].choice is not None
    eager, floor = planner.verified[0]["measured_peak_mb"], planner.fits[0].floor.peak_mb
    assert floor < eager, (floor, eager)
    budget = round((eager + floor) / 2, 1)
    tight = _decoder_run(tmp_path / "tight", "--memory_opt_backend", "torch", "--memory_opt_config", "auto",
                         "--memory_budget_mb", str(budget))  # fmt: skip
    planner = tight.memopt_handle.planner
    assert planner.stage == "done" and planner.fits[-1].config(), planner.verified
    for check in planner.verified:
        assert check["measured_peak_mb"] <= budget, (budget, planner.verified)
    assert max(abs(a - b) for a, b in zip(tight.losses, roomy.losses)) <= 1e-5, (tight.losses, roomy.losses)
    assert (tmp_path / "tight" / "memory_auto" / "step_memory.png").stat().st_size > 0
    solver = json.loads((tmp_path / "tight" / "memory_auto" / "solver.json").read_text())
    assert solver["memory"]["device"] == "cuda" and solver["budget_mb"] == pytest.approx(budget)


@needs_cuda
@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "measured"])
def test_cuda_auto_plans_again_for_a_longer_batch_within_its_budget(tmp_path, dry_run):
    """On CUDA, as on the CPU (tests/test_torch_budget.py): batches of 8 x 16 tokens, then 8 x 32; under a budget the
    short ones fit with nothing recomputed and the long ones do not, the long batch is planned for again before its
    step (what the process holds outside it read from CUDA's counter mid-run, the optimizer's state left out), which
    recomputes and stays within the budget, checked. `measured`: with no dry run (`--memory_auto_dry_run false`, as
    under FSDP or DeepSpeed) the long batch's step is measured again, every layer recomputed whole."""
    longer_batch_within_budget(tmp_path, dry_run, use_cpu=False)


def longer_batch_within_budget(tmp_path, dry_run: bool, use_cpu: bool) -> None:
    """The body of the test above, on `use_cpu`'s device: two micro-batches a step, two steps of short batches (one
    with a dry run: its step one's choice is checked by the long step's dry run), then long ones."""
    import gc

    from test_torch_budget import _train_lengths

    torch.backends.cuda.matmul.allow_tf32 = False
    short, steps = (16, 5) if dry_run else (32, 6)  # measured: the short batches' choice made at step two

    def run(name, budget_mb):
        trainer, losses = _train_lengths(
            tmp_path, name, budget_mb, short=short, accumulate=2, steps=steps, use_cpu=use_cpu, dry_run=dry_run
        )
        planner = trainer.memopt_handle.planner
        found = (planner.device, planner.earlier, planner.planned_shape, planner.fits[-1], planner.verified, losses)
        del trainer, planner
        gc.collect()
        if not use_cpu:
            torch.cuda.empty_cache()
        return found

    device, earlier, shape, last, verified, roomy_losses = run("roomy", 10**6)
    assert device == ("cpu" if use_cpu else "cuda") and shape == (8, 32), (device, shape)
    assert [e["batch"] for e in earlier] == [[8, 16]], earlier
    short_mb, long_mb, floor_mb = earlier[0]["predicted_peak_mb"], verified[0]["measured_peak_mb"], last.floor.peak_mb
    assert max(short_mb, floor_mb) < long_mb, (short_mb, floor_mb, long_mb)
    budget = round((max(short_mb, floor_mb) + long_mb) / 2, 1)
    _, earlier, shape, final, verified, losses = run("tight", budget)
    seen = (budget, earlier, final.config(), verified)
    assert shape == (8, 32) and earlier[0]["config"] == "" and final.config(), seen
    assert verified and all(check["measured_peak_mb"] <= budget for check in verified), seen
    assert max(abs(a - b) for a, b in zip(losses, roomy_losses)) <= 1e-5, (losses, roomy_losses)


@needs_cuda
def test_cuda_deepspeed_zero2_fp16_fused_adam(tmp_path, monkeypatch):
    """One GPU, DeepSpeed ZeRO-2 in fp16 with DeepSpeed's own Adam (FusedAdam on CUDA, built by DeepSpeed's op
    builder): the torch backend's plans apply inside the DeepSpeed engine and training goes down."""
    pytest.importorskip("deepspeed")
    saved = dict(os.environ)  # the Trainer's DeepSpeed set-up writes ACCELERATE_USE_DEEPSPEED and more here
    try:
        _zero2_fp16(tmp_path, monkeypatch)
    finally:
        # leave no DeepSpeed state behind for the tests and child processes that follow
        os.environ.clear()
        os.environ.update(saved)
        from accelerate.state import AcceleratorState
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        AcceleratorState._reset_state(reset_partial_state=True)
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _zero2_fp16(tmp_path, monkeypatch):
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("WORLD_SIZE", "1")
    # DeepSpeed 0.19.8's op builder cannot parse arch-specific entries such as "9.0a" (docs/STACK.md): build
    # FusedAdam for this device's own compute capability.
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "{}.{}".format(*torch.cuda.get_device_capability()))
    cfg = {
        "zero_optimization": {"stage": 2},
        "fp16": {"enabled": "auto", "initial_scale_power": 8},
        "optimizer": {"type": "Adam", "params": {"lr": "auto", "weight_decay": "auto"}},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
    }
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    trainer = _train(
        tmp_path / "run",
        "--memory_opt_backend",
        "torch",
        "--memory_opt_config",
        "Gelu+:1:-1",
        "--fp16",
        "--deepspeed",
        str(tmp_path / "ds.json"),
        "--print_memory_stats",
        steps=30,
    )
    assert type(trainer.model_wrapped).__name__ == "DeepSpeedEngine"
    inner = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    inner = getattr(inner, "optimizer", inner)
    assert type(inner).__name__ == "FusedAdam", type(inner)
    assert [p["config"] for p in _report(tmp_path / "run")["plans"] if p["enabled"]] == ["Gelu+:1:-1"]
    finite = [x for x in trainer.losses if x == x]
    assert len(finite) >= 20 and sum(finite[-5:]) / 5 < sum(finite[:5]) / 5, trainer.losses


DETERMINISTIC = [(False, True), (True, True), (True, False)]  # (on, warn only)
DETERMINISTIC_IDS = ["default", "deterministic-warn-only", "deterministic"]


@pytest.fixture(params=DETERMINISTIC, ids=DETERMINISTIC_IDS)
def determinism(request):
    """Deterministic algorithms off, on with warnings only, and on; as they were after."""
    was = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(request.param[0], warn_only=request.param[1])
    yield request.param
    torch.use_deterministic_algorithms(was[0], warn_only=was[1])


@needs_cuda
def test_cuda_attention_kernel_is_the_one_torch_takes(determinism):
    """The dry run's rules (`backends.torch.measure.attention.choose`, torch 2.11's) name the kernel this torch takes on this card
    (`torch._fused_sdp_choice`) for every kind of input, with deterministic algorithms off, on with warnings only
    (cuDNN's attention still taken, as an H200 showed) and on (not taken)."""
    from optimum_memopt.backends.torch.measure.attention import CHOICE_VALUES, CudaKernels, choose

    kernels, wrong = CudaKernels.here(), []
    for case in attention_cases():
        (q, k, v), kw = attention_inputs(case, "cuda")
        theirs = torch._fused_sdp_choice(
            q, k, v, kw["attn_mask"], kw["dropout_p"], kw["is_causal"], enable_gqa=kw["enable_gqa"]
        )
        ours = choose(kernels, q, k, v, **kw)
        if CHOICE_VALUES[ours] != theirs:
            wrong.append(f"{case_name(case)}: ours {ours}, torch {theirs}")
    assert not wrong, f"{kernels}: {len(wrong)} of {len(attention_cases())} apart: " + "; ".join(wrong)


@needs_cuda
def test_cuda_attention_keeps_what_the_dry_run_counts(determinism):
    """What one attention call keeps for backward on CUDA (its storages on the card, in the caching allocator's
    512-byte blocks, the inputs left out) is what the fake call run as this card runs it keeps
    (`tests/test_attention.py`'s `kept`), for every kind of input."""
    from test_attention import kept

    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.backends.torch.measure.storages import block_bytes

    kernels, wrong = CudaKernels.here(), []
    for case in attention_cases():
        (q, k, v), kw = attention_inputs(case, "cuda")
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if t.device.type == "cuda":
                saved[_torch_api.storage_identity(storage)] = block_bytes(storage.nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
        mine = {_torch_api.storage_identity(t.untyped_storage()) for t in (q, k, v)}
        real = sum(n for key, n in saved.items() if key not in mine)
        (cq, ck, cv), ckw = attention_inputs(case, "cpu")
        fake, ran = kept(kernels, (cq, ck, cv), blocks=True, **ckw)
        if fake != real:
            wrong.append(f"{case_name(case)} {'/'.join(ran)}: dry run {fake}, CUDA {real}")
    assert not wrong, f"{kernels}: {len(wrong)} of {len(attention_cases())} apart: " + "; ".join(wrong)


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_dropout_keeps_what_the_dry_run_counts(dtype):
    """What each dropout call keeps for backward on CUDA (its storages on the card, in 512-byte blocks, the input's
    left out) is what the fake call run as a card runs it keeps (`tests/test_dropout.py`'s `kept`): the fused
    call's one-byte mask, the in-place call's noise, nothing where nothing is drawn."""
    from test_dropout import P, kept

    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.measure.storages import block_bytes

    calls = {
        "module": torch.nn.Dropout(P).train(),
        "in place": lambda t: torch.nn.functional.dropout(t, P, True, inplace=True),
        "p 0": lambda t: torch.nn.functional.dropout(t, 0.0, True),
        "p 1": lambda t: torch.nn.functional.dropout(t, 1.0, True),
        "eval": lambda t: torch.nn.functional.dropout(t, P, False),
    }
    x = torch.randn(4, 100, 36, dtype=dtype, requires_grad=True)  # 14,400 elements: not a whole number of blocks
    wrong = []
    for name, call in calls.items():
        leaf = x.detach().to("cuda").requires_grad_()
        inner = leaf.clone()
        saved = {}

        def pack(t):
            storage = t.untyped_storage()
            if t.device.type == "cuda":
                saved[_torch_api.storage_identity(storage)] = (t.dtype, block_bytes(storage.nbytes()))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            call(inner)
        mine = {_torch_api.storage_identity(t.untyped_storage()) for t in (leaf, inner)}
        real = sorted(v for k, v in saved.items() if k not in mine)
        fake = kept(call, x, card=True, blocks=True)
        if fake != real:
            wrong.append(f"{name}: dry run {fake}, CUDA {real}")
    assert not wrong, "; ".join(wrong)


@needs_cuda
def test_cuda_offload_trains_bitwise_and_holds_what_the_dry_run_counts():
    """`Offload+` on a card: the layers' saved tensors copied to pinned host memory on a stream of their own and
    fetched back ahead of their backward. Gradients bitwise those of the same plans without it; the step peaks lower,
    at the figure a dry run of it for this card counts (the same step on real tensors under the dry run's count: the
    card's storages alone), and nothing waits on the host after the step."""
    from transformers import LlamaConfig

    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    torch.backends.cuda.matmul.allow_tf32 = False
    config = LlamaConfig(num_hidden_layers=8, hidden_size=256, intermediate_size=688, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=1024, max_position_embeddings=2048)  # fmt: skip
    spec = StepSpec(config, batch=2, seq=2048)
    base, offloaded = "Layer+:1:-1,Loss+:1:-1", "Layer+:1:-1,Loss+:1:-1,Offload+:1:-1"
    card = dict(kernels=CudaKernels.here(), cost_device=DEVICES[DEFAULT_DEVICE])
    figures = {}
    for plans in (base, offloaded):
        fake = dry_run(spec, plans=plans, **card)
        real = dry_run(spec, plans=plans, fake=False, device="cuda")
        figures[plans] = (fake.peak_bytes, real.peak_bytes, real.host_peak_bytes)
    (fake_base, real_base, _), (fake_off, real_off, host) = figures[base], figures[offloaded]
    assert real_off < real_base and host > 0, figures
    # the dry run's count for the card, on the card
    assert abs(fake_off - real_off) <= 0.01 * real_off and abs(fake_base - real_base) <= 0.01 * real_base, figures

    def grads(plans):
        from transformers import AutoModelForCausalLM

        import optimum_memopt

        torch.manual_seed(0)
        # eager attention: SDPA's memory-efficient backward on CUDA sums in any order even with deterministic
        # algorithms asked for with warnings only (two plain runs read 1e-10 apart on an H200)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").cuda().train()
        handle = optimum_memopt.optimize_memory(model, plans, reports_steps=True)
        ids = torch.randint(
            0, config.vocab_size, (2, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
        )
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        on_host = handle.levers["offload"].on_host() if "offload" in handle.levers else 0
        return {n: p.grad.clone() for n, p in model.named_parameters()}, on_host

    def apart(a, b):
        return {n: float((a[n] - b[n]).abs().max()) for n in a if not torch.equal(a[n], b[n])}

    # CUDA's embedding backward sums with atomics in any order: deterministic kernels make a plain run one run (the
    # first card run, without them, read every gradient apart); two runs of the same plans are bitwise first
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # cuBLAS: CUBLAS_WORKSPACE_CONFIG=:4096:8 set before
    try:
        (plain, _), (again, _), (ours, left) = grads(base), grads(base), grads(offloaded)
    finally:
        torch.use_deterministic_algorithms(was)
    assert not apart(plain, again), apart(plain, again)
    assert left == 0 and not apart(plain, ours), apart(plain, ours)
