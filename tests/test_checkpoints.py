"""`resume_from_checkpoint` after a save that was cut short (a kill while the Trainer wrote `checkpoint-N/`): the
newest complete checkpoint is used and the skipped one named; an incomplete one given by path is refused with the one
to pass instead."""

import json
import logging

import pytest
from helpers import ClsData, LossRecordingTrainer, make_args, tiny_model

from optimum_memopt import transformers_releases
from optimum_memopt.checkpoints import STATE_FILE, newest_complete, resolve

# the checkpoints the installed Trainer writes and resumes from: each stack's own
pytestmark = pytest.mark.both_stacks


def _checkpoint(root, step, state=True):
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x")
    if state is True:
        (path / STATE_FILE).write_text(json.dumps({"global_step": step}))
    elif state:
        (path / STATE_FILE).write_text(state)
    return path


def test_the_newest_complete_checkpoint_is_chosen_and_the_cut_ones_named(tmp_path):
    _checkpoint(tmp_path, 4)
    _checkpoint(tmp_path, 10)
    _checkpoint(tmp_path, 12, state=False)  # killed before trainer_state.json
    _checkpoint(tmp_path, 14, state='{"global_st')  # killed while writing it
    (tmp_path / "checkpoint-99-notes").mkdir()  # not a checkpoint
    chosen, notes = resolve(True, str(tmp_path))
    assert chosen == str(tmp_path / "checkpoint-10")
    assert notes == [
        "resume: skipping checkpoint-14 (trainer_state.json cannot be read (JSONDecodeError): its save was cut short); "
        "resuming from checkpoint-10",
        "resume: skipping checkpoint-12 (no trainer_state.json: its save was cut short); resuming from checkpoint-10",
    ]


def test_only_cut_checkpoints_is_a_clear_error(tmp_path):
    _checkpoint(tmp_path, 6, state=False)
    with pytest.raises(ValueError, match=r"no complete checkpoint in .*\(checkpoint-6: no trainer_state.json: its sa"):
        resolve(True, str(tmp_path))


def test_no_checkpoint_at_all_is_left_to_the_trainer(tmp_path):
    assert resolve(True, str(tmp_path)) == (True, [])  # the Trainer says "No valid checkpoint found"
    assert newest_complete(str(tmp_path / "missing")) == (None, [])


def test_a_cut_checkpoint_given_by_path_names_the_one_to_pass(tmp_path):
    _checkpoint(tmp_path, 4)
    cut = _checkpoint(tmp_path, 6, state=False)
    with pytest.raises(ValueError, match=r"checkpoint-6'`: no trainer_state.json: .*; pass '.*checkpoint-4' instead$"):
        resolve(str(cut), str(tmp_path))
    assert resolve(str(tmp_path / "checkpoint-4"), str(tmp_path)) == (str(tmp_path / "checkpoint-4"), [])
    assert resolve(False, str(tmp_path)) == (False, []) and resolve(None, str(tmp_path)) == (None, [])


def test_a_run_whose_last_save_was_cut_resumes_from_the_one_before(tmp_path, caplog):
    if transformers_releases.resume_refusal():
        pytest.skip("this transformers cannot restore a checkpoint's state on torch 2.4 (transformers_releases)")

    def args(out):
        return make_args(
            out, "--max_steps", "6", "--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2"
        )

    full = LossRecordingTrainer(model=tiny_model(), args=args(tmp_path / "run"), train_dataset=ClsData())
    full.train()
    # what a kill while checkpoint-6 was written leaves: no trainer_state.json (the Trainer writes it last)
    (tmp_path / "run" / "checkpoint-6" / STATE_FILE).unlink()
    resumed = LossRecordingTrainer(model=tiny_model(seed=123), args=args(tmp_path / "run"), train_dataset=ClsData())
    with caplog.at_level(logging.WARNING, logger="optimum_memopt"):
        resumed.train(resume_from_checkpoint=True)
    assert (
        "resume: skipping checkpoint-6 (no trainer_state.json: its save was cut short); resuming from " in caplog.text
    )
    assert len(resumed.losses) == 2
    assert max(abs(a - b) for a, b in zip(full.losses[4:], resumed.losses)) <= 1e-6
