"""Mixtures of experts under the torch backend: Qwen3-MoE, Mixtral, gpt-oss, DeepSeek-V3 and OLMoE at tiny size,
their routers' aux loss on. Under level 1, whole layers and op plans that name the router's ops, the routing is never
recomputed (the router's `topk` runs in no backward, where transformers' own checkpointing runs it again) and every
run trains bitwise as the run without the plugin; the aux loss keeps its gradient, with the head and loss in chunks
too; the plan table says the routing is kept; `auto` chooses within its budget through the Trainer.

On a machine with CUDA (the GPU kit, `scripts/gpu_check.sh`, runs this file there) the same tests run on the GPU, with
deterministic kernels (so that a plain run is one run), and the routing test in bf16 too: where a recomputed router
can flip near-tie tokens (transformers #47467), the routing is kept."""

import functools

import pytest
import torch
from helpers import LossRecordingTrainer, make_args
from torch.utils._python_dispatch import TorchDispatchMode

import optimum_memopt

pytestmark = pytest.mark.torch_backend

VOCAB = 128
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
ARCHS = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "olmoe"]
SMALL = dict(
    num_hidden_layers=2, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_attention_heads=2,
    num_key_value_heads=1, head_dim=16, vocab_size=VOCAB, max_position_embeddings=64, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=0, n_group=1, topk_group=1,
    kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
)  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def deterministic():
    """On CUDA, kernels that give one result (index_add's atomics otherwise sum in any order): a plain run is one run
    and "bitwise" means something. The CPU's kernels are."""
    if DEVICE == "cpu":
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # cuBLAS: CUBLAS_WORKSPACE_CONFIG (the kit sets it)
    yield
    torch.use_deterministic_algorithms(was)


def moe(arch: str, coef: float = 0.5, seed: int = 0, dtype=torch.float32, **size):
    """The family's default config, shrunk (each field the family has), its aux loss on and weighted up to count;
    on `DEVICE`, in `dtype`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch)
    for key, value in {**SMALL, **size, "output_router_logits": True, "router_aux_loss_coef": coef}.items():
        if hasattr(config, key):
            setattr(config, key, value)
    if hasattr(config, "qk_rope_head_dim"):  # DeepSeek's rotary part of each head
        config.head_dim = config.qk_rope_head_dim
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(DEVICE, dtype)


class Ops(TorchDispatchMode):
    """How many times each aten op ran (by its overload packet's name)."""

    def __init__(self):
        super().__init__()
        self.ran = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ran[name] = self.ran.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def train(model, steps=3, plans=None, level=0, checkpointing=False, chunks=None):
    """Each step's loss, the router weights' last gradients, and how often `topk` ran in each backward."""
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    handle = None
    if plans or level:
        handle = optimum_memopt.optimize_memory(model, plans, level=level, say=lambda text: None)
    lever = None
    if chunks is not None:
        from optimum_memopt.backends.torch.levers.loss import ChunkedLoss, Chunking, causal_lm

        lever = ChunkedLoss(causal_lm(model), Chunking(chunks=chunks), say=lambda text: None)
        lever.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, topk, grads = [], [], {}
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step)).to(DEVICE)
        out = model(input_ids=ids, labels=ids)
        ops = Ops()
        with ops:  # the mode goes with autograd's state to the thread that runs backward (CUDA's device thread too)
            out.loss.backward()
        topk.append(ops.ran.get("topk", 0))
        losses.append(out.loss.detach().clone())
        grads = {
            n: p.grad.clone()
            for n, p in model.named_parameters()
            if p.grad is not None and ("gate" in n or "router" in n or "lora_" in n)
        }
        opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.step_done()
    report = handle.report() if handle is not None else None
    if handle is not None:
        handle.remove()
    if lever is not None:
        lever.remove()
    return losses, grads, topk, report


MODES = {
    "level 1": dict(level=1),
    "whole layers": dict(plans="Layer+:1:-1"),
    "the router's ops planned": dict(plans="MatMul+:1:-1,TopK+:1:-1,Softmax+:1:-1"),
}


@pytest.fixture(
    scope="module", params=[(a, d) for d in DTYPES for a in ARCHS], ids=lambda p: f"{p[0]}-{str(p[1])[6:]}"
)
def plain(request):
    arch, dtype = request.param
    losses, grads, topk, _ = train(moe(arch, dtype=dtype))
    assert grads and all(g.abs().sum() > 0 for g in grads.values()), arch  # the routers learn
    again, again_grads, _, _ = train(moe(arch, dtype=dtype))  # one run on this device: bitwise is a fair ask
    assert all(torch.equal(a, b) for a, b in zip(losses, again)), (arch, dtype, losses, again)
    return arch, dtype, losses, grads


@pytest.mark.parametrize("mode", list(MODES))
def test_routing_is_never_recomputed_and_the_run_is_bitwise_the_plain_one(plain, mode):
    arch, dtype, losses, grads = plain
    ran, ran_grads, topk, _ = train(moe(arch, dtype=dtype), **MODES[mode])
    assert topk == [0, 0, 0], (arch, mode, topk)
    assert all(torch.equal(a, b) for a, b in zip(losses, ran)), (arch, mode, losses, ran)
    assert all(torch.equal(grads[n], ran_grads[n]) for n in grads), (arch, mode)


def test_transformers_own_checkpointing_runs_the_router_again():
    """The count that says the routing is not recomputed sees it where it is."""
    *_, topk, _ = train(moe("qwen3_moe"), checkpointing=True)
    assert all(n > 0 for n in topk), topk


def test_the_aux_loss_keeps_its_gradient_with_the_head_in_chunks():
    losses, grads, _, _ = train(moe("qwen3_moe"), level=1)
    chunked, chunked_grads, _, _ = train(moe("qwen3_moe"), level=1, chunks=3)
    for a, b in zip(losses, chunked):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    for n in grads:
        torch.testing.assert_close(chunked_grads[n], grads[n], rtol=0, atol=1e-6)
    _, without_aux, _, _ = train(moe("qwen3_moe", coef=0.0), level=1, chunks=3)
    assert any(not torch.allclose(without_aux[n], grads[n]) for n in grads)  # the aux loss is in those gradients


def test_the_table_says_the_routing_is_kept():
    *_, report = train(moe("qwen3_moe"), steps=1, plans="MatMul+:1:-1,TopK+:1:-1,Softmax+:1:-1")
    (note,) = [n for n in report.notes if "routing is kept" in n]
    assert "in 2 layer(s)" in note and "topk" in note and "Softmax" in note, note
    *_, dense = train(moe("qwen3_moe"), steps=1, plans="MatMul+:1:-1")  # the same model: the note is the routing's
    assert any("routing is kept" in n for n in dense.notes)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("arch", ARCHS)
def test_a_dry_run_counts_what_the_real_step_counts(arch, dtype):
    """On fake tensors (fp32 experts through transformers' fallback kernel: torch's fake rule for `grouped_mm` takes
    bf16 only) the step's peak is the real step's count on `DEVICE`, eager and level 1; on CUDA with the card's
    attention kernels (`backends.torch.measure.attention`: in fp32 the math path with grouped heads, memory-efficient attention
    without, where the CPU's flash kernel kept 31 KiB less and 13 KiB more on an H200)."""
    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    kernels = CudaKernels.here() if DEVICE == "cuda" else None
    spec = StepSpec(moe(arch).config, batch=4, seq=16, dtype=str(dtype)[6:])
    for kw in (dict(backend=False), dict(level=1)):
        fake, real = dry_run(spec, kernels=kernels, **kw), dry_run(spec, fake=False, device=DEVICE, **kw)
        assert abs(fake.peak_bytes - real.peak_bytes) <= 0.01 * real.peak_bytes, (
            arch,
            kw,
            fake.peak_bytes,
            real.peak_bytes,
        )


@pytest.mark.slow
def test_auto_chooses_within_its_budget_through_the_trainer(tmp_path):
    """Qwen3-MoE through the Trainer, `auto` under a budget halfway between its eager peak and the least any recompute
    reaches: a choice that fits, every check within the budget, and the plain run's losses (its plans are exact; its
    head's chunks sum the loss in another order)."""

    def run(name, *flags):
        args = make_args(tmp_path / name, "--max_steps", "4", *flags)
        model = moe(
            "qwen3_moe", hidden_size=64, moe_intermediate_size=64, num_attention_heads=4, max_position_embeddings=128
        )
        trainer = LossRecordingTrainer(model=model, args=args, train_dataset=Tokens(seq=96))
        trainer.train()
        return trainer

    auto = ("--memory_opt_backend", "torch", "--memory_opt_config", "auto", "--memory_budget_mb")
    plain = run("plain", "--memory_opt_backend", "none")
    roomy = run("roomy", *auto, "1000000").memopt_handle.planner
    eager, floor = roomy.verified[0]["measured_peak_mb"], roomy.fits[0].floor.peak_mb
    assert floor < eager, (floor, eager)
    budget = round((eager + floor) / 2, 2)
    tight = run("tight", *auto, str(budget))
    planner = tight.memopt_handle.planner
    assert planner.fits[-1].choice is not None and planner.fits[-1].predicted.peak_mb <= budget
    assert planner.verified and all(c["measured_peak_mb"] <= budget for c in planner.verified), planner.verified
    for check in planner.verified:  # each within its prediction: what the selective checkpoint keeps is counted
        assert check["measured_peak_mb"] <= check["predicted_peak_mb"] * 1.01 + 0.1, planner.verified
    # the layers' recompute is exact; step one runs the head in chunks, and the choice may too: a sum in another order
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(tight.losses, plain.losses)), (tight.losses, plain.losses)


class Tokens(torch.utils.data.Dataset):
    def __init__(self, seq: int = 16):
        self.seq = seq

    def __len__(self):
        return 32

    def __getitem__(self, i):
        ids = torch.randint(0, VOCAB, (self.seq,), generator=torch.Generator().manual_seed(100 + i))
        return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.parametrize("mode", ["level 1", "the router's ops planned"])
def test_a_lora_on_the_experts_parameters_trains_bitwise(mode):
    """PEFT's LoRA on the experts' parameters (`target_parameters`: the delta added to each expert's weight in every
    forward, and in every recompute) beside a LoRA on the attention: bitwise as without the plugin."""
    peft = pytest.importorskip("peft")

    def lora():
        adapter = peft.LoraConfig(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
        )  # fmt: skip
        return peft.get_peft_model(moe("qwen3_moe"), adapter)

    losses, grads, _, _ = train(lora())
    ran, ran_grads, topk, _ = train(lora(), **MODES[mode])
    assert topk == [0, 0, 0] and any("experts" in n for n in grads), sorted(grads)
    assert all(torch.equal(a, b) for a, b in zip(losses, ran)), (losses, ran)
    assert all(torch.equal(grads[n], ran_grads[n]) for n in grads)


def test_an_aux_loss_without_its_gradient_stops_step_one_with_the_reason():
    """Asserted in the measured step: where something runs the routers without autograd (as reentrant checkpointing
    runs a layer's forward under `no_grad`: here the routers themselves), the aux loss would train nothing, silently;
    the step stops, saying so. Under the backend's own plans the check passes (every test above)."""
    model = moe("qwen3_moe")
    for layer in model.model.layers:
        gate = layer.mlp.gate
        gate.forward = functools.partial(lambda forward, *a, **k: _without_grad(forward, *a, **k), gate.forward)
    handle = optimum_memopt.optimize_memory(model, None, level=1, say=lambda text: None)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with pytest.raises(RuntimeError, match=r"the routers' aux loss of Qwen3MoeForCausalLM \(`router_aux_loss_coef="
                                           r"0.5`\) carries no gradient in this training step"):  # fmt: skip
        model(input_ids=ids, labels=ids)
    handle.remove()


def _without_grad(forward, *args, **kwargs):
    with torch.no_grad():
        return forward(*args, **kwargs)
