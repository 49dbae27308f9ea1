"""A dry run's attention as a CUDA card runs it (`backends.torch.measure.attention`): the kernel torch 2.11 takes for each kind of
input, and what each keeps for backward when the fake step runs it. Held to torch's own choice and to CUDA's tensors
on a GPU by tests/test_gpu_torch.py; here, the rules and the tensors as the composite op prepares them."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from optimum_memopt.backends.torch.measure.attention import CUDNN, EFFICIENT, FLASH, MATH, CudaKernels, choose, on_cuda

pytestmark = pytest.mark.torch_backend

H100, A100, L40S = CudaKernels((9, 0)), CudaKernels((8, 0)), CudaKernels((8, 9))
H100_DETERMINISTIC = CudaKernels((9, 0), deterministic=True)  # `use_deterministic_algorithms(True)`, not warn-only


def qkv(dtype=torch.float32, heads=(4, 4), d=16, q_len=8, k_len=8, grad=True, batch=2):
    hq, hk = heads
    make = lambda h, n: torch.randn(batch, h, n, d, dtype=dtype, requires_grad=grad)  # noqa: E731
    return make(hq, q_len), make(hk, k_len), make(hk, k_len)


MASK = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril()


@pytest.mark.parametrize(
    "kernels, inputs, kw, kernel",
    [
        # fp32: never flash or cuDNN; memory-efficient where the heads are as many, the math path where grouped
        (H100, qkv(), {}, EFFICIENT),
        (H100, qkv(heads=(4, 2)), {"enable_gqa": True}, MATH),
        (A100, qkv(heads=(4, 2)), {"enable_gqa": True}, MATH),
        # bf16 without a mask: cuDNN first on Hopper (torch 2.11, its wheel's cuDNN), flash elsewhere and where
        # deterministic algorithms are on; grouped heads taken by both
        (H100, qkv(torch.bfloat16), {"is_causal": True}, CUDNN),
        (H100_DETERMINISTIC, qkv(torch.bfloat16), {"is_causal": True}, FLASH),
        (A100, qkv(torch.bfloat16, heads=(4, 2)), {"is_causal": True, "enable_gqa": True}, FLASH),
        (H100_DETERMINISTIC, qkv(torch.bfloat16, heads=(4, 2)), {"enable_gqa": True}, FLASH),
        # a mask: flash never takes one
        (A100, qkv(torch.bfloat16), {"attn_mask": MASK}, EFFICIENT),
        (H100, qkv(torch.bfloat16), {"attn_mask": MASK}, CUDNN),
        (A100, qkv(torch.bfloat16, heads=(4, 2)), {"attn_mask": MASK, "enable_gqa": True}, MATH),
        # head dimensions: flash to 256 (Ada's backward: not from 193 to 224), memory-efficient any multiple of 8
        (A100, qkv(torch.bfloat16, d=256), {}, FLASH),
        (L40S, qkv(torch.bfloat16, d=224), {}, EFFICIENT),
        (L40S, qkv(torch.bfloat16, d=224, grad=False), {}, FLASH),
        (L40S, qkv(torch.bfloat16, d=256), {}, FLASH),
        (L40S, qkv(torch.bfloat16, d=256), {"dropout_p": 0.1}, EFFICIENT),
        (A100, qkv(torch.bfloat16, d=288), {}, EFFICIENT),
        (A100, qkv(torch.bfloat16, d=20), {}, FLASH),  # padded to 24
        (A100, qkv(torch.float32, d=18), {}, MATH),  # not a multiple of 4: memory-efficient refuses it in fp32
        # causal over fewer queries than keys: not flash
        (A100, qkv(torch.bfloat16, q_len=4), {"is_causal": True}, EFFICIENT),
    ],
)
def test_the_kernel_each_card_takes(kernels, inputs, kw, kernel):
    assert choose(kernels, *inputs, **kw) == kernel


def test_a_kernel_turned_off_is_not_taken():
    off = CudaKernels((8, 0), enabled=frozenset({EFFICIENT, MATH}))
    assert choose(off, *qkv(torch.bfloat16)) == EFFICIENT
    assert choose(CudaKernels((8, 0), enabled=frozenset({MATH})), *qkv(torch.bfloat16)) == MATH


def kept(kernels, inputs, blocks=False, **kw):
    """The bytes autograd keeps for backward from one attention call on fake tensors run as `kernels`' card runs it
    (each storage once, the inputs' left out; `blocks`: each in CUDA's 512-byte blocks, as a dry run counts), and the
    kernels it ran."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.measure.storages import block_bytes

    saved = {}

    def pack(t):
        nbytes = t.untyped_storage().nbytes()
        saved[_torch_api.storage_identity(t.untyped_storage())] = block_bytes(nbytes) if blocks else nbytes
        return t

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        q, k, v = (mode.from_tensor(t.detach()).requires_grad_(t.requires_grad) for t in inputs)
        mask = kw.pop("attn_mask", None)
        mask = mode.from_tensor(mask) if mask is not None else None
        with on_cuda(kernels) as ran, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kw)
        out.sum().backward()  # every kernel's backward runs on fake tensors
        mine = {_torch_api.storage_identity(t.untyped_storage()) for t in (q, k, v)}
    return sum(n for key, n in saved.items() if key not in mine), ran.ran


def test_each_kernel_keeps_what_it_keeps_on_cuda():
    b, h, n, d = 2, 4, 8, 16
    # the math path keeps the probabilities (fp32 here) and, with grouped heads, the keys and values repeated
    nbytes, ran = kept(H100, qkv(heads=(4, 2)), enable_gqa=True)
    assert ran == {MATH: 1}
    probabilities, repeated = b * h * n * n * 4, 2 * b * h * n * d * 4
    assert nbytes >= probabilities + repeated, nbytes
    # memory-efficient: its output and log-sum-exp (padded to 32 queries); its random state is on the host, with
    # dropout or without
    nbytes, ran = kept(H100, qkv())
    assert ran == {EFFICIENT: 1} and nbytes == b * h * n * d * 4 + b * h * 32 * 4, nbytes
    nbytes, ran = kept(H100, qkv(), dropout_p=0.1)
    assert ran == {EFFICIENT: 1} and nbytes == b * h * n * d * 4 + b * h * 32 * 4, nbytes
    # cuDNN's (Hopper, bf16): its output and log-sum-exp, its seed and offset on the card (8 bytes each)
    nbytes, ran = kept(H100, qkv(torch.bfloat16))
    assert ran == {CUDNN: 1} and nbytes == b * h * n * d * 2 + b * h * n * 4 + 2 * 8, nbytes
    # flash, without dropout too: its output, log-sum-exp and random state (two 8-byte words, and one beside them)
    nbytes, ran = kept(H100_DETERMINISTIC, qkv(torch.bfloat16))
    assert ran == {FLASH: 1} and nbytes == b * h * n * d * 2 + b * h * n * 4 + 2 * 8 + 8, nbytes
    # flash on a head dimension of 20: the inputs padded to 24 are what it keeps, with its output
    nbytes, ran = kept(A100, qkv(torch.bfloat16, d=20))
    assert ran == {FLASH: 1} and nbytes == 4 * b * h * n * 24 * 2 + b * h * n * 4 + 2 * 8 + 8, nbytes
    # memory-efficient with a boolean mask: the mask made a float bias of the query's dtype, kept
    nbytes, ran = kept(A100, qkv(torch.bfloat16), attn_mask=MASK)
    assert ran == {EFFICIENT: 1} and nbytes >= b * n * n * 2 + b * h * n * d * 2, nbytes


def test_a_dry_run_for_a_card_runs_its_attention():
    """An fp32 step of a decoder with grouped-query attention on a card takes the math path, which keeps each
    layer's probabilities: the dry run for the card counts them, where the CPU's flash kernel keeps none; in bf16
    both keep the same but for the card's seed and offset (two 512-byte blocks a layer)."""
    from transformers import LlamaConfig

    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, max_position_embeddings=256,
    )  # fmt: skip
    b, s = 2, 128
    spec = StepSpec(config, batch=b, seq=s, dtype="float32")
    cpu, card = dry_run(spec, backend=False), dry_run(spec, backend=False, kernels=H100)
    assert cpu.attention is None and card.attention == {MATH: 2}
    assert card.peak_bytes - cpu.peak_bytes >= b * 4 * s * s * 4, (cpu.peak_bytes, card.peak_bytes)
    spec = StepSpec(config, batch=b, seq=s, dtype="bfloat16")
    cpu, card = dry_run(spec, backend=False), dry_run(spec, backend=False, kernels=H100_DETERMINISTIC)
    assert card.attention == {FLASH: 2} and card.peak_bytes - cpu.peak_bytes == 2 * 1024, (
        cpu.peak_bytes,
        card.peak_bytes,
    )
    with pytest.raises(ValueError, match="`kernels` is for fake ones"):
        dry_run(spec, backend=False, fake=False, kernels=H100)


def _registry_raising_on_attention(monkeypatch):
    """torch's own FLOP counter for attention as torch 2.11 and 2.12 have it: it asserts that the keys have as many
    heads as the queries, so it raises on grouped-query attention."""
    from torch.utils import flop_counter

    from optimum_memopt.backends.torch.measure.op_costs import ATTENTION_FLOPS

    def raising(*args, **kwargs):
        raise AssertionError("the keys' heads are not the queries'")

    for name in ATTENTION_FLOPS:
        monkeypatch.setitem(flop_counter.flop_registry, getattr(torch.ops.aten, name), raising)


@pytest.mark.parametrize("torch_counter", ["as installed", "raising on grouped heads"])
def test_attention_is_priced_by_its_shapes_grouped_heads_too(monkeypatch, torch_counter):
    """Each attention kernel's FLOPs, forward and backward, with fewer key/value heads than queries: the package's own
    formula, whatever torch's counter does with the heads (an H200 with torch 2.11 priced attention as free)."""
    from optimum_memopt.backends.torch.measure.op_costs import ATTENTION_FLOPS, _flops

    if torch_counter != "as installed":
        _registry_raising_on_attention(monkeypatch)
    b, hq, hk, s_q, s_k, d = 2, 8, 2, 48, 64, 16
    q = torch.empty(b, hq, s_q, d, device="meta")
    k = torch.empty(b, hk, s_k, d, device="meta")
    for name, (_, at) in ATTENTION_FLOPS.items():
        args = (q, k, k) if at == 0 else (torch.empty(b, hq, s_q, d, device="meta"), q, k, k)
        factor = 10 if name.endswith("_backward") else 4
        assert _flops(getattr(torch.ops.aten, name).default, args, {}, None) == factor * b * hq * s_q * s_k * d, name


def test_a_dry_run_for_a_card_prices_grouped_query_attention(monkeypatch):
    """A bf16 step of a decoder with grouped-query attention, priced on the H100's roofline by a dry run for the card:
    its attention's FLOPs are in the step's seconds (the solver's recompute costs are these prices), the same where
    torch's counter raises on grouped heads, as 2.11's does."""
    from transformers import LlamaConfig

    from optimum_memopt.planning.devices import DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    layers, heads, d, b, s = 2, 4, 16, 2, 1024
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=heads * d, intermediate_size=128, num_attention_heads=heads,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=s,
    )  # fmt: skip
    spec = StepSpec(config, batch=b, seq=s, dtype="bfloat16", autocast="bfloat16")
    h100 = DEVICES["H100-80GB"]
    priced = dry_run(spec, backend=False, kernels=H100, cost_device=h100)
    attention_s = layers * (4 + 10) * b * heads * s * s * d / h100.flops_low  # forward and backward, each layer
    assert priced.step_seconds > attention_s, (priced.step_seconds, attention_s)
    _registry_raising_on_attention(monkeypatch)
    again = dry_run(spec, backend=False, kernels=H100, cost_device=h100)
    assert again.step_seconds == pytest.approx(priced.step_seconds, rel=1e-9)


def test_a_query_of_metadata_and_an_unsaid_view_cost_nothing(monkeypatch):
    """An op that answers with a tensor's metadata (`prim.device`, which a dry run's `F.linear` dispatches) moves none
    of its bytes, nor does `_unsafe_view` (a view its schema does not call one): a dry run priced each by its
    tensor's bytes, 1.7 s of an 8B LoRA step's 7.4 s at 65,536 tokens. In a real dry run, neither is priced."""
    from transformers import LlamaConfig

    from optimum_memopt.backends.torch import _torch_api, fake_step
    from optimum_memopt.backends.torch.measure import op_costs
    from optimum_memopt.planning.devices import DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, instruments

    t = torch.empty(64, 64)
    assert op_costs.op_cost(torch.ops.prim.device.default, (t,), {}, t.device) is None
    assert op_costs.op_cost(torch.ops.aten._unsafe_view.default, (t, [4096]), {}, t.view(4096)) is None
    assert op_costs.op_cost(torch.ops.aten.mm.default, (t, t), {}, t @ t) == (2 * 64**3, 3 * 64 * 64 * 4, False)
    priced: dict = {}

    def clock_for(device):
        def clock(func, args, kwargs, out):
            name = _torch_api.op_name(func)
            seconds = op_costs.clock_for(device)(func, args, kwargs, out)
            priced[name] = priced.get(name, 0.0) + seconds
            return seconds

        return clock

    monkeypatch.setattr(fake_step, "clock_for", clock_for)
    config = LlamaConfig(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=256, max_position_embeddings=128,
    )  # fmt: skip
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.05, target_modules=["q_proj", "v_proj"])
    spec = StepSpec(config, batch=1, seq=128, dtype="bfloat16", autocast="bfloat16", lora=lora)
    fake_step.run(spec, instruments(DEVICES["H200"]), "", kernels=H100)
    # a query of metadata never reaches the clock (the dry run's modes hand it straight on); the view is seen, free
    assert priced.get("device", 0.0) == 0.0 and priced["_unsafe_view"] == 0.0, priced
    assert priced["mm"] > 0 and priced["_scaled_dot_product_cudnn_attention"] > 0, priced


def attention_cases():
    """Inputs of every kind a kernel's rules tell apart: dtype, grouped heads, head dimension (20 flash pads, 256 its
    most), a boolean mask, causal over as many or fewer queries than keys, dropout."""
    cases = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for heads in ((4, 4), (4, 2)):
            for d in (64, 20, 256):
                for mask, causal, q_len in (
                    (False, False, 32),
                    (True, False, 32),
                    (False, True, 32),
                    (False, True, 16),
                ):
                    for dropout in (0.0, 0.1):
                        cases.append((dtype, heads, d, mask, causal, q_len, dropout))
    return cases


def case_name(case) -> str:
    dtype, (hq, hk), d, mask, causal, q_len, dropout = case
    return (
        f"{str(dtype)[6:]} {hq}/{hk} heads d{d}{' mask' if mask else ''}{' causal' if causal else ''}"
        f"{' q' + str(q_len) if q_len != 32 else ''}{' dropout' if dropout else ''}"
    )


def attention_inputs(case, device):
    dtype, (hq, hk), d, mask, causal, q_len, dropout = case
    generator = torch.Generator().manual_seed(0)
    make = lambda h, n: torch.randn(2, h, n, d, generator=generator).to(device, dtype).requires_grad_()  # noqa: E731
    q, k, v = make(hq, q_len), make(hk, 32), make(hk, 32)
    attn_mask = torch.ones(2, 1, q_len, 32, dtype=torch.bool).tril().to(device) if mask else None
    return (q, k, v), dict(attn_mask=attn_mask, dropout_p=dropout, is_causal=causal, enable_gqa=hq != hk)


H100_FIGURES = os.path.join(os.path.dirname(__file__), "data", "cuda_attention_kept_h100.json")


@pytest.mark.parametrize("setting", ["default", "deterministic"])
def test_every_kind_of_input_keeps_what_an_h100_kept(setting):
    """The dry run's kernel and kept bytes for every kind of input are what an H100 took and kept (torch 2.11, cuDNN
    9.19): the flash and cuDNN kernels' random state on the card, memory-efficient attention's on the host, the math
    path's dropout mask one byte an element."""
    with open(H100_FIGURES, encoding="utf-8") as f:
        card = json.load(f)["cases"][setting]
    kernels = CudaKernels((9, 0), deterministic=setting == "deterministic", cudnn_version=91900)
    wrong = []
    for case in attention_cases():
        (q, k, v), kw = attention_inputs(case, "cpu")
        nbytes, ran = kept(kernels, (q, k, v), blocks=True, **kw)
        want = card[case_name(case)]
        if (nbytes, "/".join(ran)) != (want["bytes"], want["kernel"]):
            wrong.append(f"{case_name(case)}: dry run {'/'.join(ran)} {nbytes}, H100 {want['kernel']} {want['bytes']}")
    assert not wrong, f"{len(wrong)} of {len(card)} apart: " + "; ".join(wrong)


def _saved_bytes(run, inputs):
    from optimum_memopt.backends.torch import _torch_api

    saved = {}

    def pack(t):
        saved[_torch_api.storage_identity(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    mine = {_torch_api.storage_identity(t.untyped_storage()) for t in inputs}
    return out, sum(n for key, n in saved.items() if key not in mine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_math_paths_dropout_is_atens_on_the_cpu(dtype):
    """`math_path` with the CPU's dropout is torch's math path on the CPU: the same values and gradients to the bit
    and the same tensors kept, over grouped heads, a mask, causal over as many or fewer queries; with the card's
    dropout it keeps one byte an element of the probabilities where the CPU keeps their fp32 noise."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from optimum_memopt.backends.torch.measure.attention import card_dropout, cpu_dropout, math_path

    for heads in ((4, 4), (4, 2)):
        for mask, causal, q_len in ((False, False, 32), (True, False, 32), (False, True, 32), (False, True, 16)):
            case = (dtype, heads, 20, mask, causal, q_len, 0.1)
            (q, k, v), kw = attention_inputs(case, "cpu")
            scale = 1 / 20**0.5
            torch.manual_seed(1)
            with sdpa_kernel(SDPBackend.MATH):
                theirs, kept_theirs = _saved_bytes(
                    lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, **kw), (q, k, v)
                )
            grads_theirs = torch.autograd.grad(theirs.sum(), (q, k, v))
            torch.manual_seed(1)
            args = (q, k, v, kw["attn_mask"], 0.1, causal, scale, kw["enable_gqa"])
            mine, kept_mine = _saved_bytes(lambda: math_path(*args, cpu_dropout), (q, k, v))
            grads_mine = torch.autograd.grad(mine.sum(), (q, k, v))
            assert torch.equal(mine, theirs) and all(map(torch.equal, grads_mine, grads_theirs)), case_name(case)
            assert kept_mine == kept_theirs, (case_name(case), kept_mine, kept_theirs)
            _, kept_card = _saved_bytes(lambda: math_path(*args, card_dropout), (q, k, v))
            probabilities = 2 * heads[0] * q_len * 32
            assert kept_theirs - kept_card == probabilities * (4 - 1), (case_name(case), kept_theirs, kept_card)
