#!/usr/bin/env python
"""Sequence classification (GLUE-style, single sentences or pairs) through ORTModule with the
memory optimizer.

Data: `--task_name` (GLUE from the hub), or `--train_file` / `--validation_file` (CSV or JSON with
a `label` column and `sentence` or `sentence1`/`sentence2`), or nothing: generated sentences.
Model: `--model_name_or_path` (hub name or local directory), or nothing: a DeBERTa-v2
(`--model_type roberta` for RoBERTa) built from a config in code with a tokenizer trained locally.

Run with no arguments for the offline default.
"""

import logging
import os
import sys
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import transformers
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    DataCollatorWithPadding,
    HfArgumentParser,
    set_seed,
)

from optimum_memopt import MemoptTrainingArguments
from optimum_memopt.trainer import MemoptTrainer
from optimum_memopt.transformers_releases import overwrite_output_dir_flag

logger = logging.getLogger("run_glue")

TASK_KEYS = {
    "cola": ("sentence", None),
    "mnli": ("premise", "hypothesis"),
    "mrpc": ("sentence1", "sentence2"),
    "qnli": ("question", "sentence"),
    "qqp": ("question1", "question2"),
    "rte": ("sentence1", "sentence2"),
    "sst2": ("sentence", None),
    "stsb": ("sentence1", "sentence2"),
    "wnli": ("sentence1", "sentence2"),
}
OFFLINE_DEFAULT_ARGS = [
    "--output_dir",
    "outputs/run_glue",
    *overwrite_output_dir_flag(),
    "--do_train",
    "--do_eval",
    "--max_steps",
    "30",
    "--per_device_train_batch_size",
    "16",
    "--learning_rate",
    "3e-4",
    "--logging_steps",
    "5",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--memory_opt_config",
    "Gelu+:1:-1",
    "--print_memory_stats",
    "--print_input_density",
    "--input_density_table_steps",
    "10",
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
    task_name: Optional[str] = field(
        default=None, metadata={"help": "GLUE task, loaded from the hub.", "choices": sorted(TASK_KEYS)}
    )
    train_file: Optional[str] = field(default=None, metadata={"help": "CSV or JSON training file."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "CSV or JSON validation file."})
    max_seq_length: int = field(default=128, metadata={"help": "Longer inputs are truncated."})
    pad_to_max_length: bool = field(
        default=False, metadata={"help": "Pad every batch to max_seq_length instead of its longest row."}
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep only this many training rows."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep only this many evaluation rows."})
    offline_train_samples: int = field(
        default=2000, metadata={"help": "Generated training rows when no data is given."}
    )
    offline_pairs: bool = field(
        default=False, metadata={"help": "Generate sentence pairs instead of single sentences."}
    )


def parse(argv: Optional[List[str]] = None):
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, MemoptTrainingArguments))
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(os.path.abspath(argv[0]))
    if not argv:
        argv = OFFLINE_DEFAULT_ARGS
    return parser.parse_args_into_dataclasses(argv)


def load_raw(data_args, model_args):
    import datasets

    if data_args.task_name:
        return datasets.load_dataset("nyu-mll/glue", data_args.task_name, cache_dir=model_args.cache_dir)
    if data_args.train_file or data_args.validation_file:
        files = {k: v for k, v in (("train", data_args.train_file), ("validation", data_args.validation_file)) if v}
        for split, path in files.items():
            if not os.path.isfile(path):
                raise ValueError(f"`--{split}_file` {path!r} does not exist")
        ext = os.path.splitext(next(iter(files.values())))[1].lstrip(".").lower()
        if ext not in ("csv", "json", "jsonl"):
            raise ValueError(f"`--train_file` / `--validation_file` must be .csv or .json, got {ext!r}")
        return datasets.load_dataset("json" if ext.startswith("json") else "csv", data_files=files)
    from optimum_memopt.offline_defaults import classification_rows

    n = data_args.offline_train_samples
    return datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(classification_rows(n, seed=0, pairs=data_args.offline_pairs)),
            "validation": datasets.Dataset.from_list(
                classification_rows(max(64, n // 10), seed=1, pairs=data_args.offline_pairs)
            ),
        }
    )


def text_keys(raw, data_args):
    if data_args.task_name:
        return TASK_KEYS[data_args.task_name]
    columns = [c for c in next(iter(raw.values())).column_names if c != "label"]
    if "sentence1" in columns and "sentence2" in columns:
        return "sentence1", "sentence2"
    if "sentence" in columns:
        return "sentence", None
    if len(columns) >= 2:
        return columns[0], columns[1]
    return columns[0], None


def build_model(model_args, data_args, raw, num_labels):
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(
            model_args.config_name or model_args.model_name_or_path,
            num_labels=num_labels,
            cache_dir=model_args.cache_dir,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            model_args.tokenizer_name or model_args.model_name_or_path, cache_dir=model_args.cache_dir
        )
        model = AutoModelForSequenceClassification.from_pretrained(
            model_args.model_name_or_path,
            config=config,
            cache_dir=model_args.cache_dir,
            attn_implementation=model_args.attn_implementation,
        )
        return tokenizer, model
    from optimum_memopt.offline_defaults import model_config, train_tokenizer

    s1, s2 = text_keys(raw, data_args)
    corpus = list(raw["train"][s1]) + (list(raw["train"][s2]) if s2 else [])
    tokenizer = (
        AutoTokenizer.from_pretrained(model_args.tokenizer_name)
        if model_args.tokenizer_name
        else train_tokenizer(corpus)
    )
    config = model_config(
        model_args.model_type, model_args.model_size, len(tokenizer), tokenizer.pad_token_id, num_labels=num_labels
    )
    return tokenizer, AutoModelForSequenceClassification.from_config(config)


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
    label_list = sorted(set(raw["train"]["label"])) if "train" in raw else [0, 1]
    tokenizer, model = build_model(model_args, data_args, raw, len(label_list))
    s1, s2 = text_keys(raw, data_args)
    padding = "max_length" if data_args.pad_to_max_length else False

    def tokenize(batch):
        texts = (batch[s1],) if s2 is None else (batch[s1], batch[s2])
        out = tokenizer(*texts, padding=padding, max_length=data_args.max_seq_length, truncation=True)
        out["labels"] = [label_list.index(x) for x in batch["label"]]
        return out

    with training_args.main_process_first(desc="tokenizing"):
        encoded = raw.map(tokenize, batched=True, remove_columns=raw["train"].column_names if "train" in raw else None)
    train_ds = encoded.get("train")
    eval_ds = encoded.get("validation_matched" if data_args.task_name == "mnli" else "validation")
    if train_ds is not None and data_args.max_train_samples:
        train_ds = train_ds.select(range(min(data_args.max_train_samples, len(train_ds))))
    if eval_ds is not None and data_args.max_eval_samples:
        eval_ds = eval_ds.select(range(min(data_args.max_eval_samples, len(eval_ds))))

    def accuracy(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"accuracy": float((np.argmax(preds, axis=-1) == p.label_ids).mean())}

    trainer = MemoptTrainer(
        model=model,
        args=training_args,
        train_dataset=train_ds if training_args.do_train else None,
        eval_dataset=eval_ds if training_args.do_eval else None,
        processing_class=tokenizer,
        data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=None),
        compute_metrics=accuracy,
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
    if trainer.is_world_process_zero():
        files = [
            f
            for f in ("memory_plans.json", "memory_phases.csv", "memory_phases.png", "input_density.csv")
            if os.path.exists(os.path.join(training_args.output_dir, f))
        ]
        logger.info("memory reports in %s: %s", training_args.output_dir, ", ".join(files) or "none")
    return results


if __name__ == "__main__":
    main()
