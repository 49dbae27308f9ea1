"""One rank of a 2-process run (gloo on CPU) of a dry run's step on real tensors, sharded with FSDP2: `dry_run(spec,
fake=False)` with `spec.fsdp` 2 under the launch's process group, counted as a dry run counts, so that the dry run in
one process (a fake process group) is held to what each of two real processes holds. Usage: worker_plan.py OUT
NAME=MODE [NAME=MODE ...], each MODE `eager` (no backend) or `level1`, run one after the other in this one launch.
Writes OUT/NAME/rank{r}.json: the peak, what is held before training, the parts at the peak and where it is, each
step's peak."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402
from helpers import announce, end_distributed_worker  # noqa: E402
from test_plan import fsdp_spec  # noqa: E402

from optimum_memopt.planning.dry_run import dry_run  # noqa: E402


def run(mode, out):
    result = dry_run(fsdp_spec(), fake=False, **({"backend": False} if mode == "eager" else {"level": 1}))
    record = {
        "peak": result.peak_bytes,
        "before": result.before_training_bytes,
        "parts": result.parts,
        "peak_at": result.peak_at,
        "step_peaks": result.step_peaks,
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(record, f)


def main(out, named):
    dist.init_process_group("gloo")
    for name, mode in (n.split("=", 1) for n in named):
        announce(name)
        run(mode, os.path.join(out, name))
    end_distributed_worker()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
