"""One rank of a 2-process FSDP2 run on CPU (gloo): a small Llama whose layers are sharded with `fully_shard`
(`reshard_after_forward=True`: each layer's parameters are freed after its forward and gathered again for its
backward), trained in a plain loop. The torch backend wraps the model first, as in the Trainer (accelerate shards
after `_wrap_model`). Usage: worker_fsdp2.py OUT NAME=MODE [NAME=MODE ...], each MODE one of `none` (no backend),
`level1`, `plan:CONFIG`, `auto:BUDGET` (`optimize_memory(model, "auto", budget_mb=BUDGET)`, a vocabulary of
`AUTO_VOCAB` (`none-wide`: no backend at that vocabulary): the root module's gathered weights, the embeddings and
the head, 512 KiB each; BUDGET `below:K`: the
peak the last `auto` mode's first choice predicted, less K MiB) or `auto-steps:BUDGET` (the same, the loop reporting
its steps: `reports_steps=True`, `step_done()` after each optimizer step, so that the levers measure their ways
between step one and step two), trained one after the other in this one launch (a fresh model, its own checks
each).

While training, every recomputation is checked to see unsharded parameters: a recipe's inputs are plain tensors
with their storage present when it replays, and a layer recomputed whole finds its projections' weights gathered.
Writes OUT/NAME/rank{r}.json: the losses, the checks counted, a checksum of the trained (gathered) parameters."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from helpers import announce, end_distributed_worker  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import optimum_memopt  # noqa: E402
from optimum_memopt.backends.base import WrapSettings  # noqa: E402
from optimum_memopt.backends.torch.apply import recipe  # noqa: E402
from optimum_memopt.backends.torch.backend import TorchBackend  # noqa: E402
from optimum_memopt.backends.torch.nested import tensors_in  # noqa: E402
from optimum_memopt.plans import parse_plans  # noqa: E402

STEPS, ROWS, SEQ, VOCAB = 6, 4, 32, 128
AUTO_VOCAB = 2048
checks = {}  # the current mode's counts (`train` starts them at 0)
replayed = set()  # the ops recipes replayed in the current mode


def checked_outputs(real):
    def outputs(self):
        if self.value is None and self.args is not None:
            checks["recipe_replays"] += 1
            replayed.add(self.func.overloadpacket.__name__)
            for t in tensors_in((self.args, self.kwargs)):
                checks["recipe_inputs"] += 1
                checks["parameter_inputs"] += isinstance(t, torch.nn.Parameter) or isinstance(
                    t._base, torch.nn.Parameter
                )
                if isinstance(t, DTensor) or (t.numel() and t.untyped_storage().nbytes() == 0):
                    checks["sharded_seen"] += 1
        return real(self)

    return outputs


last_auto = {}  # the last `auto` mode's solver figures (`auto:below:K`)


def train(mode, out, mesh):
    rank = dist.get_rank()
    checks.update(recipe_replays=0, recipe_inputs=0, parameter_inputs=0, layer_recomputes=0, sharded_seen=0)
    replayed.clear()
    torch.manual_seed(0)  # the same initial weights on every rank: fully_shard keeps this rank's slice of them
    auto = mode.startswith(("auto:", "auto-steps:"))
    reports = mode.startswith("auto-steps:")
    vocab = AUTO_VOCAB if auto or mode == "none-wide" else VOCAB
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, attn_implementation="sdpa",
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    handle = None
    if auto:
        budget = mode.partition(":")[2]
        if budget.startswith("below:"):
            budget = last_auto["fits"][0]["predicted_peak_mb"] - float(budget[len("below:") :])
        handle = optimum_memopt.optimize_memory(
            model, "auto", budget_mb=float(budget), reports_steps=reports, say=lambda text: None
        )
    elif mode not in ("none", "none-wide"):
        entries = parse_plans(mode[len("plan:") :]) if mode.startswith("plan:") else []
        model = TorchBackend().wrap(model, WrapSettings(entries=entries, level=1 if mode == "level1" else 0))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)

    def gathered(module, args):  # a projection's forward (the first, or a whole layer's recompute in backward)
        if torch.is_grad_enabled() and module.training:
            checks["layer_recomputes"] += torch._C._current_graph_task_id() != -1
            if isinstance(module.weight, DTensor) or module.weight.untyped_storage().nbytes() == 0:
                checks["sharded_seen"] += 1

    for layer in model.model.layers:
        layer.mlp.gate_proj.register_forward_pre_hook(gathered)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
    losses = []
    model.train()
    for _ in range(STEPS):
        ids = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if reports:
            handle.step_done()
        losses.append(loss.item())
    checksum = sum(float(p.detach().full_tensor().double().sum()) for p in model.parameters())
    state = getattr(model, "_memopt_recompute", None)
    result = {
        "losses": losses,
        "checks": checks,
        "replayed": sorted(replayed),
        "checksum": checksum,
        "policy": state.policy.describe() if state is not None else None,
        "layer_class": type(model.model.layers[0]).__name__,
    }
    if handle is not None:
        figures = handle.solver_figures()
        last_auto.update(figures)
        result["auto"] = {
            "budget_mb": figures["budget_mb"], "fits": figures["fits"], "verified": figures["verified"],
            "lever_candidates": {name: [c["config"] for c in cands] for name, cands in figures["lever_candidates"].items()},
            "measured": sorted(handle.profile.levers), "problems": dict(handle.profile.lever_problems),
        }  # fmt: skip
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main(out, modes):
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    recipe.Recipe.outputs = checked_outputs(recipe.Recipe.outputs)  # counts only where a backend's recipes replay
    for named in modes:
        name, mode = named.split("=", 1)
        announce(name)
        train(mode, os.path.join(out, name), mesh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
    end_distributed_worker()
