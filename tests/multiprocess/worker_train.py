"""Worker for the 2-process tests: `torchrun --nproc_per_node 2 worker_train.py OUT BACKEND NAME=MODE [NAME=MODE ...]`,
each MODE trained one after the other in this one launch (a fresh model and Trainer each), reporting to OUT/NAME.

MODE: ddp | zero1 | zero2 | fsdp (`--fsdp full_shard`, which trains as DDP on the CPU) | single (world of 1, same global batch) | fail_rank1 | auto:MIB (`--memory_opt_config
auto --memory_budget_mb MIB` on the tiny decoder, DDP, torch backend; step one runs a dry run's choice) | auto-measure:MIB (the
same, step one measuring with every layer recomputed whole) | auto-zero2:MIB (under ZeRO-2) | auto-zero2-lengths:MIB (ZeRO-2, `Lengths`) | auto-lengths:MIB (DDP,
batches of two lengths, the longer first on rank 1) | auto-first:MIB (DDP, rank 1's first batch the only longer one) | auto-planfile:PATH (from a plan file,
rank 1's first batch longer than it planned) | decoder:PLANS
(the tiny decoder under DDP with `--memory_opt_config PLANS`, or without the plugin's backend for `none`). BACKEND:
ort | torch.
Each rank writes NAME/rank<N>.json with its losses, a parameter checksum and what the plugin did on it.
"""

import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from accelerate.state import AcceleratorState  # noqa: E402
from helpers import (  # noqa: E402
    ClsData,
    LossRecordingTrainer,
    Tokens,
    announce,
    end_distributed_worker,
    make_args,
    tiny_decoder,
    tiny_model,
    without_deepspeed_shm_build,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class CountingHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class SequentialTrainer(LossRecordingTrainer):
    # Same sample order in every mode, so the 2-rank global batch equals the single-process batch.
    def _get_train_sampler(self, *args, **kwargs):  # transformers 4.52 passes the dataset
        return torch.utils.data.SequentialSampler(self.train_dataset)


class Lengths(Tokens):
    """Sequences of 128 tokens, and of 256 for samples 12 to 15 and from 20 on: in order, 4 a rank, rank 0 takes the
    first batch of each step and rank 1 the second, so that rank 1's second step is the first batch longer than step
    one's, and in the third rank 0's is shorter than rank 1's (each rank's check decides as every rank does)."""

    lengths = (128, 256)  # short, long

    def __getitem__(self, i):
        seq = self.lengths[self.long(i)]
        ids = torch.randint(0, self.vocab, (seq,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}

    def long(self, i: int) -> bool:
        return 12 <= i < 16 or i >= 20


class FirstLonger(Lengths):
    """Sequences of 128 tokens but rank 1's first batch (samples 4 to 7), of 256: step one's longest is another
    rank's than rank 0, whose dry run chooses for both."""

    def long(self, i: int) -> bool:
        return 4 <= i < 8


class FirstBeyondPlan(FirstLonger):
    """`FirstLonger` of 256 tokens, rank 1's first batch of 512: beyond a plan file made for `Tokens`' 256."""

    lengths = (256, 512)


def auto(budget_mb: str, out: str, rank: int, how: str = "") -> None:
    """One rank chooses from both ranks' step one (or rank 0's dry run of it); both train its choice. `how`: words joined by
    `-`, each optional: a ZeRO stage (`zero2`: under DeepSpeed, else DDP); `measure` (no dry run); the batches:
    `lengths` (two lengths, `Lengths`), `first` (rank 1's first batch longer, `FirstLonger`) or `planfile`
    (`budget_mb` the path of a plan file made for `Tokens`, and rank 1's first batch longer than it planned,
    `FirstBeyondPlan`: the refusal is reported); else `Tokens`."""
    words = set(how.split("-")) - {""}
    zero = next((w for w in words if w.startswith("zero")), "")
    batches = next((w for w in words if w in ("lengths", "first", "planfile")), "")
    deepspeed = ["--deepspeed", os.path.join(ROOT, "examples", "configs", f"ds_{zero}.json")] if zero else []
    deepspeed += ["--memory_auto_dry_run", "false" if "measure" in words else "true"]
    budget = ["--memory_plan_file", budget_mb] if batches == "planfile" else ["--memory_budget_mb", budget_mb]
    args = make_args(
        out, "--max_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--ddp_backend", "gloo",
        "--memory_opt_backend", "torch", "--optim", "adamw_torch", "--memory_opt_config", "auto", *budget, *deepspeed,
    )  # fmt: skip
    data = {"lengths": Lengths, "first": FirstLonger, "planfile": FirstBeyondPlan}.get(batches, Tokens)(n=32)
    trainer = SequentialTrainer(model=tiny_decoder(), args=args, train_dataset=data)
    if batches == "planfile":
        try:
            trainer.train()
        except RuntimeError as e:  # refused before step one, on every rank alike (no collective left waiting)
            with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
                json.dump({"rank": rank, "refused": str(e), "steps": trainer.state.global_step}, f)
            return
    trainer.train()
    state = trainer.memopt_handle
    planner = state.planner
    params = torch.cat([p.detach().float().flatten() for p in trainer.plain_model.parameters()])
    report = {
        "rank": rank,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "wrapped": type(trainer.model_wrapped).__name__,
        "losses": trainer.losses,
        "param_sum": float(params.sum()),
        "planned": planner.planned.config() if planner.planned is not None else None,
        # the choice step one ran, as predicted before it (a dry run's or a plan file's figure)
        "planned_mb": planner.planned.predicted.peak_mb if planner.planned is not None else None,
        "ddp": planner.start.ddp,  # the processes the dry run of step one held DDP's gradient buckets for
        "configs": [f.config() for f in planner.fits],
        "predicted_mb": [f.predicted.peak_mb for f in planner.fits],
        "floor_mb": planner.fits[0].floor.peak_mb,
        "predicted_in": [f.predicted.where for f in planner.fits],
        "verified": planner.verified,
        "policy": [[lp.mode, sorted(lp.ops)] for lp in state.policy.layers],
        "batch": list(planner.planned_shape) if planner.planned_shape is not None else None,
        "earlier": planner.earlier,  # the choices for shorter batches before the last planner's
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def decoder(plans: str, out: str, rank: int) -> None:
    """The tiny decoder under DDP with the plans given by hand (`none`: no backend), 4 steps of 4 rows a rank."""
    memory = ["--memory_opt_backend", "none"] if plans == "none" else ["--memory_opt_backend", "torch"]
    memory += [] if plans == "none" else ["--memory_opt_config", plans]
    args = make_args(
        out, "--max_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "4", "--ddp_backend", "gloo",
        "--optim", "adamw_torch", *memory,
    )  # fmt: skip
    trainer = SequentialTrainer(model=tiny_decoder(), args=args, train_dataset=Tokens(n=32))
    trainer.train()
    handle = trainer.memopt_handle
    lever = handle.levers.get("loss") if handle is not None else None
    tiled = handle.levers.get("mlp") if handle is not None else None
    offload = handle.levers.get("offload") if handle is not None else None
    params = torch.cat([p.detach().float().flatten() for p in trainer.plain_model.parameters()])
    report = {
        "rank": rank,
        "wrapped": type(trainer.model_wrapped).__name__,
        "losses": trainer.losses,
        "param_sum": float(params.sum()),
        "param_abs_sum": float(params.abs().sum()),
        "head": dict(lever.last, calls=lever.calls) if lever is not None else None,
        "tiles": [tiled.tiles_at(i) for i in range(3)] if tiled is not None else None,
        # the layers whose saved tensors the last step copied to the host, and what waits there now (none)
        "offloaded": sorted(offload.mover.moved_bytes) if offload is not None and offload.mover else None,
        "on_host": offload.on_host() if offload is not None else None,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


def main(out, backend, named):
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(format="%(levelname)s %(name)s - %(message)s")  # as a user's script does
    environ = dict(os.environ)
    for name, mode in (n.split("=", 1) for n in named):
        announce(name)
        # each mode's Trainer starts as in a fresh process: the launch's environment as it was, accelerate's state (the
        # distributed type, a DeepSpeed plugin) set up anew
        os.environ.clear()
        os.environ.update(environ)
        AcceleratorState._reset_state(reset_partial_state=True)
        train(mode, os.path.join(out, name), backend, rank)


def train(mode, out, backend, rank):
    os.makedirs(out, exist_ok=True)
    if mode == "fail_rank1" and rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    if mode.startswith("auto"):  # auto:MIB (DDP) or auto-zero2:MIB
        how, budget = mode.split(":", 1)
        return auto(budget, out, rank, how[len("auto-") :])
    if mode.startswith("decoder:"):
        return decoder(mode[len("decoder:") :], out, rank)
    handler = CountingHandler()
    logging.getLogger("optimum_memopt").addHandler(handler)
    per_device = "8" if mode == "single" else "4"
    flags = [
        "--max_steps",
        "6",
        "--logging_steps",
        "2",
        "--per_device_train_batch_size",
        per_device,
        "--memory_opt_config",
        "Gelu+:1:-1",
        "--print_memory_stats",
        "--print_input_density",
        "--log_all_memory_metrics",
        "--input_density_table_steps",
        "3",
        "--ddp_backend",
        "gloo",
        "--memory_opt_backend",
        backend,
        "--optim",
        "adamw_ort_fused" if backend == "ort" else "adamw_torch",
        # the plugin's lines follow the Trainer's process log level: INFO on rank 0, the replicas' WARNING elsewhere
        "--log_level",
        "info",
    ]
    if mode.startswith("zero"):
        flags += ["--deepspeed", os.path.join(ROOT, "examples", "configs", f"ds_{mode}.json")]
    if mode == "fsdp":  # on the CPU accelerate does not turn it on: the Trainer wraps with DDP
        flags += ["--fsdp", "full_shard"]
    args = make_args(out, *flags)
    trainer = SequentialTrainer(model=tiny_model("deberta"), args=args, train_dataset=ClsData(n=64))
    trainer.train()
    params = torch.cat([p.detach().float().flatten() for p in trainer.plain_model.parameters()])
    callbacks = {type(cb).__name__: cb for cb in trainer.callback_handler.callbacks}
    report = {
        "rank": rank,
        "world": int(os.environ.get("WORLD_SIZE", "1")),
        "losses": trainer.losses,
        # transformers 5 multiplies each rank's loss by the number of processes when it averages tokens across
        # devices (the model takes loss kwargs): the logged figure is then world x the rank's mean.
        "loss_scale": int(os.environ.get("WORLD_SIZE", "1"))
        if getattr(args, "average_tokens_across_devices", False) and trainer.model_accepts_loss_kwargs
        else 1,
        "param_sum": float(params.sum()),
        "param_abs_sum": float(params.abs().sum()),
        "params": params.tolist(),
        "wrapped": f"{type(trainer.model_wrapped).__name__}({type(trainer.model).__name__})",
        "plan_tables": sum("recompute plan(s) found" in m for m in handler.messages),
        "density_tables": sum(m.startswith("Input density") for m in handler.messages),
        "phase_rows": len(callbacks["MemoryPhaseCallback"].rows),
        "density_rows": len(callbacks["InputDensityCallback"].rows),
        "plan_stats": callbacks["PlanStatsCallback"].report is not None,
        "logged_memopt_keys": sorted({k for h in trainer.state.log_history for k in h if k.startswith("memopt/")}),
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    logging.getLogger("optimum_memopt").removeHandler(handler)


if __name__ == "__main__":
    without_deepspeed_shm_build()
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    end_distributed_worker()
