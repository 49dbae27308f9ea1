#!/usr/bin/env python
"""Causal language modelling (fine-tuning a Llama / Qwen-style decoder) with the memory optimizer, on the torch
backend (the modern stack: current torch, transformers 5.x).

Data: `--dataset_name` (+ `--dataset_config_name`, from the hub), or `--train_file` / `--validation_file` (.txt,
one document per line; or CSV / JSON with a `text` column), or nothing: generated text. Sequences are packed to
`--block_size` (no padding); the labels are the inputs (the model shifts them).
Model: `--model_name_or_path` (a hub name or a local directory), or nothing: a decoder of `--model_type` (llama,
qwen2, qwen3) and `--model_size` built from a config in code, with a tokenizer trained locally.
LoRA: `--use_peft` (with `--lora_r`, `--lora_alpha`, `--lora_dropout`, `--lora_target_modules`) trains a PEFT
adapter on the frozen model; `save_model` then writes the adapter, which loads with PEFT alone.

Run with no arguments for the offline default.
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from itertools import chain
from typing import List, Optional

import transformers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    HfArgumentParser,
    default_data_collator,
    set_seed,
)

from optimum_memopt import MemoptTrainingArguments
from optimum_memopt.offline_defaults import DECODERS
from optimum_memopt.trainer import MemoptTrainer
from optimum_memopt.transformers_releases import overwrite_output_dir_flag

logger = logging.getLogger("run_clm")

OFFLINE_DEFAULT_ARGS = [
    "--output_dir", "outputs/run_clm", *overwrite_output_dir_flag(), "--do_train", "--do_eval",
    "--max_steps", "30", "--per_device_train_batch_size", "8", "--learning_rate", "5e-4", "--logging_steps", "5",
    "--report_to", "none", "--save_strategy", "no", "--block_size", "128",
    "--memory_opt_backend", "torch", "--use_peft", "--memory_opt_config", "auto", "--memory_budget_mb", "150",
    "--print_memory_stats", "--disable_tqdm", "true",
]  # fmt: skip


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={"help": "Hub name or local directory of a pretrained decoder. Omit for one built from a config."},
    )
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer name or path, if not the model's."}
    )
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where to store downloads from the hub."})
    model_type: str = field(default="llama", metadata={"help": "Offline default family.", "choices": list(DECODERS)})
    dtype: Optional[str] = field(
        default=None,
        metadata={
            "help": "Dtype of the pretrained weights as loaded; the installed transformers' default when omitted. "
            "Mixed precision is --bf16 / --fp16 (autocast over float32 weights).",
            "choices": ["auto", "float32", "bfloat16", "float16"],
        },
    )
    model_size: str = field(
        default="small",
        metadata={"help": "Offline default size.", "choices": ["tiny", "small", "deberta-base-shape", "large"]},
    )
    attn_implementation: str = field(
        default="sdpa", metadata={"help": "Attention path.", "choices": ["eager", "sdpa"]}
    )
    use_peft: bool = field(default=False, metadata={"help": "Train a LoRA adapter (PEFT) on the frozen model."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling (alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: str = field(
        default="all-linear",
        metadata={"help": "Modules to adapt: 'all-linear', or names joined by commas (q_proj,v_proj)."},
    )


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Dataset on the hub, e.g. wikitext."})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Its configuration."})
    train_file: Optional[str] = field(default=None, metadata={"help": "Training text (.txt, .csv or .json)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Validation text (.txt, .csv or .json)."})
    block_size: int = field(default=512, metadata={"help": "Length of the packed sequences."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep this many training blocks."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep this many evaluation blocks."})
    offline_lines: int = field(default=3000, metadata={"help": "Generated lines of text when no data is given."})


def parse(argv: Optional[List[str]] = None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, MemoptTrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(argv or OFFLINE_DEFAULT_ARGS)


def load_raw(data_args, model_args):
    from optimum_memopt.offline_defaults import text_datasets

    return text_datasets(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_file, data_args.validation_file,
        data_args.offline_lines, model_args.cache_dir,
    )  # fmt: skip


def build_model(model_args, data_args, raw, should_log=True):
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(
            model_args.config_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
        )
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
        )
        model = AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, config=config, cache_dir=model_args.cache_dir,
            attn_implementation=model_args.attn_implementation,
            **({"dtype": model_args.dtype} if model_args.dtype else {}),
        )  # fmt: skip
    else:
        from optimum_memopt.offline_defaults import model_config, train_tokenizer

        tokenizer = (
            AutoTokenizer.from_pretrained(model_args.tokenizer_name)
            if model_args.tokenizer_name
            else train_tokenizer(list(raw["train"]["text"]))
        )
        if not model_args.tokenizer_name:  # trained here for the model built here: as long as its positions
            tokenizer.model_max_length = max(tokenizer.model_max_length, data_args.block_size)
        config = model_config(
            model_args.model_type, model_args.model_size, len(tokenizer), tokenizer.pad_token_id,
            max_positions=max(512, data_args.block_size), attn_implementation=model_args.attn_implementation,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config)
    if model_args.use_peft:
        from peft import LoraConfig, get_peft_model

        targets = model_args.lora_target_modules
        if targets != "all-linear":
            targets = [t.strip() for t in targets.split(",") if t.strip()]
        lora = LoraConfig(
            task_type="CAUSAL_LM", r=model_args.lora_r, lora_alpha=model_args.lora_alpha,
            lora_dropout=model_args.lora_dropout, target_modules=targets,
        )  # fmt: skip
        model = get_peft_model(model, lora)
        if should_log:
            model.print_trainable_parameters()
    return tokenizer, model


def main(argv: Optional[List[str]] = None):
    model_args, data_args, training_args = parse(argv)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s - %(message)s", handlers=[logging.StreamHandler(sys.stdout)]
    )
    if training_args.should_log:
        transformers.utils.logging.set_verbosity_info()
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    set_seed(training_args.seed)
    raw = load_raw(data_args, model_args)
    tokenizer, model = build_model(model_args, data_args, raw, training_args.should_log)
    columns = next(iter(raw.values())).column_names
    text_column = "text" if "text" in columns else columns[0]
    block = min(data_args.block_size, tokenizer.model_max_length)
    if block < data_args.block_size:
        logger.warning(
            "`--block_size %d` is longer than the tokenizer's model_max_length (%d): packing to %d tokens",
            data_args.block_size, tokenizer.model_max_length, block,
        )  # fmt: skip

    def tokenize(batch):
        return tokenizer([t for t in batch[text_column] if t and not t.isspace()])

    def pack(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // block) * block
        blocks = {k: [v[i : i + block] for i in range(0, total, block)] for k, v in joined.items()}
        blocks["labels"] = [list(ids) for ids in blocks["input_ids"]]
        return blocks

    with training_args.main_process_first(desc="tokenizing and packing"):
        packed = raw.map(tokenize, batched=True, remove_columns=columns).map(pack, batched=True)
    train_ds, eval_ds = packed.get("train"), packed.get("validation")
    if train_ds is not None and data_args.max_train_samples:
        train_ds = train_ds.select(range(min(data_args.max_train_samples, len(train_ds))))
    if eval_ds is not None and data_args.max_eval_samples:
        eval_ds = eval_ds.select(range(min(data_args.max_eval_samples, len(eval_ds))))

    trainer = MemoptTrainer(
        model=model,
        args=training_args,
        train_dataset=train_ds if training_args.do_train else None,
        eval_dataset=eval_ds if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=default_data_collator,
    )
    results = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.save_state()
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)
        results.update(train_result.metrics)
    if training_args.do_eval and eval_ds is not None:
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        results.update(metrics)
    return results


if __name__ == "__main__":
    main()
