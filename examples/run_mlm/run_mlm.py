#!/usr/bin/env python
"""Masked language modelling through ORTModule with the memory optimizer.

Data: `--dataset_name` (+ `--dataset_config_name`, from the hub, e.g. wikitext), or `--train_file` /
`--validation_file` (.txt, one document per line; or CSV / JSON with a `text` column), or nothing:
generated text. Sequences are packed to `--max_seq_length` (no padding) and 15% of tokens are
masked, so ORT sees dense embeddings and sparse labels.
Model: `--model_name_or_path`, or nothing: a DeBERTa-v2 (`--model_type roberta` for RoBERTa) built
from a config in code with a tokenizer trained locally.

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
    AutoModelForMaskedLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    set_seed,
)

from optimum_memopt import MemoptTrainingArguments
from optimum_memopt.trainer import MemoptTrainer
from optimum_memopt.transformers_releases import overwrite_output_dir_flag

logger = logging.getLogger("run_mlm")

OFFLINE_DEFAULT_ARGS = [
    "--output_dir",
    "outputs/run_mlm",
    *overwrite_output_dir_flag(),
    "--do_train",
    "--do_eval",
    "--max_steps",
    "30",
    "--per_device_train_batch_size",
    "8",
    "--learning_rate",
    "5e-4",
    "--logging_steps",
    "5",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--max_seq_length",
    "128",
    "--memory_opt_config",
    "Gelu+:1:-1",
    "--print_memory_stats",
    "--print_input_density",
    "--disable_tqdm",
    "true",
]


@dataclass
class ModelArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Hub name or local directory of a pretrained model. Omit for a model built from a config in code."
        },
    )
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's."})
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer name or path, if not the model's."}
    )
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where to store downloads from the hub."})
    model_type: str = field(
        default="deberta-v2", metadata={"help": "Offline default family.", "choices": ["deberta-v2", "roberta"]}
    )
    model_size: str = field(
        default="small",
        metadata={"help": "Offline default size.", "choices": ["tiny", "small", "deberta-base-shape", "large"]},
    )
    attn_implementation: str = field(
        default="eager",
        metadata={
            "help": "Attention path; ORT 1.19 cannot differentiate BERT/RoBERTa's SDPA path.",
            "choices": ["eager", "sdpa"],
        },
    )


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(default=None, metadata={"help": "Dataset on the hub, e.g. wikitext."})
    dataset_config_name: Optional[str] = field(
        default=None, metadata={"help": "Its configuration, e.g. wikitext-2-raw-v1."}
    )
    train_file: Optional[str] = field(default=None, metadata={"help": "Training text (.txt, .csv or .json)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Validation text (.txt, .csv or .json)."})
    max_seq_length: int = field(default=512, metadata={"help": "Length of the packed sequences."})
    mlm_probability: float = field(default=0.15, metadata={"help": "Share of tokens to mask."})
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only this many packed training sequences."}
    )
    max_eval_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep only this many packed evaluation sequences."}
    )
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


def build_model(model_args, data_args, raw):
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(
            model_args.config_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
        )
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
        )
        model = AutoModelForMaskedLM.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            cache_dir=model_args.cache_dir,
            attn_implementation=model_args.attn_implementation,
        )
        return tokenizer, model
    from optimum_memopt.offline_defaults import model_config, train_tokenizer

    tokenizer = (
        AutoTokenizer.from_pretrained(model_args.tokenizer_name)
        if model_args.tokenizer_name
        else train_tokenizer(list(raw["train"]["text"]))
    )
    config = model_config(
        model_args.model_type,
        model_args.model_size,
        len(tokenizer),
        tokenizer.pad_token_id,
        max_positions=max(512, data_args.max_seq_length),
    )
    return tokenizer, AutoModelForMaskedLM.from_config(config)


def main(argv: Optional[List[str]] = None):
    model_args, data_args, training_args = parse(argv)
    # As transformers' example scripts do: INFO on the main process, the replicas' level elsewhere. The
    # plugin's lines (logger "optimum_memopt") follow the same process log level.
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
    tokenizer, model = build_model(model_args, data_args, raw)
    text_column = (
        "text" if "text" in next(iter(raw.values())).column_names else next(iter(raw.values())).column_names[0]
    )
    block = min(data_args.max_seq_length, tokenizer.model_max_length)

    def tokenize(batch):
        return tokenizer([t for t in batch[text_column] if t and not t.isspace()], return_special_tokens_mask=True)

    def pack(batch):
        joined = {k: list(chain(*batch[k])) for k in batch}
        total = (len(joined["input_ids"]) // block) * block
        return {k: [v[i : i + block] for i in range(0, total, block)] for k, v in joined.items()}

    with training_args.main_process_first(desc="tokenizing and packing"):
        columns = next(iter(raw.values())).column_names
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
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=data_args.mlm_probability),
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
