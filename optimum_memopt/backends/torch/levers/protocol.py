"""The lever protocol: what a lever beyond the layers' recompute is to the rest of the backend.

A lever is one package of `levers/` (or a module), registered by its plan name (`levers.REGISTERED`), whose `LEVER`
is a subclass of `Lever`. It has five parts, and the backend, the engine, the planner and the table reach each
through this class only:

1. **Its grammar**: `syntax`, a `plans.LeverSyntax` (its name, its plan word, whether it acts in layers, its
   parameter's words). The plan grammar parses every lever's entries alike; the policy holds each lever's option as
   `{name: option}` (`RecomputePolicy.levers`), a `plans.LeverOption`: its parameter as data (chunks, 8; none: its
   default) and, where it acts in layers, the layers (0-7), one part an entry. `syntax.plan_of(option)` writes an
   option back as plans, for messages and files.
2. **Its mechanism**: `build` on the model being wrapped (where the plans ask for it, or where `auto`'s budget wants
   its options measured; refused with the reason where it cannot run), `install` / `remove` (removal whole: the
   model as it was), `run_as(option)` between steps (the solver's choice), `option` (what runs now); `onto_twin`
   (what of the model's forward it knows the step runs, put back on `auto`'s dry-run twin).
3. **Its measurement**: `after_step_one(profile, resets)`, between step one and step two: each option's bytes by
   segment and its seconds, read aside on the step's shapes, stored as pure data in `profile.levers[name]` (or why
   not in `profile.lever_problems[name]`); or, where the run's own dry run measured the same step before step one,
   that measurement taken over (`adopt`), nothing run again, until a choice is made again from step one (the
   measurement then runs: the layers' op times are the run's own clock, and the levers' seconds must be too). A
   lever acting inside the layers names its modules (`marks`): step one's segments then hold the peak of each
   stretch those modules run in (`profile.Segment.parts`). The modules its measurement runs alone
   (`measured_modules`) have their weights gathered for it where FSDP2 shards them (`sharding.gathered`).
4. **Its rows for the table**: `rows(profile, drop)` (one `FoundPlan` per option measured; `drop` gives PEAK DROP for
   an option's `LeverChoice`s) and `notes(profile)`.
5. **Its options for the solver**: `choices(profile, measured)`, `budget.LeverChoice`s: the bytes each option holds
   less than the measured step's by segment (or by a segment's stretch: `less_parts`), its seconds on the compute's
   path, the work that overlaps compute (an offload's copy) against the window it hides in, and the layers it needs
   recomputed whole (`recomputed`). The solver searches the product of the levers' options around
   the layers' programme (`budget.fit`).

The defaults below are a lever that measures nothing and offers only what it runs.
"""

from typing import Callable, ClassVar, Dict, List, Optional, Tuple

from ....plans import FoundPlan, LeverOption, LeverSyntax
from ..decide.budget import LeverChoice


class Lever:
    """One lever on one model (see the module's docstring for the protocol)."""

    syntax: ClassVar[LeverSyntax]
    name: ClassVar[str]  # `syntax.name`: the key of the policy's, the engine's and the profile's levers

    # -- its mechanism ------------------------------------------------------------------------------------------
    @classmethod
    def build(
        cls, model, settings, option: Optional[LeverOption], n_layers: int
    ) -> Tuple[Optional["Lever"], Optional[str]]:
        """The lever on `model` (being wrapped with `settings`, its `n_layers` layers), installed where the plans ask
        for it (`option`: what the policy holds for it, `RecomputePolicy.levers`; None where the plans do not name
        it), or there to be measured for `auto`'s budget; or None, with why not where the table should say it (None:
        nothing to say). A lever asked for that cannot run raises ValueError naming its plan and the reason (never
        trains silently without it)."""
        raise NotImplementedError

    @classmethod
    def onto_twin(cls, model, twin) -> None:
        """Put back on `twin` (`decide.from_plan.twin_of(model)`: `auto`'s dry run's copy of the model, with every
        forward set on an instance dropped) what of `model`'s forward the lever knows the step runs: a head another
        library installed on the instance (TRL's). `decide.from_plan.NoTwin` where the twin cannot run it as the step
        does (no dry run then: step one measures, and the reason is said). By default, nothing."""

    def install(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        """Take everything the lever put on the model off (the model as it was before `build`)."""
        raise NotImplementedError

    def run_as(self, option: Optional[LeverOption]) -> None:
        """Run `option` from the next step on (a policy's option; None: the lever off)."""
        raise NotImplementedError

    @property
    def option(self) -> Optional[LeverOption]:
        """The option running now (None: off)."""
        raise NotImplementedError

    def plan(self) -> str:
        """The option running now as a plan entry ("" off)."""
        return self.syntax.plan_of(self.option)

    def around_layer(self, index: int, forward: Callable[[], object]):
        """Layer `index`'s training forward, `forward()`, run as the lever needs it run (the engine calls it for every
        layer, every lever, inside the layer's forward: an option carried out at a step's first layer holds there
        too); returns what `forward()` returned. By default, run as it is."""
        return forward()

    def at_layer(self, index: int):
        """What the lever does to layer `index`'s training forward now, as a value two layers' can be told alike by
        (a dry run replays a layer from another's record only where these agree: `measure.replay`); `RUN_ALWAYS` where
        the layer must run (what the lever does there is not in a storage count alone). By default None: nothing."""
        return None

    def layer_recorded(self, index: int, count, kept: List[tuple]):
        """A dry run recorded layer `index`'s training forward (`measure.replay`; `count`: the step's `PartsCount`,
        `kept`: the identities of the storages the forward kept, in the record's order): what the lever did to the
        layer beyond the count's storages (an offload's copies on the host), as a value an alike layer's record must
        equal and `layer_replayed` does again from. By default None: nothing."""
        return None

    def layer_replayed(self, index: int, record, kept: Dict[int, object], out) -> object:
        """Layer `index` replayed in a dry run from an alike layer's record (`record`: `layer_recorded`'s; `kept`: the
        stand-ins for the storages the record kept, by place; `out`: the replayed layer's output): the lever's part
        done again (an offload's copies counted on the host, its fetch as backward reaches the layer). What it returns
        the replayed layer holds until its backward starts (`layer_backward`). By default nothing."""
        return None

    def layer_backward(self, index: int, held) -> List[object]:
        """Layer `index`'s backward starts in a dry run that records or replays it (`held`: what `layer_replayed`
        returned for a replayed layer, None for a recorded one): the tensors the lever made for the layer since its
        forward that its backward lets go of (an offload's fetched copies). By default none."""
        return []

    def host_peak(self) -> int:
        """What the lever held in the host's memory at its most (an offload's copies), in bytes; 0 by default."""
        return 0

    def smooths_labels(self) -> bool:
        """Whether the loss the lever computes applies the Trainer's label smoothing itself."""
        return False

    # -- its measurement ----------------------------------------------------------------------------------------
    def marks(self) -> List[Tuple[object, str]]:
        """The modules inside the layers the lever acts on, each with a name: the step's watch reads the stretches
        each runs in apart (its forward, its backward: `engine.RecomputeState.mark_inside`, `profile.Segment.parts`),
        which its options' `LeverChoice.less_parts` move. By default none."""
        return []

    def after_step_one(self, profile, resets: bool) -> None:
        """Between step one and step two: measure each option into `profile.levers[name]` (or say why not in
        `profile.lever_problems[name]`). `resets`: whether the device's peak may be reset to read aside."""

    def measured_modules(self) -> List[object]:
        """The modules `after_step_one` runs alone (the head; one MLP): where FSDP2 shards their weights, the engine
        gathers them for it (`sharding.gathered`). By default none."""
        return []

    def adopt(self, measured, profile) -> bool:
        """Between step one and step two, in place of `after_step_one`: take `measured`, this lever's measurement of
        the same step in the run's own dry run before step one (its `profile.levers[name]`: the step's shapes, on fake
        tensors, every figure as the device counts it, the seconds on the dry run's clock), into `profile.levers[name]`
        as what step one's measurement would hold, and return True; False where it does not stand for the step that
        ran (a way step one ran that the dry run did not measure; a measurement that depends on the device itself),
        and the lever measures. The rule: a measurement is taken over only where its bytes are the shapes' alone,
        and is said to be the dry run's in the lever's notes. By default, never."""
        return False

    # -- its rows and its options ---------------------------------------------------------------------------------
    def choices(self, profile, measured=None) -> List[LeverChoice]:
        """The options the solver may choose, from what was measured; `measured`: the policy the measured step ran
        (`RecomputePolicy`: what the layers kept or recomputed then). By default the option running now alone."""
        option = self.option
        return [LeverChoice(self.name, option, self.plan())]

    def unweighed(self, profile) -> Optional[str]:
        """Why the solver was offered none of the lever's options but the one the step ran, though it has others
        (not measured each way, or never chosen): said where `auto` finds nothing that fits, so that a refusal never
        passes for the least the levers reach. None where they were weighed. By default None."""
        return None

    def rows(self, profile, drop: Optional[Callable[[List[LeverChoice]], dict]]) -> List[FoundPlan]:
        """The table's rows for the options measured (`drop(choices)`: the PEAK DROP fields of a row whose options
        move the step as `choices` do)."""
        return []

    def notes(self, profile) -> List[str]:
        """What the table's notes say of the lever: how it ran, how it was measured or why not."""
        return []
