#!/usr/bin/env python
"""Run a training script with `torch._functorch.config.activation_memory_budget` set: what a current-PyTorch user
would try with `--torch_compile` before this plugin. Used by benchmarks/torch_backend.py:

    python benchmarks/compile_budget.py 0.5 examples/run_glue/run_glue.py --memory_opt_backend none --torch_compile ...

The budget is the share of the activations (by the partitioner's estimate) the compiled backward may keep; the
rest is recomputed (1.0: keep what the default partitioner keeps).
"""

import runpy
import sys

import torch._functorch.config as functorch_config


def main():
    if len(sys.argv) < 3:
        raise SystemExit("usage: compile_budget.py BUDGET SCRIPT [ARGS...]")
    functorch_config.activation_memory_budget = float(sys.argv[1])
    sys.argv = sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
