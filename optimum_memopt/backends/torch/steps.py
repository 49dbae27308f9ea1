"""What the engine and `auto`'s planner say to each other at a step's boundary, one way each.

The engine (`apply.engine.RecomputeState`) tells the planner a step starts (`StepStart`: what it knows then, read
only) and before the run's first training forward; the planner answers with `Orders`, which the engine carries out
before the step's first layer runs. The planner writes no field of the engine's, and changes the layers' policy and
the levers' options only through `Orders`, at a step's start (tests/test_torch_budget.py holds a run's choices)."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .policy import RecomputePolicy


@dataclass(frozen=True)
class StepStart:
    """The engine's word that a training step starts (or, before the run's first, that its first forward comes)."""

    device: str  # the layers' device kind ("cuda", "cpu")
    n_layers: int
    running: Optional[List[int]]  # the layers a step runs, where it leaves some of the list out; None: every layer
    profile: object  # step one's `ModelProfile`, None before it ended
    policy: RecomputePolicy  # what the layers ran under in the step before
    levers: Dict[str, object]  # the levers beyond the layers on the model (`levers.protocol.Lever`), by name
    layer_lists: List[str]  # where the layers come from several lists, one line a list (`apply.layers.towers`)
    # a dry run's: one layer run alone under a configuration, on step one's argument shapes (`RecomputeState.probe`):
    # (the most its forward held, the most its backward held), each above the level before its forward; None where
    # it cannot be run so (a real step: its tensors would cost the device's memory)
    probe: Optional[Callable[[int, object], Optional[Tuple[int, int]]]] = None
    # where step one's levers took over the run's dry run's measurements (`Lever.adopt`): their ways run alone on the
    # device now, each lever's measurement made again as after step one (a choice made again from step one weighs
    # the levers' seconds on the run's own clock, as it weighs the layers' op times); None where nothing was taken
    remeasure: Optional[Callable[[], None]] = None


@dataclass(frozen=True)
class Orders:
    """What the planner asks of the engine for the step about to run; None: as before."""

    watch: object = None  # a `measure.watch.StepWatch` the step is watched with
    policy: Optional[RecomputePolicy] = None  # the layers' plans and the levers' options (`policy.levers`)
    running: Optional[List[int]] = None  # the layers the step runs (a dry run of it found some left out)
    # the levers' measurements of the step about to run made in the run's own dry run, by lever name: taken over after
    # the step (`Lever.adopt`) in place of running their ways again
    measured: Optional[Dict[str, object]] = None
