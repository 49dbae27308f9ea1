"""One rank of a 2-process DeepSpeed ZeRO-3 run on CPU (gloo) through the Trainer: a small Llama whose parameters
are partitioned, released after each submodule's forward and gathered again for its backward (the persistence
threshold, reuse distance and prefetch at 0, so that even this model's parameters are released). Usage:
worker_zero3.py OUT NAME=MODE [NAME=MODE ...], each MODE one of `none` (`--memory_opt_backend none`), `level1`,
`plan:CONFIG`, or `from:NAME` (NAME's mode resumed from its step-3 checkpoint), trained one after the other in this
one launch (a fresh model and Trainer each). Writes OUT/NAME/rank{r}.json: losses, the parameters' checksum, the
wrapper."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from helpers import (  # noqa: E402
    CausalData,
    LossRecordingTrainer,
    announce,
    end_distributed_worker,
    make_args,
    small_decoder,
    without_deepspeed_shm_build,
)

ZERO3 = {
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_prefetch_bucket_size": 0,
        "reduce_bucket_size": "auto",
    },
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


class SequentialTrainer(LossRecordingTrainer):
    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def train(mode, out, resume=None):
    rank = int(os.environ.get("RANK", "0"))
    memory = ["--memory_opt_backend", "none"] if mode == "none" else ["--memory_opt_backend", "torch"]
    if mode == "level1":
        memory += ["--memory_opt_level", "1"]
    elif mode.startswith("plan:"):
        memory += ["--memory_opt_config", mode[len("plan:") :]]
    args = make_args(
        out, "--max_steps", "6", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--ddp_backend", "gloo",
        "--optim", "adamw_torch", "--deepspeed", json.dumps(ZERO3), "--save_strategy", "steps", "--save_steps", "3",
        *memory,
    )  # fmt: skip
    model = small_decoder("llama", layers=2)
    trainer = SequentialTrainer(model=model, args=args, train_dataset=CausalData(n=64))
    trainer.train(resume_from_checkpoint=resume)
    import deepspeed

    params = trainer.model_wrapped.module.parameters() if hasattr(trainer.model_wrapped, "module") else []
    with deepspeed.zero.GatheredParameters(list(params)):
        checksum = sum(float(p.detach().double().sum()) for p in trainer.model_wrapped.module.parameters())
    report = {
        "rank": rank,
        "losses": trainer.losses,
        "checksum": checksum,
        "wrapped": type(trainer.model_wrapped).__name__,
        "stage": trainer.model_wrapped.zero_optimization_stage(),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def main(out, named):
    modes = dict(n.split("=", 1) for n in named)
    for name, mode in modes.items():
        resume = None
        if mode.startswith("from:"):
            resume = os.path.join(out, mode[len("from:") :], "checkpoint-3")
            mode = modes[mode[len("from:") :]]
        announce(name)
        train(mode, os.path.join(out, name), resume)


if __name__ == "__main__":
    without_deepspeed_shm_build()
    main(sys.argv[1], sys.argv[2:])
    end_distributed_worker()
