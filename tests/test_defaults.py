"""The plugin's arguments keep the defaults of the installed transformers and of the config class the memory flags
are added to (`with_memory_flags`): a user who switches a script to the plugin trains with the same optimizer,
learning rate, precision and logging as before, on both stacks."""

import dataclasses
import os
import pickle
from typing import Optional

import pytest
from transformers import HfArgumentParser, TrainingArguments

from optimum_memopt import MemoptTrainingArguments, with_memory_flags

# the defaults of the installed transformers and TRL: each stack's own
pytestmark = pytest.mark.both_stacks

PLUGIN_FIELDS = {f.name for f in dataclasses.fields(MemoptTrainingArguments)} - {
    f.name for f in dataclasses.fields(TrainingArguments)
}


def _differences(ours, theirs, names):
    diff = {}
    for name in names:
        a, b = getattr(ours, name), getattr(theirs, name)
        if name == "logging_dir" and a and b:  # transformers 4.x derives it from the clock: runs/<time>_<host>
            a, b = os.path.dirname(a), os.path.dirname(b)
        if a != b:
            diff[name] = (a, b)
    return diff


@pytest.mark.parametrize("how", ["constructor", "command line"])
def test_every_default_is_the_installed_transformers_own(tmp_path, how):
    if how == "constructor":
        ours, theirs = MemoptTrainingArguments(output_dir=str(tmp_path)), TrainingArguments(output_dir=str(tmp_path))
    else:
        argv = ["--output_dir", str(tmp_path)]
        (ours,) = HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(argv)
        (theirs,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(argv)
    names = [f.name for f in dataclasses.fields(TrainingArguments)]
    assert "optim" in names and not PLUGIN_FIELDS & set(names)
    assert _differences(ours, theirs, names) == {}
    assert ours.optim == theirs.optim  # 4.46: adamw_torch; 5.x: adamw_torch_fused


@dataclasses.dataclass
class LikeSFTConfig(TrainingArguments):
    """A config class with defaults of its own, as TRL's `SFTConfig` has (and one field of its own)."""

    learning_rate: float = 2e-5
    logging_steps: float = 10
    gradient_checkpointing: Optional[bool] = True
    max_length: int = 1024


def test_added_flags_keep_the_config_classs_defaults(tmp_path):
    Args = with_memory_flags(LikeSFTConfig)
    assert Args is with_memory_flags(LikeSFTConfig)
    assert issubclass(Args, LikeSFTConfig) and issubclass(Args, MemoptTrainingArguments)
    argv = ["--output_dir", str(tmp_path), "--gradient_checkpointing", "false", "--memory_opt_backend", "none"]
    (ours,) = HfArgumentParser(Args).parse_args_into_dataclasses(argv)
    (theirs,) = HfArgumentParser(LikeSFTConfig).parse_args_into_dataclasses(argv[:4])
    names = [f.name for f in dataclasses.fields(LikeSFTConfig)]
    assert _differences(ours, theirs, names) == {}
    assert (ours.learning_rate, ours.logging_steps, ours.max_length) == (2e-5, 10, 1024)
    # the other base order resets them to transformers' defaults: why the helper exists
    Reset = dataclasses.dataclass(type("Reset", (MemoptTrainingArguments, LikeSFTConfig), {}))
    assert Reset(output_dir=str(tmp_path), gradient_checkpointing=False).learning_rate == 5e-5


def test_a_checkpointing_default_of_the_config_class_is_named_as_such(tmp_path):
    Args = with_memory_flags(LikeSFTConfig)
    for backend in ("torch", "ort"):
        with pytest.raises(
            ValueError, match=r"^`gradient_checkpointing=True` \(LikeSFTConfig's default, unless you pa"
        ):
            Args(output_dir=str(tmp_path), memory_opt_backend=backend, memory_opt_level=1)
    with pytest.raises(ValueError, match=r"^`--gradient_checkpointing` "):
        MemoptTrainingArguments(output_dir=str(tmp_path), gradient_checkpointing=True, memory_opt_backend="torch")
    args = Args(output_dir=str(tmp_path), memory_opt_backend="torch", memory_opt_level=1, gradient_checkpointing=False)
    assert args.memory_opt.level == 1 and args.learning_rate == 2e-5


def test_the_combined_arguments_pickle_as_the_trainer_saves_them(tmp_path):
    Args = with_memory_flags(LikeSFTConfig)
    args = Args(output_dir=str(tmp_path), gradient_checkpointing=False, memory_opt_backend="torch")
    again = pickle.loads(pickle.dumps(args))
    assert type(again) is Args and again.to_dict() == args.to_dict()


def test_with_memory_flags_takes_a_training_arguments_class_only():
    with pytest.raises(TypeError, match=r"expected a TrainingArguments subclass, as in SFTConfig"):
        with_memory_flags(dict)
    assert with_memory_flags(MemoptTrainingArguments) is MemoptTrainingArguments


def test_trls_sft_config_keeps_its_defaults_with_the_memory_flags(tmp_path):
    trl = pytest.importorskip("trl")
    Args = with_memory_flags(trl.SFTConfig)
    argv = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--gradient_checkpointing", "false"]
    (ours,) = HfArgumentParser(Args).parse_args_into_dataclasses(argv + ["--memory_opt_backend", "none"])
    (theirs,) = HfArgumentParser(trl.SFTConfig).parse_args_into_dataclasses(argv)
    assert _differences(ours, theirs, [f.name for f in dataclasses.fields(trl.SFTConfig)]) == {}
    assert ours.learning_rate == trl.SFTConfig.learning_rate != TrainingArguments.learning_rate
