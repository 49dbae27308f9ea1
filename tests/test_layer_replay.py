"""A dry run's alike layers replayed from two recorded (`backends.torch.measure.replay`): the plain step replayed counts
what the same step run in full counts, figure for figure (the peak, its parts and where, each layer's marks, the
priced seconds, the attention kernels), across families, dtypes, adapters and micro-batches; where a record does not
hold for the others, the step runs again in full."""

import os
import sys

import pytest
import torch

from optimum_memopt.backends.torch import fake_step
from optimum_memopt.backends.torch.measure import replay as layer_replay
from optimum_memopt.backends.torch.measure.attention import CudaKernels
from optimum_memopt.backends.torch.measure.storages import counting
from optimum_memopt.planning.devices import DEVICES
from optimum_memopt.planning.dry_run import StepSpec, dry_run
from optimum_memopt.planning.dry_run import instruments as dry_run_instruments

pytestmark = pytest.mark.torch_backend

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import families  # noqa: E402

LAYERS = 8
LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules="all-linear")


def _config(kind: str, layers: int = LAYERS):
    from transformers import AutoConfig

    config = AutoConfig.for_model(kind)
    families.shrink(config)
    for key in ("num_hidden_layers", "num_layers", "n_layer", "n_layers"):
        if key in vars(config):
            setattr(config, key, layers)
    if getattr(config, "layer_types", None) is not None:  # a pattern per layer (sliding and full attention)
        pattern = list(config.layer_types) or ["full_attention"]
        config.layer_types = [pattern[i % len(pattern)] for i in range(layers)]
    return config


def _marked(monkeypatch) -> list:
    """The count at each layer's forward start and each layer's backward start, as the step passes them."""
    readings = []
    marks = fake_step._marks

    def marked(model, layers, count):
        handles = marks(model, layers, count)

        def starts(index, module, args):
            if torch.is_grad_enabled():
                readings.append(("forward", index, counting().current))

        def ends(index, module, args, out):
            first = next((t for t in fake_step._tensors(out) if t.requires_grad), None)
            if first is not None and torch.is_grad_enabled():
                first.register_hook(lambda grad: readings.append(("backward", index, counting().current)))

        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: starts(i, m, a)))
            handles.append(layer.register_forward_hook(lambda m, a, o, i=i: ends(i, m, a, o)))
        return handles

    monkeypatch.setattr(fake_step, "_marks", marked)
    return readings


def _figures(result) -> tuple:
    return (
        result.peak_bytes,
        result.parts,
        result.peak_at,
        result.step_peaks,
        result.step_parts,
        result.before_training_bytes,
        result.attention,
        result.step_seconds,
    )


def _both(monkeypatch, spec, card: bool = True, checkpointing: bool = False):
    """The plain step's dry run in full, then replayed: each one's figures and marks (`checkpointing`: under
    transformers' gradient checkpointing instead)."""
    out = []
    for replay in (False, True):
        readings = _marked(monkeypatch)
        result = dry_run(
            spec,
            backend=False,
            checkpointing=checkpointing,
            cost_device=DEVICES["H100-80GB"],
            kernels=CudaKernels((9, 0)) if card else None,
            replay_layers=replay,
        )
        out.append((result, readings))
        monkeypatch.undo()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, options",
    [
        ("llama", dict(dtype="bfloat16", autocast="bfloat16", lora=LORA)),
        ("llama", dict(autocast="bfloat16", grad_accum=2)),  # fp32 weights: autocast's casts; a second micro-batch
        ("gemma3_text", dict(dtype="bfloat16", autocast="bfloat16")),  # five sliding layers to a full one
        ("gpt2", dict(lora=dict(r=4, target_modules=["c_attn"], lora_dropout=0.1, fan_in_fan_out=True))),
        ("qwen3_moe", dict()),
        ("bert", dict()),  # an encoder's layer as a causal LM: small tensors let go of before each backward
    ],
)
def test_a_replayed_step_counts_what_the_full_step_counts(monkeypatch, kind, options):
    spec = StepSpec(_config(kind), batch=2, seq=32, **options)
    (full, full_marks), (replayed, replayed_marks) = _both(monkeypatch, spec)
    assert full.layers_replayed == 0
    assert replayed.layers_replayed > 0, kind  # eight layers: some of each run of alike ones replayed
    assert _figures(replayed) == _figures(full)
    assert replayed_marks == full_marks and len(full_marks) >= 2 * LAYERS


@pytest.mark.slow
@pytest.mark.parametrize(
    "card, plans",
    [
        (True, "Offload+:1:-1@0-9:ahead2"),  # a card's step: the copies' bytes on the host alone, fetched two ahead
        (False, "Layer+:1:-1,Loss+:1:-1,Offload+:1:-1"),  # the CPU's: the host's copies in the count; every layer
    ],
)
def test_offloaded_layers_replayed_count_on_the_device_and_the_host_what_they_count_run(monkeypatch, card, plans):
    # an offloaded layer's copies are the mover's and the host's count, not the device's: a replayed layer counts
    # them on the host again and its fetch runs as backward reaches it (between two layers' recorded stretches)
    spec = StepSpec(_config("llama", 12), batch=2, seq=64, dtype="bfloat16", autocast="bfloat16", lora=LORA)
    kernels = dict(cost_device=DEVICES["H100-80GB"], kernels=CudaKernels((9, 0))) if card else {}
    out = []
    for replay in (False, True):
        readings = _marked(monkeypatch)
        out.append((dry_run(spec, plans, replay_layers=replay, **kernels), readings))
        monkeypatch.undo()
    (full, full_marks), (replayed, replayed_marks) = out
    assert replayed.layers_replayed >= 4 and full.host_peak_bytes > 0
    assert _figures(replayed) == _figures(full) and replayed.host_peak_bytes == full.host_peak_bytes
    assert replayed_marks == full_marks and len(full_marks) >= 2 * 12


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, options",
    [
        ("llama", dict(dtype="bfloat16", autocast="bfloat16", lora=LORA)),
        ("gemma3_text", dict()),  # five sliding layers to a full one, fp32
    ],
)
def test_under_transformers_checkpointing_a_replayed_step_counts_what_the_full_step_counts(monkeypatch, kind, options):
    # a recorded layer's recompute runs inside its backward (its stretch holds it); a replayed layer saves nothing,
    # so nothing recomputes it, and its backward walks the recorded one's, recompute included
    spec = StepSpec(_config(kind), batch=2, seq=32, **options)
    (full, full_marks), (replayed, replayed_marks) = _both(monkeypatch, spec, checkpointing=True)
    assert replayed.layers_replayed > 0 and full.layers_replayed == 0
    assert _figures(replayed) == _figures(full)
    assert replayed_marks == full_marks and len(full_marks) >= 2 * LAYERS


def test_a_record_that_does_not_hold_runs_the_step_again_in_full(monkeypatch):
    spec = StepSpec(_config("llama"), batch=2, seq=32, lora=LORA)
    full = dry_run(spec, backend=False, cost_device=DEVICES["H100-80GB"], replay_layers=False)
    monkeypatch.setattr(layer_replay._Backward, "same_as", lambda self, other: False)
    again = dry_run(spec, backend=False, cost_device=DEVICES["H100-80GB"])
    assert again.layers_replayed == 0  # the step that replayed some layers raised, and its figures were dropped
    assert _figures(again) == _figures(full)


def test_a_kv_cache_the_layers_fill_is_never_replayed():
    # `--use_cache`: each layer puts its keys and values in the cache object it is given, which a stand-in would not
    spec = StepSpec(_config("llama"), batch=2, seq=32, use_cache=True)
    full = dry_run(spec, backend=False, replay_layers=False)
    replayed = dry_run(spec, backend=False)
    assert replayed.layers_replayed == 0
    assert _figures(replayed) == _figures(full)


def test_layers_alike_by_their_modules_not_their_numbering():
    from transformers import AutoModelForCausalLM

    config = _config("gemma3_text")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = model.model.layers
    prints = layer_replay.fingerprints(list(layers))
    kinds = config.layer_types
    for i in range(1, len(layers)):
        assert (prints[i] == prints[i - 1]) == (kinds[i] == kinds[i - 1]), (i, kinds)


def _auto_figures(result) -> tuple:
    return _figures(result) + (result.auto, result.fit.config() if result.fit is not None else None)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, budget_mb, lora",
    [
        ("llama", 3.0, LORA),  # op plans in most layers, whole layers in others, the head in chunks
        ("qwen3_moe", 1e6, dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])),
    ],
)
def test_autos_checks_replayed_count_what_they_count_run(kind, budget_mb, lora):
    # `auto`'s steps after step one run through the engine: each layer under its policy and the levers' state, the
    # watch reading each segment and the marks inside layers (the MLP's); replayed, the same figures, checks, choice
    spec = StepSpec(_config(kind), batch=2, seq=64, dtype="bfloat16", autocast="bfloat16", lora=lora)
    results = [
        dry_run(
            spec,
            plans="auto",
            budget_mb=budget_mb,
            cost_device=DEVICES["H100-80GB"],
            kernels=CudaKernels((9, 0)),
            replay_layers=replay,
        )
        for replay in (False, True)
    ]
    full, replayed = results
    assert replayed.layers_replayed > 0
    assert _auto_figures(replayed) == _auto_figures(full)


def test_a_given_model_runs_again_on_the_one_made_again(monkeypatch):
    # a run's own dry run hands its model's twin (`from_plan`): where a record fails, the dry run runs again on a
    # spare the run made (`remake`), and without one a given model's layers all run
    spec = StepSpec(_config("llama"), batch=2, seq=32, lora=LORA)
    instruments = dry_run_instruments()
    full = fake_step.run(spec, instruments, backend=False, replay_layers=False)
    given = fake_step.run(spec, instruments, backend=False, model=fake_step._build(spec))
    assert given.layers_replayed == 0 and _figures(given) == _figures(full)
    monkeypatch.setattr(layer_replay._Backward, "same_as", lambda self, other: False)
    spare = fake_step._build(spec)
    again = fake_step.run(spec, instruments, backend=False, model=fake_step._build(spec), remake=lambda: spare)
    assert again.layers_replayed == 0 and _figures(again) == _figures(full)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind, plans",
    [
        ("llama", "Layer+:1:-1,Loss+:1:-1,MLP+:1:-1@tiles2"),  # level 1 + Loss+ + MLP+: the MLP's marks in layers
        ("qwen3", "Attention+silu+:1:-1"),  # op plans: their recipes recorded, their bytes replaced
    ],
)
def test_step_one_replayed_profiles_each_layer_as_run(kind, plans):
    # step one records each layer's profile as it runs (its ops' plans, bytes and seconds, its graph): a replayed
    # layer's is its kind's record's, its own input and arguments apart; the whole profile, the table's data and
    # every figure are the same
    spec = StepSpec(_config(kind), batch=2, seq=64, dtype="bfloat16", autocast="bfloat16", lora=LORA)
    full, replayed = [
        dry_run(spec, plans, cost_device=DEVICES["H100-80GB"], kernels=CudaKernels((9, 0)), replay_layers=replay)
        for replay in (False, True)
    ]
    assert replayed.layers_replayed > 0
    assert _figures(replayed) == _figures(full)
    assert replayed.profile == full.profile
    assert replayed.report == full.report
