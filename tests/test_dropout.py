"""A dry run's dropout as a CUDA card keeps it (`backends.torch.measure.dropout`): the fused `native_dropout`'s one-byte
mask where the card fuses the call, the noise of the input's dtype (what the CPU keeps) where it does not. Held to CUDA's own
saved tensors by tests/test_gpu_torch.py; here, the rule and a dry run's count."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from optimum_memopt.backends.torch.measure import dropout

pytestmark = pytest.mark.torch_backend

P = 0.1


def kept(call, x, card: bool, blocks: bool = False):
    """What autograd keeps for backward from `call(x)` on fake tensors, run as a card runs it (`card`) or as the CPU
    does: (dtype, bytes) of each storage kept, the input's left out (`blocks`: each in CUDA's 512-byte blocks)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from optimum_memopt.backends.torch import _torch_api
    from optimum_memopt.backends.torch.measure.storages import block_bytes

    saved = {}

    def pack(t):
        nbytes = t.untyped_storage().nbytes()
        saved[_torch_api.storage_identity(t.untyped_storage())] = (t.dtype, block_bytes(nbytes) if blocks else nbytes)
        return t

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(x.detach()).requires_grad_(x.requires_grad)
        leaf = fake.clone() if x.requires_grad else fake  # an in-place call needs a non-leaf
        with dropout.on_cuda(card), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(leaf)
        if out.requires_grad:
            out.sum().backward()  # the backward of each path runs on fake tensors
        mine = {_torch_api.storage_identity(t.untyped_storage()) for t in (fake, leaf)}
    return sorted(v for k, v in saved.items() if k not in mine)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_card_keeps_a_one_byte_mask_where_the_cpu_keeps_the_noise_in_the_inputs_dtype(dtype):
    x = torch.randn(4, 8, 16, dtype=dtype, requires_grad=True)
    n = x.numel()
    module = nn.Dropout(P).train()
    assert kept(module, x, card=True) == [(torch.bool, n)]
    assert kept(module, x, card=False) == [(dtype, n * x.element_size())]
    # what a card does not fuse keeps the same either way: in place (the noise), p of 0 or 1, not training (nothing)
    for call in (
        lambda t: F.dropout(t, P, True, inplace=True),
        lambda t: F.dropout(t, 0.0, True),
        lambda t: F.dropout(t, 1.0, True),
        lambda t: F.dropout(t, P, False),
    ):
        assert kept(call, x, card=True) == kept(call, x, card=False)
    assert kept(lambda t: F.dropout(t, P, True, inplace=True), x, card=True) == [(dtype, n * x.element_size())]
    assert F.dropout is not None and not isinstance(F.dropout, dropout._OnCuda)  # given back


def test_a_lora_dry_run_for_a_card_counts_its_masks_as_the_card_keeps_them():
    """LoRA's dropout on q and v (fp32 adapters, as PEFT makes them): a dry run for a card counts each mask kept at
    one byte an element, the CPU's at four (its noise); without dropout both count the same but the card's attention
    random state. The first layer keeps no
    mask (its input, the frozen embeddings' output, needs no gradient: only the adapters' weights do), so at the
    step's peak (the head, every layer's forward done) the masks of the layers after it are held: 3 bytes an element
    apart."""
    from transformers import LlamaConfig

    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.dry_run import StepSpec, dry_run

    layers, hidden, batch, seq = 3, 64, 2, 128
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=hidden, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=256,
    )  # fmt: skip
    peaks = {}
    for card in (None, CudaKernels((9, 0))):
        for p in (0.0, P):
            lora = {"r": 4, "lora_alpha": 8, "lora_dropout": p, "target_modules": ["q_proj", "v_proj"]}
            result = dry_run(StepSpec(config, batch=batch, seq=seq, lora=lora), backend=False, kernels=card)
            assert result.peak_at == "step 1, the head and loss", result.peak_at
            peaks[card is not None, p] = result.peak_bytes
    rng = layers * 2 * 512  # the card's attention kernel keeps its random state: two 512-byte blocks a layer
    assert peaks[True, 0.0] - peaks[False, 0.0] == rng, peaks
    masks = (layers - 1) * 2 * batch * seq * hidden  # elements: two adapters a layer after the first
    assert peaks[False, P] - (peaks[True, P] - rng) == masks * (4 - 1), peaks
