"""The offload lever (`Offload+`, `backends/torch/levers/offload/`) on the CPU, where the host is the device: the copies
out and back are made as on a card (the streams none), so what is kept where and when, and the gradients, are the
card's path."""

import gc

import pytest
import torch
from test_mlp import VOCAB, model_of, run, same_training
from torch_engine import pair

import optimum_memopt
from optimum_memopt.backends.torch.levers import offload
from optimum_memopt.plans import LeverOption, LeverPart, PlanError, parse_inline

pytestmark = pytest.mark.torch_backend


def _same_bitwise(plain, ours):
    (pl, pg, *_), (ol, og, *_) = plain, ours
    assert all(torch.equal(a, b) for a, b in zip(pl, ol)), (pl, ol)
    assert pg.keys() == og.keys() and all(torch.equal(pg[n], og[n]) for n in pg), [
        n for n in pg if not torch.equal(pg[n], og[n])
    ]


@pytest.mark.parametrize(
    "plans, bitwise",
    [
        ("Offload+:1:-1", True),  # every layer, the next fetched ahead
        ("Offload+:1:-1@1:ahead2", True),
        ("silu+:1:-1,Offload+:1:-1", True),  # a layer recomputing an op: what the engine keeps as is goes to the host
        ("Layer+:1:-1,Offload+:1:-1", True),  # a layer recomputed whole: its input waits on the host
        # beside the other levers, which sum the head's and the MLP weights' gradients chunk by chunk (to rounding)
        ("Layer+:1:-1@0,Offload+:1:-1@1,MLP+:1:-1@1:tiles2,Loss+:1:-1", False),
    ],
)
def test_offloaded_layers_train_as_the_plain_model_dropout_included(plans, bitwise):
    plain = run("llama", None, attention_dropout=0.1)
    ours = run("llama", plans, attention_dropout=0.1)
    _same_bitwise(plain, ours) if bitwise else same_training(plain, ours, exact_first=False)
    lever = ours[3].levers["offload"]
    assert lever.mover.moved_bytes and all(b > 0 for b in lever.mover.moved_bytes.values())
    assert lever.on_host() == 0  # the steps' graphs let go of: nothing waits on the host


def test_a_layers_saved_storages_wait_on_the_host_between_its_forward_and_its_backward():
    model = model_of("llama")
    model.train()
    handle = optimum_memopt.optimize_memory(model, "Offload+:1:-1@0", reports_steps=True)
    lever = handle.levers["offload"]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    moved = lever.mover.moved_bytes
    assert list(moved) == [0] and lever.on_host() == moved[0] > 0  # layer 0's, each storage once
    copies = list(lever.mover._copies[0])
    # the device's storage let go of once copied, unless something else holds it (the layer's input, its output)
    gone = sum(c.host.numel() for c in copies if c.source() is None)
    assert gone > moved[0] / 2, (gone, moved)
    assert all(c.fetched is None for c in copies)  # none back before backward nears the layer
    del copies
    loss.backward()
    del loss
    gc.collect()
    assert lever.on_host() == 0
    handle.remove()


def test_backward_fetches_a_layer_as_it_reaches_the_one_ahead_of_it():
    model = model_of("llama", num_hidden_layers=3)
    model.train()
    handle = optimum_memopt.optimize_memory(model, "Offload+:1:-1", reports_steps=True)
    lever = handle.levers["offload"]
    order = []
    fetch = offload.Mover.fetch

    def seen(mover, copy):
        if copy.fetched is None:
            order.append(next(i for i, copies in mover._copies.items() if copy in copies))
        return fetch(mover, copy)

    lever.mover = None  # made again at the next forward, its fetch watched
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    lever.mover.fetch = seen.__get__(lever.mover)
    loss.backward()
    # reaching layer 2 fetches layers 2 and 1 (one ahead), reaching layer 1 fetches layer 0
    first_of = [order.index(i) for i in (2, 1, 0)]
    assert first_of == sorted(first_of), order
    handle.remove()


def test_a_tensor_changed_in_place_after_it_was_saved_is_refused_at_backward_as_autograd_refuses_it():
    def changes_its_input(block, x):
        y = x @ block.w  # keeps x for the weight's gradient
        x.mul_(2)  # then changes it
        return y

    plain, ours = pair(changes_its_input)
    x = torch.randn(4, 8, requires_grad=True)
    h = x * 1  # held here through backward: the change is seen (saved-tensor hooks turn autograd's own check off)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain(h).sum().backward()
    handle = optimum_memopt.optimize_memory(ours, "Offload+:1:-1", reports_steps=True)
    ours.train()
    h = x * 1
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a tensor of \(4, 8\) saved in a layer"):
        ours(h).sum().backward()
    handle.remove()


def test_the_lever_comes_off_whole():
    model = model_of("llama")
    hooks = [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in model.model.layers]
    handle = optimum_memopt.optimize_memory(model, "Offload+:1:-1", reports_steps=True)
    assert [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in model.model.layers] != hooks
    handle.remove()
    assert [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in model.model.layers] == hooks


def test_a_layer_recomputed_whole_offloads_its_input_alone():
    model = model_of("llama")
    model.train()
    handle = optimum_memopt.optimize_memory(model, "Layer+:1:-1,Offload+:1:-1", reports_steps=True)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    hidden = 2 * 16 * model.config.hidden_size * 4  # each layer's input: the hidden states, fp32
    assert handle.levers["offload"].mover.moved_bytes == {0: hidden, 1: hidden}
    handle.remove()


def test_its_plans_read_as_data():
    entry = parse_inline("offload+:1:-1@0-3:Ahead2")[0]
    assert str(entry) == "Offload+:1:-1@0-3:ahead2"
    option = offload.SYNTAX.option(entry, 8)
    assert option == LeverOption((LeverPart((0, 1, 2, 3), "ahead", 2),))
    assert offload.layers_of(option, 8) == {0: 2, 1: 2, 2: 2, 3: 2}
    assert offload.layers_of(LeverOption(), 2) == {0: 1, 1: 1}  # every layer, one ahead
    with pytest.raises(PlanError, match=r"prefetch 'tiles2'; expected 'aheadN'"):
        parse_inline("Offload+:1:-1@tiles2")
