"""Tiny models built from configs in code, generated data, and a trainer that records exact losses."""

import csv
import os
import socket
import subprocess
import sys

import torch
from transformers import (
    DebertaV2Config,
    DebertaV2ForMaskedLM,
    DebertaV2ForSequenceClassification,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    RobertaConfig,
    RobertaForMaskedLM,
    RobertaForSequenceClassification,
    TrainerCallback,
)

from optimum_memopt import MemoptTrainingArguments
from optimum_memopt.trainer import MemoptTrainer

VOCAB = 128
SEQ = 32


def tiny_model(arch="deberta", task="cls", seed=0, attn=None):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=2,
    )
    if arch == "deberta":
        cfg = DebertaV2Config(max_position_embeddings=64, pad_token_id=0, **common)
        cls = DebertaV2ForSequenceClassification if task == "cls" else DebertaV2ForMaskedLM
    else:
        cfg = RobertaConfig(max_position_embeddings=SEQ + 4, pad_token_id=1, **common)
        cls = RobertaForSequenceClassification if task == "cls" else RobertaForMaskedLM
    if attn:
        cfg._attn_implementation = attn
    return cls(cfg)


def small_decoder(arch="llama", layers=2, seed=0):
    """A very small causal LM of a decoder family (llama, qwen2, qwen3: q/k RMS norms, explicit head_dim), for
    `CausalData`."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(head_dim=16, **common))
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**common))
    raise ValueError(f"no small decoder {arch!r}")


def tiny_decoder():
    """A small Llama-style decoder (3 layers, SDPA, sequences of 256 tokens: `Tokens`) whose step is big enough for
    the CPU's sampled memory to see each layer: the budget solver's model."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=256, attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences of one length, labelled with themselves (causal LM)."""

    def __init__(self, n=64, seq=256, vocab=512):
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        ids = torch.randint(0, self.vocab, (self.seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class ClsData(torch.utils.data.Dataset):
    """Variable-length sequences padded to SEQ; the label is learnable from the tokens."""

    def __init__(self, n=64, pad_id=0):
        self.n, self.pad_id = n, pad_id

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        length = 6 + (i * 7) % (SEQ - 6)
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        label = int(ids[:length].float().mean() > VOCAB / 2)
        ids[length:] = self.pad_id
        return {"input_ids": ids, "attention_mask": (torch.arange(SEQ) < length).long(), "labels": torch.tensor(label)}


class MlmData(torch.utils.data.Dataset):
    """Packed sequences with 15% of positions labelled."""

    def __init__(self, n=64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(2000 + i)
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        mask = torch.rand(SEQ, generator=g) < 0.15
        labels = torch.where(mask, ids, torch.full_like(ids, -100))
        ids = torch.where(mask, torch.full_like(ids, 2), ids)
        return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": labels}


class CausalData(MlmData):
    """MlmData's padded sequences as a causal LM's batch (labels = the inputs)."""

    def __getitem__(self, i):
        item = super().__getitem__(i)
        return {"input_ids": item["input_ids"], "attention_mask": item["attention_mask"], "labels": item["input_ids"]}


def make_args(output_dir, *flags):
    base = [
        "--output_dir",
        str(output_dir),
        "--per_device_train_batch_size",
        "8",
        "--report_to",
        "none",
        *(() if torch.cuda.is_available() else ("--use_cpu",)),
        "--seed",
        "42",
        "--learning_rate",
        "1e-3",
        "--save_strategy",
        "no",
        "--disable_tqdm",
        "true",
        "--dataloader_num_workers",
        "0",
    ]
    (args,) = HfArgumentParser(MemoptTrainingArguments).parse_args_into_dataclasses(base + list(flags))
    return args


class LossRecordingMixin:
    """Keeps every step's loss unrounded (the log history rounds to 4 digits)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.losses = []

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.losses.append(float(loss.detach()))
        return loss


class LossRecordingTrainer(LossRecordingMixin, MemoptTrainer):
    pass


class EventRecorder(TrainerCallback):
    """Records which callback events fired, in order."""

    def __init__(self):
        self.events = []

    def __getattribute__(self, name):
        if name.startswith("on_"):
            events = object.__getattribute__(self, "events")

            def record(args, state, control, **kwargs):
                events.append((name, state.global_step))

            return record
        return object.__getattribute__(self, name)


def train(arch="deberta", task="cls", flags=(), out=None, steps=20, recorder=None, model=None):
    model = model or tiny_model(arch, task)
    data = ClsData(pad_id=model.config.pad_token_id) if task == "cls" else MlmData()
    args = make_args(out, "--max_steps", str(steps), "--logging_steps", "1", *flags)
    trainer = LossRecordingTrainer(
        model=model, args=args, train_dataset=data, callbacks=[recorder] if recorder else None
    )
    trainer.train()
    return trainer


def load_without_ort(path) -> str:
    """Load a saved model in a fresh process where any import of onnxruntime fails; its class name."""
    code = (
        "import sys\nsys.modules['onnxruntime'] = None\n"
        "from transformers import AutoModelForSequenceClassification\n"
        f"print('LOADED', type(AutoModelForSequenceClassification.from_pretrained({str(path)!r})).__name__)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.split("LOADED", 1)[1].strip()


def phases_at(out_dir, step: int):
    """The phases recorded for one step in ``memory_phases.csv``."""
    with open(f"{out_dir}/memory_phases.csv") as f:
        return [r["phase"] for r in csv.DictReader(f) if r["step"] == str(step)]


ALL_PHASES = ["pre_forward", "post_forward", "pre_backward", "post_backward"]


# `--ort_loss_in_graph --load_best_model_at_end --label_smoothing_factor 0.1`, evaluating and saving every 2 steps
BEST_AT_END_IN_GRAPH = (
    "--eval_strategy steps --eval_steps 2 --save_strategy steps --save_steps 2 --load_best_model_at_end "
    "--label_smoothing_factor 0.1 --ort_loss_in_graph"
).split()


def without_deepspeed_shm_build() -> None:
    """A multi-process test worker's first call: DeepSpeed (0.15 and 0.19 seen) compiles its shared-memory all-reduce
    op (`deepspeed_shm_comm`, for inference's all-reduce on the CPU) the first time its communication starts in a
    process: 50-110 s of both cores of the CI machine, once per stack, inside whichever launch comes first. Training
    runs every collective through gloo here and never calls it: marked not compatible (DeepSpeed's own probe result,
    which it then skips the build on), nothing the tests check changes. Without DeepSpeed, nothing to do."""
    try:
        import deepspeed.ops
    except ImportError:
        return
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def end_distributed_worker():
    """A multi-process test worker's last call, once its report is written: every rank meets, the process groups
    are destroyed, and the process leaves without interpreter finalization. Gloo can abort a finished process during
    finalization (SIGABRT, "terminate called without an active exception"): seen under ZeRO-2 without
    `destroy_process_group()`, and once under ZeRO-3 with it (docs/STACK.md). Only reached when the worker's work
    returned; a worker that raises still exits with its traceback and a non-zero status."""
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def announce(name: str) -> None:
    """A multi-mode worker's line before each mode (`launch_modes` in tests/test_multiprocess.py): every rank has
    flushed what the mode before said, then rank 0 says `[worker] mode NAME` on the launch's stdout and stderr, which
    `said_in_modes` cuts at."""
    sys.stdout.flush()
    sys.stderr.flush()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"[worker] mode {name}", flush=True)
        print(f"[worker] mode {name}", file=sys.stderr, flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def said_in_modes(text: str) -> dict:
    """What a multi-mode launch said on one stream, cut at the workers' `announce` lines: {mode name: its part}."""
    said, name = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("[worker] mode "):
            name = line[len("[worker] mode ") :].strip()
            said[name] = ""
        elif name is not None:
            said[name] += line
    return said


def free_port() -> int:
    """A TCP port on the loopback nobody listens on now (a process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
