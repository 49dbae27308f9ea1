"""Levers beyond a layer's recompute, one package each, on one protocol (`protocol.Lever`): its grammar (how a plan
entry names it, its layers and its parameter: a `plans.LeverSyntax`), its mechanism (built on the model, installed,
run as an option, removed), its measurement (each option's bytes by segment and seconds, taken after step one into
the profile), its rows for the table and its options for the solver (`budget.LeverChoice`).

The layers' own levers (planned ops recomputed from recipes, a layer checkpointed whole) are the backend's core and
live across `apply/`, `measure/` and `decide/`. A lever here may use all three; none of them imports a lever: the
backend builds every registered lever on the model and hands them to the engine, the planner and the table, which
call the protocol's methods and read its data.

A new lever is a package here (its option, its mechanism, its measurement on the shared harness `measure.ways`) and
one line in `REGISTERED`: nothing else in the package names a lever (tests/test_levers.py holds it).

- `loss`: a causal LM's head and cross-entropy run over chunks of tokens, each chunk's logits recomputed in backward
  (`Loss+`).
- `mlp`: a decoder layer's MLP run over tiles of tokens, each tile's intermediates recomputed in backward (`MLP+`).
- `offload`: what a layer saves for backward copied to the host and fetched back ahead of its backward (`Offload+`).

This module stays light: it imports a lever's package only when its plan name is met or the backend builds it.
"""

import importlib
from typing import Dict, List, Optional

# The registration: each lever's plan name and its package (a name under this package, or a dotted path).
# fmt: off
REGISTERED: Dict[str, str] = {
    "Loss+": "loss",
    "MLP+": "mlp",
    "Offload+": "offload",
}
# fmt: on


def module_of(plan: str):
    """The module of the lever registered as `plan` (exactly as registered)."""
    path = REGISTERED[plan]
    return importlib.import_module(path if "." in path else f"{__name__}.{path}")


def syntax_of(subgraph: str):
    """The `LeverSyntax` of the lever whose plan name `subgraph` is, in any case; None for any other name."""
    plan = next((p for p in REGISTERED if p.lower() == subgraph.lower()), None)
    return None if plan is None else module_of(plan).LEVER.syntax


def lever_classes() -> List[type]:
    """Every registered lever's class, in registration order."""
    return [module_of(plan).LEVER for plan in REGISTERED]


def lever_class(name: str) -> Optional[type]:
    """The registered lever whose name (`Lever.name`: the key of the policy's, the state's and the profile's levers)
    is `name`, or None."""
    return next((c for c in lever_classes() if c.name == name), None)
