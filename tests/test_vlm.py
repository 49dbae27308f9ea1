"""Vision-language models under the torch backend, trained with images: LLaVA, Qwen2-VL, Qwen2.5-VL (windowed
attention in the tower), Qwen3-VL (the tower's deepstack features added inside the language layers) and Gemma 3 at tiny size
(`pixel_values` and what each family's forward takes with them). Their vision tower's blocks are found beside the
language model's layers; level 1 trains bitwise as the run without the plugin; the loss lever chunks their language
head (read from each forward's source) to the plain run's losses."""

import pytest
import torch

import optimum_memopt
from optimum_memopt.backends.torch.levers.loss import ChunkedLoss, Chunking, causal_lm, loss_problem

pytestmark = pytest.mark.torch_backend

TEXT = dict(
    num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=256, max_position_embeddings=512,
)  # fmt: skip
IMAGE = 200  # the image token of every family here


def _shrink(config, values: dict) -> None:
    for key, value in values.items():
        if hasattr(config, key):
            setattr(config, key, value)


def _build(config):
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(config)


def llava():
    """LLaVA: a CLIP tower's patches projected into the prompt at the image tokens (16 patches of a 32x32 image)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llava")
    _shrink(config.text_config, TEXT)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    _shrink(config.vision_config, dict(vision, image_size=32, patch_size=8))
    config.image_token_id = config.image_token_index = IMAGE
    config.vision_feature_layer = -1

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, IMAGE - 1, (2, 40), generator=g)
        ids[:, 2:18] = IMAGE
        labels = ids.clone()
        labels[:, :18] = -100
        return dict(input_ids=ids, labels=labels, pixel_values=torch.randn(2, 3, 32, 32, generator=g))

    return _build(config), batch


def qwen2_vl():
    """Qwen2-VL: 16 patches of 4x4 pixels (two frames each) merged 2x2 into 4 image tokens, multimodal RoPE."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2_vl")
    _shrink(config.text_config, TEXT)
    config.text_config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 3, 3]}
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4)
    _shrink(config.vision_config, dict(vision, spatial_merge_size=2, temporal_patch_size=2))
    config.image_token_id, config.video_token_id, config.vision_start_token_id = IMAGE, IMAGE + 1, IMAGE + 2
    config.vision_end_token_id = IMAGE + 3
    return _build(config), qwen2_vl_batch


def qwen2_vl_batch(step: int) -> dict:
    """Two prompts of 30 tokens, each with one 16x16 image (4 image tokens after the 2x2 merge)."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(0, 150, (2, 30), generator=g)
    ids[:, 3:7] = IMAGE
    labels = ids.clone()
    labels[:, :7] = -100
    pixels = torch.randn(2 * 16, 3 * 2 * 4 * 4, generator=g)
    grid = torch.tensor([[1, 4, 4]]).repeat(2, 1)
    return dict(
        input_ids=ids, labels=labels, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=(ids == IMAGE).long()
    )


def qwen_vl(family: str):
    """Qwen2.5-VL and Qwen3-VL: as Qwen2-VL's batch; Qwen2.5-VL's tower has windowed and full-attention blocks,
    Qwen3-VL's feeds its first block's features (deepstack) into the language model's first layer."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(family)
    _shrink(config.text_config, TEXT)
    config.text_config.rope_parameters = {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 3, 3]}
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, out_hidden_size=64)
    extra = dict(fullatt_block_indexes=[1], window_size=16, deepstack_visual_indexes=[0], num_position_embeddings=16)
    _shrink(config.vision_config, dict(vision, **extra, spatial_merge_size=2, temporal_patch_size=2))
    config.image_token_id, config.video_token_id, config.vision_start_token_id = IMAGE, IMAGE + 1, IMAGE + 2
    config.vision_end_token_id = IMAGE + 3
    return _build(config), qwen2_vl_batch


def gemma3():
    """Gemma 3: a SigLIP tower pooled to 4 tokens an image, sliding-window and global attention, soft-capped head."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma3")
    _shrink(config.text_config, dict(TEXT, sliding_window=16))
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    _shrink(config.vision_config, dict(vision, image_size=32, patch_size=8))
    config.mm_tokens_per_image = 4
    config.image_token_id = config.image_token_index = IMAGE
    config.boi_token_index, config.eoi_token_index = IMAGE + 1, IMAGE + 2

    def batch(step: int) -> dict:
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, IMAGE - 1, (2, 30), generator=g)
        ids[:, 3:7] = IMAGE
        labels = ids.clone()
        labels[:, :7] = -100
        pixels = torch.randn(2, 3, 32, 32, generator=g)
        return dict(input_ids=ids, labels=labels, pixel_values=pixels, token_type_ids=(ids == IMAGE).long())

    return _build(config), batch


FAMILIES = {
    "llava": llava,
    "qwen2_vl": qwen2_vl,
    "qwen2_5_vl": lambda: qwen_vl("qwen2_5_vl"),
    "qwen3_vl": lambda: qwen_vl("qwen3_vl"),
    "gemma3": gemma3,
}
TOWERS: dict = {}  # family -> the table's note on the lists its layers come from (`train` with a level)
AUTO: dict = {}  # family -> the planner and choice of its last `auto` run


def train(family: str, steps: int = 3, level: int = 0, chunks=None, budget_mb=None):
    """Each step's loss, and the layers the backend found (with `level`); with `budget_mb`, `auto` under it (the
    handle's planner in `AUTO[family]`)."""
    model, batch = FAMILIES[family]()
    model.train()
    handle = None
    if level:
        handle = optimum_memopt.optimize_memory(model, None, level=level, say=lambda text: None)
    elif budget_mb is not None:
        handle = optimum_memopt.optimize_memory(model, "auto", budget_mb=budget_mb, say=lambda text: None)
    lever = None
    if chunks is not None:
        lever = ChunkedLoss(causal_lm(model), Chunking(chunks=chunks), say=lambda text: None)
        lever.install()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(steps):
        out = model(**batch(step))
        out.loss.backward()
        losses.append(out.loss.detach().clone())
        opt.step()
        opt.zero_grad()
        if handle is not None:
            handle.step_done()
    names = {id(m): n for n, m in model.named_modules()}
    layers = [names[id(layer)] for layer in handle.layers] if handle is not None else []
    if budget_mb is not None:
        AUTO[family] = handle.planner, handle.auto
    if level:  # the table's notes name each list the layers come from
        TOWERS[family] = [n for n in handle.report().notes if n.startswith("the layers come from several lists")]
    if handle is not None:
        handle.remove()
    if lever is not None:
        lever.remove()
    return losses, layers


@pytest.fixture(scope="module", params=list(FAMILIES))
def plain(request):
    return request.param, train(request.param)[0]


def test_level_1_finds_both_towers_and_trains_bitwise(plain):
    family, losses = plain
    ran, layers = train(family, level=1)
    vision_list = layers[0].rpartition(".")[0]
    assert any(vision_list in note and "layers 2-3: " in note for note in TOWERS[family]), (family, TOWERS[family])
    assert all(torch.equal(a, b) for a, b in zip(losses, ran)), (family, losses, ran)
    vision = [n for n in layers if "vision" in n or "visual" in n]
    language = [n for n in layers if "language_model" in n]
    assert len(vision) == 2 and len(language) == 2, layers


def test_the_language_head_is_chunked_to_the_plain_losses(plain):
    family, losses = plain
    model, _ = FAMILIES[family]()
    assert loss_problem(model) is None
    chunked, _ = train(family, chunks=3)
    for a, b in zip(losses, chunked):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item()), (family, losses, chunked)


@pytest.mark.slow
def test_auto_with_images_chooses_within_its_budget(plain):
    """`auto` on the whole model, images in every step: under a budget halfway between eager's peak and the least
    any choice reaches, it chooses (layers of either tower, the head's chunks) within the budget, and trains as the
    plain run (to 1e-6: its head may run in chunks)."""
    family, losses = plain
    train(family, steps=3, budget_mb=10**6)
    roomy, _ = AUTO[family]
    eager, floor = roomy.verified[0]["measured_peak_mb"], roomy.fits[0].floor.peak_mb
    assert floor < eager, (family, floor, eager)
    budget = round((eager + floor) / 2, 3)
    ran, _ = train(family, steps=3, budget_mb=budget)
    _, choice = AUTO[family]
    assert choice["config"] and choice["predicted_peak_mb"] <= budget, (family, budget, choice)
    assert all(check["measured_peak_mb"] <= budget for check in choice["checks"]), (family, budget, choice)
    for a, b in zip(losses, ran):
        assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item()), (family, losses, ran)
    from optimum_memopt.callbacks.step_memory import draw_step_memory

    planner, _ = AUTO[family]  # the picture names the list each layer comes from, as the table's note does
    text = "\n".join(t.get_text() for t in draw_step_memory(planner.solver_data()).texts)
    assert "the layers come from:\nlayers 0-1: model." in text and "layers 2-3: model.language_model.layers" in text, (
        text
    )


def test_on_text_alone_a_plan_on_the_towers_layer_is_said_to_recompute_nothing(caplog):
    """Gemma 3 trained on text alone runs its language layers (2, 3) and not its vision tower's (0, 1): a plan that
    names layer 0 recomputes nothing, and the warning says so with the flag for the layers that run."""
    model, batch = gemma3()
    model.train()
    handle = optimum_memopt.optimize_memory(model, "Layer+:1:-1@0", say=lambda text: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with caplog.at_level("WARNING", logger="optimum_memopt"):
        for step in range(3):
            inputs = batch(step)
            del inputs["pixel_values"], inputs["token_type_ids"]
            inputs["input_ids"][inputs["input_ids"] == IMAGE] = 5
            model(**inputs).loss.backward()
            opt.step()
            opt.zero_grad()
            handle.step_done()
    handle.remove()
    said = [r.getMessage() for r in caplog.records if "did not run" in r.getMessage()]
    assert len(said) == 1, said
    assert "The plans on layers 0 (whole) recompute nothing: those layers did not run" in said[0]
    assert "no layer that ran has a plan, so nothing is recomputed" in said[0]
    assert "`--memory_opt_config 'Layer+:1:-1@2+3'`" in said[0]


@pytest.mark.slow
def test_auto_on_text_alone_chooses_among_the_layers_that_run(tmp_path):
    """Through the Trainer, `auto`'s dry run of step one sees that Gemma 3's tower does not run on text alone (it
    stopped there before, and before that trained without a choice, saying nothing): step one is measured over the
    language layers, and under a budget halfway between eager's peak and the least any choice reaches, `auto`
    chooses plans on those layers only, within the budget, and trains as the plain run (to 1e-6: its head may run in
    chunks)."""
    from helpers import LossRecordingTrainer, make_args

    class Text(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.randint(0, IMAGE - 1, (128,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids.clone()}

    def run(name, *flags):
        args = make_args(tmp_path / name, "--max_steps", "4", "--per_device_train_batch_size", "2", *flags)
        trainer = LossRecordingTrainer(model=gemma3()[0], args=args, train_dataset=Text())
        trainer.train()
        return trainer

    plain = run("plain", "--memory_opt_backend", "none")
    auto = ("--memory_opt_backend", "torch", "--memory_opt_config", "auto", "--memory_budget_mb")
    roomy = run("roomy", *auto, "1000").memopt_handle.planner
    eager, floor = roomy.verified[0]["measured_peak_mb"], roomy.fits[0].floor.peak_mb
    assert floor < eager, (floor, eager)
    budget = round((eager + floor) / 2, 3)
    tight = run("tight", *auto, str(budget))
    choice = tight.memopt_handle.auto
    assert tight.memopt_handle._state.running == [2, 3]  # step one was measured over the language layers
    assert choice["config"] and choice["predicted_peak_mb"] <= budget, (budget, choice)
    assert all(check["measured_peak_mb"] <= budget for check in choice["checks"]), (budget, choice)
    layers = {int(k) for entry in choice["config"].split(",") for k in _layers_of(entry)}
    assert layers and layers <= {2, 3}, choice["config"]  # the tower's layers never ran: never chosen
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(tight.losses, plain.losses)), (tight.losses, plain.losses)


def _layers_of(entry: str):
    """The layer numbers an entry of a plan names (`MatMul+:1:-1@0-2+5` -> 0, 1, 2, 5)."""
    for part in entry.partition("@")[2].split("+"):
        low, _, high = part.partition("-")
        yield from range(int(low), int(high or low) + 1)
