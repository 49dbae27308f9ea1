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


def test_the_last_layers_offloaded_are_fetched_as_backward_reaches_the_layer_ahead_not_as_their_own_asks():
    """Reaching a layer that is not offloaded but is `ahead` of one that is fetches that one's tensors: without it the
    last layer offloaded came back only as its own backward unpacked them (a copy waited for on a card, and held a
    layer later than the figures said)."""
    model = model_of("llama", num_hidden_layers=3)
    model.train()
    handle = optimum_memopt.optimize_memory(model, "Offload+:1:-1@0-1", reports_steps=True)
    lever = handle.levers["offload"]
    fetched, reaching = [], []
    fetch, reached = offload.Mover.fetch, offload.Mover.reached

    def seen(mover, copy):
        if copy.fetched is None:
            owner = next(i for i, copies in mover._copies.items() if copy in copies)
            fetched.append((owner, reaching[-1] if reaching else None))
        return fetch(mover, copy)

    def reach(mover, index):
        reaching.append(index)
        try:
            return reached(mover, index)
        finally:
            reaching.pop()

    lever.mover = None  # made again at the next forward, its fetches watched
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    lever.mover.fetch = seen.__get__(lever.mover)
    lever.mover.reached = reach.__get__(lever.mover)
    loss.backward()
    # layer 1's as backward reaches layer 2 (not offloaded), layer 0's as it reaches layer 1: none by an unpack
    assert sorted(set(fetched)) == [(0, 1), (1, 2)], fetched
    handle.remove()


def test_a_dry_runs_offload_figures_are_the_steps_own_segment_by_segment():
    """What each offload option holds less, by segment, as `auto` weighs it from step one (every layer recomputed
    whole), is what a step running it reads, in every layer's forward and backward: Llama's forward holds its first
    layer's input (`inputs_embeds`) until its layers end, which offloading the first layer does not free (seen in the
    forward that finds the layers' order before step one: `LayerProfile.input_gone_at`), and the last layers offloaded
    come back as backward reaches the layer ahead of them. A dry run for a card (its kernels, its link to the host)."""
    from transformers import LlamaConfig

    from optimum_memopt.backends.torch import fake_step
    from optimum_memopt.backends.torch.decide.budget import freed_bytes, segment_peaks
    from optimum_memopt.backends.torch.levers.offload.measure import choices
    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.backends.torch.measure.profile import FORWARD
    from optimum_memopt.backends.torch.policy import LAYER, LayerPolicy, RecomputePolicy
    from optimum_memopt.planning.devices import DEFAULT_DEVICE, DEVICES
    from optimum_memopt.planning.dry_run import StepSpec, instruments

    config = LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=176, num_attention_heads=4,
                         vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip
    spec = StepSpec(config, batch=2, seq=256)
    card = dict(kernels=CudaKernels((9, 0)), host_mb=1e6)
    device = DEVICES[DEFAULT_DEVICE]
    one = fake_step.run(spec, instruments(device), "auto", budget_mb=1e6, **card).profile  # step one, then eager fits
    assert [layer.input_gone_at for layer in one.layers] == [4, 2, 3, 4]  # the first held until the head
    measured = RecomputePolicy([LayerPolicy(LAYER) for _ in one.layers])
    q = freed_bytes(one, measured)
    loss = one.levers["loss"].ran  # the head as step one ran it
    options = choices(one, one.levers["offload"])
    assert [c.plan for c in options[1:]] == ["Offload+:1:-1@0", "Offload+:1:-1@0-1", "Offload+:1:-1@0-2",
                                             "Offload+:1:-1"]  # fmt: skip
    for option in options[1:]:
        predicted = dict(segment_peaks(one.memory, q, q, 0, [option]))
        plans = ",".join(p for p in ("Layer+:1:-1", loss, option.plan) if p)
        step = fake_step.run(spec, instruments(device), plans, **card).profile.memory
        layers = [seg for seg in step.segments if seg.place.layer is not None]
        assert len(layers) == 8 and any(seg.place.kind == FORWARD for seg in layers)
        apart = {str(seg.place): seg.peak_bytes - predicted[seg.place] for seg in layers}
        assert not any(apart.values()), (option.plan, apart)


def test_on_a_cards_streams_every_copy_is_ordered_and_waited_for(monkeypatch):
    """The card's stream protocol, held on the CPU by streams that log what a card's would do (`mover.Streams`): each
    copy (out, then back) is queued on the side stream after the compute queued before it, the device tensor it reads
    or writes kept until it ran (`record_stream`), and before backward reads a tensor fetched back, the compute waits
    for that copy's own event. The copies out all come in the forward, the fetches in the backward, and the gradients
    are those of the plain run."""
    from optimum_memopt.backends.torch.levers.offload import mover as moving

    log = []

    class Logged(moving.Streams):
        def copying(self):
            log.append(("queue",))
            return super().copying()

        def copied(self, used):
            event = object()
            log.append(("copied", used.device.type, used.dtype, used.numel(), event))
            return event

        def ready(self, event):
            log.append(("wait", event))

    monkeypatch.setattr(moving, "Streams", Logged)
    plans = "Layer+:1:-1@1,Offload+:1:-1"
    _same_bitwise(run("llama", None, attention_dropout=0.1), run("llama", plans, attention_dropout=0.1))
    log.clear()
    phases = []
    model = model_of("llama", attention_dropout=0.1)
    model.train()
    handle = optimum_memopt.optimize_memory(model, plans, reports_steps=True)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    phases.append(len(log))  # the forward's
    loss.backward()
    handle.remove()
    forward, backward = log[: phases[0]], log[phases[0] :]
    copies_out = [e for e in forward if e[0] == "copied"]
    fetches = [e for e in backward if e[0] == "copied"]
    assert copies_out and fetches and not [e for e in forward if e[0] == "wait"]  # nothing waited on in forward
    assert len(fetches) == len(copies_out)  # each storage back once
    # every copy queued before it is recorded, and every device tensor it touched is the layer's device's bytes
    assert all(log[log.index(e) - 1] == ("queue",) for e in copies_out + fetches)
    assert all(e[1] == "cpu" and e[2] == torch.uint8 for e in copies_out + fetches)
    # each fetched copy waited for, by its own event, after it was queued
    events = [e[4] for e in fetches]
    waits = [e[1] for e in backward if e[0] == "wait"]
    assert set(waits) == set(events)
    assert all(backward.index(("wait", ev)) > backward.index(f) for ev, f in zip(events, fetches))
    del loss


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
    """The lever puts nothing on the layers (the engine runs their forwards through it); once removed, a step copies
    nothing and the layers are as they were."""
    model = model_of("llama")
    model.train()
    hooks = [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in model.model.layers]
    handle = optimum_memopt.optimize_memory(model, "Offload+:1:-1", reports_steps=True)
    lever = handle.levers["offload"]
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    mover, moved = lever.mover, dict(lever.mover.moved_bytes)
    assert sorted(moved) == [0, 1] and lever.installed
    handle.remove()
    assert not lever.installed and lever.option is None
    assert [(len(layer._forward_pre_hooks), len(layer._forward_hooks)) for layer in model.model.layers] == hooks
    assert all("forward" not in vars(layer) for layer in model.model.layers)
    model(input_ids=ids, labels=ids).loss.backward()
    assert lever.mover is mover and mover.moved_bytes == moved and mover.on_host() == 0  # nothing copied


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


# -- in the solve: its options on a step's profile (synthetic: the figures are the test's) --------------------------


def _profile(n=4, kept=1000, held=400, seconds=0.01):
    """`n` layers each keeping `kept` bytes of its own (freed recomputed whole) and holding its input (`held` bytes)
    for backward, measured with every layer recomputed whole: layer i's forward holds the inputs of layers 0..i and
    its own working bytes, its backward the inputs of the layers before it and its own tensors back."""
    from optimum_memopt.backends.torch.measure.graph import LayerGraph, Node
    from optimum_memopt.backends.torch.measure.profile import (
        AFTER_PLACE,
        HEAD_PLACE,
        LayerProfile,
        ModelProfile,
        Place,
        Segment,
        StepMemory,
    )

    layers = []
    for _ in range(n):
        graph = LayerGraph([Node("", held, boundary=True), Node("mul", kept, 0, seconds, ((0, True),))], [0, 1])
        layers.append(LayerProfile(op_seconds=seconds, shape=(1, 8), graph=graph, input_bytes=held,
                                   arguments_bytes=held + 64))  # fmt: skip
    base = 10_000
    segments = [Segment(Place.forward(i), i + 1, 0, base + (i + 1) * held + kept) for i in range(n)]
    segments.append(Segment(HEAD_PLACE, n, 0, base + n * held + 3000))
    segments += [Segment(Place.backward(i), i, 0, base + (i + 1) * held + 2 * kept) for i in reversed(range(n))]
    segments.append(Segment(AFTER_PLACE, 0, 0, base))
    return ModelProfile(layers, StepMemory("cuda", segments, base, "test"))


def _whole(n):
    from optimum_memopt.backends.torch.policy import LAYER, LayerPolicy, RecomputePolicy

    return RecomputePolicy([LayerPolicy(LAYER) for _ in range(n)])


def test_its_options_hold_each_layers_input_less_from_its_forward_to_the_backward_ahead_of_it():
    from optimum_memopt.backends.torch.levers.offload.measure import OffloadMeasure, choices
    from optimum_memopt.backends.torch.measure.profile import HEAD_PLACE, Place

    profile = _profile()
    found = choices(profile, OffloadMeasure(link=1e9, link_how="given", host_room=10**9, host_how="given"))
    assert [c.option for c in found][0] is None and [c.recomputed for c in found[1:]] == [(0,), (0, 1), (0, 1, 2),
                                                                                        (0, 1, 2, 3)]  # fmt: skip
    two = found[2]
    assert two.plan == "Offload+:1:-1@0-1"
    # layer 0 waits through layers 1-3's forward, the head, and the backward of layers 2-3 (layer 1's fetches it);
    # layer 1 through layers 2-3's forward, the head, layer 3's backward
    assert dict(two.less) == {Place.forward(1): 400, Place.forward(2): 800, Place.forward(3): 800, HEAD_PLACE: 800,
                              Place.backward(2): 400, Place.backward(3): 800}  # fmt: skip
    # its copies (each input out and back) against the compute they hide under: the next layer's forward, and the
    # backward (a forward again and its backward) of the layer ahead
    assert two.overlap_seconds == pytest.approx(4 * 400 / 1e9) and two.window_seconds == pytest.approx(2 * 0.04)
    assert two.cost == 0.0
    slow = choices(profile, OffloadMeasure(link=1e3, link_how="given", host_room=10**9, host_how="given"))[2]
    assert slow.cost == pytest.approx(4 * 400 / 1e3 - 0.08)  # only what runs past the window costs
    every = found[-1]
    assert every.plan == "Offload+:1:-1" and every.less_in(Place.backward(3)) == 2 * 400  # layer 2 back in it
    # an option whose copies the host cannot hold is not offered, and why is said
    tight = OffloadMeasure(link=1e9, link_how="given", host_room=2 * 464, host_how="`--memory_host_mb`")
    assert [c.plan for c in choices(profile, tight)] == ["", "Offload+:1:-1@0", "Offload+:1:-1@0-1"]
    assert len(tight.not_offered) == 2 and "1,392 MiB" not in tight.not_offered[0]
    assert "Offload+:1:-1@0-2: its copies would hold up to 0 MiB on the host" in tight.not_offered[0]


def test_the_solver_offloads_where_it_is_the_least_recompute_that_fits_and_predicts_its_peak():
    """Off where keeping every layer fits; at the least peak recompute alone reaches, offloading the first layers lets
    the last one be kept (less recompute than every layer whole); under it, only offload fits."""
    from optimum_memopt.backends.torch.decide.budget import fit
    from optimum_memopt.backends.torch.levers.offload.measure import OffloadMeasure, choices

    profile = _profile()
    measured = _whole(4)
    options = choices(profile, OffloadMeasure(link=1e9, link_how="given", host_room=10**9, host_how="given"))
    kept_all = 10_000 + 4 * 400 + 3000 + 4 * 1000  # the head with every layer kept
    roomy = fit(profile, profile.memory, kept_all, measured, levers=[options])
    assert roomy.config() == "" and roomy.lever("offload").option is None  # nothing recomputed, nothing copied
    alone = fit(profile, profile.memory, 0, measured)
    floor = alone.floor.peak_bytes  # the least recompute reaches: every layer whole
    assert floor == 10_000 + 4 * 400 + 3000
    at_floor = fit(profile, profile.memory, floor, measured, levers=[options])
    assert at_floor.config() == "Layer+:1:-1@0-2,Offload+:1:-1@0-2", at_floor.config()
    assert at_floor.recompute_seconds < fit(profile, profile.memory, floor, measured).recompute_seconds
    # the head: layer 3 kept (its 1,000 bytes), the inputs of layers 0-2 on the host
    assert at_floor.predicted.peak_bytes == floor + 1000 - 3 * 400
    below = fit(profile, profile.memory, floor - 800, measured, levers=[options])
    assert fit(profile, profile.memory, floor - 800, measured).choice is None  # recompute alone cannot
    assert below.choice is not None and below.lever("offload").option is not None, below.why_not
    assert below.predicted.peak_bytes <= floor - 800 and all(c.whole for c in below.choice[:2])
    # the least any option reaches: the head with every layer's input on the host
    assert fit(profile, profile.memory, 0, measured, levers=[options]).floor.peak_bytes == 10_000 + 3000


def test_the_host_memory_flag_is_checked_where_it_is_given(tmp_path):
    from optimum_memopt import MemoptTrainingArguments

    torch_auto = dict(memory_opt_backend="torch", memory_opt_config="auto", memory_budget_mb=100.0)
    bad = [
        ({**torch_auto, "memory_host_mb": -5.0}, r"^`--memory_host_mb` is -5.0; expected a positive, finite number"),
        ({**torch_auto, "memory_host_mb": float("nan")}, r"^`--memory_host_mb` is nan"),
        (dict(memory_opt_backend="torch", memory_opt_level=1, memory_host_mb=1000.0),
         r"but the plans are None; add `--memory_opt_config auto --memory_budget_mb 70000`, or drop `--memory_host_mb`"),
        (dict(memory_opt_backend="torch", memory_opt_config="auto", activation_memory_budget=0.3,
              memory_host_mb=1000.0), r"but no `--memory_budget_mb` is given"),
        (dict(memory_opt_backend="none", memory_host_mb=1000.0), r"^`--memory_host_mb` configure a memory backend"),
    ]  # fmt: skip
    for kwargs, pattern in bad:
        with pytest.raises(ValueError, match=pattern):
            MemoptTrainingArguments(output_dir=str(tmp_path), report_to=[], **kwargs)
    args = MemoptTrainingArguments(output_dir=str(tmp_path), report_to=[], **torch_auto, memory_host_mb=2048.0)
    assert args.memory_host_mb == 2048.0
    with pytest.raises(ValueError, match=r"^`host_memory_mb=512` is the host memory `plans=.auto.` may offload"):
        optimum_memopt.optimize_memory(model_of("llama"), "Layer+:1:-1", host_memory_mb=512)


# -- in the plan before the GPU (memopt-plan's dry runs for a card) ----------------------------------------------


@pytest.mark.slow
def test_the_plan_for_a_card_has_an_offload_row_a_host_column_and_auto_offloads_where_only_that_fits():
    """For a card, the plan dry-runs every layer's input on the host beside the least recompute reaches (a step long
    enough for the inputs to count: 8 layers, 2,048 tokens, bf16): its peak is lower, the host holds the inputs, and a
    host room below that is no fit. `auto`, under a budget between the two rows, offloads, its copies within the
    host's room."""
    from test_plan import tiny

    from optimum_memopt.planning.plan import _OFFLOADED, _TILED, plan

    config = tiny(layers=8, vocab=256)
    spec = dict(batch=1, seq=2048, bf16=True, search=False)
    first = plan(config, **spec, device="H100-80GB", host_mb=1.0, rows=[_TILED, _OFFLOADED])
    tiled, offloaded = first.configurations
    hidden = 2048 * 64 * 4  # one layer's input, fp32 (the residual stream under autocast)
    assert offloaded.host_mb * 2**20 >= 7 * hidden and offloaded.peak_mb < tiled.peak_mb - 1, (offloaded, tiled)
    assert tiled.host_mb == 0.0 and tiled.fits and offloaded.fits is False  # the host's 1 MiB cannot hold it
    table = first.table()
    assert " host " in table.splitlines()[2] and "the host's room: `--memory_host_mb 1`" in table, table
    budget = (tiled.peak_mb + offloaded.peak_mb) / 2
    (auto,) = plan(config, **spec, device="H100-80GB", budget_mb=budget, host_mb=1024.0, rows=["auto"]).configurations
    assert auto.fits and "Offload+" in auto.choice and 0 < auto.host_mb <= offloaded.host_mb, auto
    assert auto.peak_mb <= int(budget)


@pytest.mark.slow
def test_the_largest_sizes_found_by_offloading_say_what_the_host_must_hold():
    """Where the least memory `auto` reaches offloads (the plan's floor row, `Offload+`), the largest batch and
    sequence it finds hold their offloaded tensors on the host: the line says how much at each, as the search's own
    dry runs read it, and that the training machine must hold it where the host's room was not given (without it the
    line read as if the card alone held that batch: an 8B plan's batch 42 at 8,192 tokens needs 84 GiB of host)."""
    from test_plan import tiny

    from optimum_memopt.backends.torch.measure.attention import CudaKernels
    from optimum_memopt.planning.devices import DEVICES, WORKSPACES_MIB
    from optimum_memopt.planning.dry_run import StepSpec, dry_run
    from optimum_memopt.planning.plan import _FLOOR_PLANS, _OFFLOADED, plan

    config = tiny(layers=2, vocab=256)
    spec = dict(batch=1, seq=128, bf16=True, device="H100-80GB", rows=[_OFFLOADED])
    (row,) = plan(config, **spec, search=False, budget_mb=1e6).configurations
    budget = row.peak_mb + 4.0  # room for some more samples or tokens, not for every one
    found = plan(config, **spec, budget_mb=budget)
    reach = found.reach
    assert reach["under"] == _OFFLOADED and reach["batch"] > 1 and reach["seq"] > 128, reach
    hosts = reach["host_mb"]
    for field in ("batch", "seq"):
        run = next(r for r in reach["runs"] if r.get(field) == reach[field])
        assert hosts[field] == run["host_mb"] > 0, (field, reach)
    for host_mb in (None, 1e6):  # the room given or not: only what the line says of it differs
        found.host_mb = host_mb
        line = next(x for x in found.table().splitlines() if x.startswith("auto fits up to batch"))
        assert f"its offloaded tensors hold on the host {hosts['batch']:.1f} MiB at batch {reach['batch']:,}, " in line
        assert f"{hosts['seq']:.1f} MiB at {reach['seq']:,} tokens" in line, line
        assert ("the host's room not given" in line) == (host_mb is None), line
    # a host's room below what the largest batch held binds first: the search follows the host's line down to the
    # largest batch whose copies it holds (moved down by the memory's overshoot alone, it stopped at the plan's own)
    room = hosts["batch"] / 2
    bound = plan(config, **spec, budget_mb=budget, host_mb=room).reach
    batch = bound["batch"]
    assert 1 < batch < reach["batch"] and bound["host_mb"]["batch"] <= room, bound
    floor = dict(  # the search's own dry run of the floor row, as `plan` makes it for the card
        plans=_FLOOR_PLANS[_OFFLOADED],
        held_bytes=int(WORKSPACES_MIB * 2**20),
        kernels=CudaKernels(DEVICES["H100-80GB"].capability),
        peak_only=True,
    )
    more = dry_run(StepSpec(config, batch=batch + 1, seq=128, dtype="float32", autocast="bfloat16"), **floor)
    assert more.host_peak_bytes > room * 2**20 or more.peak_bytes > budget * 2**20


def test_its_options_are_weighed_against_what_the_measured_step_offloaded():
    """Where the step measured ran offload already (a plan file's choice, a dry run's), each option holds less than
    that: the same layers nothing, none of them the inputs back (more), more layers the difference."""
    from optimum_memopt.backends.torch.levers.offload.measure import OffloadMeasure, choices
    from optimum_memopt.backends.torch.measure.profile import HEAD_PLACE, Place

    profile = _profile()
    ran = OffloadMeasure(link=1e9, link_how="given", host_room=10**9, host_how="given", ran=((0, 1), (1, 1)))
    found = {c.plan: c for c in choices(profile, ran)}
    assert found[""].option is None and found[""].less_in(HEAD_PLACE) == -800  # off: both inputs back
    assert found["Offload+:1:-1@0-1"].less == ()  # what ran: no change
    assert dict(found["Offload+:1:-1@0-2"].less) == {Place.forward(3): 400, HEAD_PLACE: 400}  # layer 2 more


def test_the_hosts_room_is_shared_by_the_processes_on_its_machine(monkeypatch):
    """Each process of a run offloads its own step's tensors into the one host: the room it weighs is its share."""
    from optimum_memopt.backends.torch.levers.offload import measure as reading
    from optimum_memopt.backends.torch.measure.storages import StorageCount

    with StorageCount() as count:  # a dry run for a card: the link from the table, no copy timed
        count.host_link = (64e9, "given")
        alone = reading.measure("cuda", 8192.0)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        shared = reading.measure("cuda", 8192.0)
    assert alone.host_room == 8192 * 2**20 and alone.host_how == "`--memory_host_mb 8192`"
    assert shared.host_room == 2048 * 2**20
    assert shared.host_how == "`--memory_host_mb 8192`, shared by the 4 processes on this machine (2,048 MiB each)"
