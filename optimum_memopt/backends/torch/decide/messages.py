"""What `auto` says, and why it stops: every sentence the budget planner says (`say`: the choice and its check, a line
each), writes for the verbose log (`detail`: the figures behind a choice) or raises, worded here from the figures the
planner hands over. The planner decides; this module words it (tests/test_torch_budget.py, tests/test_plan_file.py
and tests/test_auto_dry_run.py read these sentences).

The rules every message keeps: it names the flag and quotes the value the user gave (`asked`: the budget as given), it
gives the figures it rests on in MiB with where in the step they fall, and where it stops a run it says what to change,
as an accepted form of the flag.
"""

import math
from typing import List, Optional, Sequence

from ....memory import MIB, READABLE_DEVICES

AUTO = "`--memory_opt_config auto`"
BY_HAND = "`--memory_opt_config Layer+:1:-1,Loss+:1:-1,MLP+:1:-1@tiles8`"


def _solver_json(out_dir: Optional[str]) -> str:
    return f" (solver.json in {out_dir})" if out_dir else ""


# -- before step one ------------------------------------------------------------------------------------------------
def not_readable(device: str) -> str:
    return (
        f"{AUTO} reads memory on {' and '.join(READABLE_DEVICES)}, and this run's layers are on {device!r}; pass "
        f"plans instead, as in `--memory_opt_config Gelu+:1:-1`"
    )


def first_layer_idle(where: str, flag: str) -> str:
    return (
        f"{AUTO} measures step one from the first layer on, but {where}; nothing was measured or chosen, and no step "
        f"was trained. Pass plans for the layers that run instead, as in {flag}"
    )


def cannot_measure(problem: Exception) -> str:
    return (
        f"{AUTO} cannot measure this model's step: {problem}. Nothing was chosen, and no step was trained. Recompute "
        f"whole layers instead (`--memory_opt_level 1`)"
    )


def dry_run_found_nothing(asked: str, why_not: Optional[str]) -> str:
    return f"nothing fits {asked} in the dry run{': ' + why_not if why_not else ''}"


def dry_run_checked_nothing(asked: str, least_mb: float, config: str) -> str:
    return (
        f"nothing the dry run checked fits {asked}: the least a step of it measured was {least_mb:,.1f} MiB "
        f"(`--memory_opt_config {config}`)"
    )


def dry_run_failed(problem: Exception) -> str:
    return f"the dry run of step one failed ({type(problem).__name__}: {problem})"


def measures_whole(why: str) -> str:
    return f"memory_opt_config auto: step one measures with every layer recomputed whole: {why}"


def step_of(again: Optional[tuple]) -> str:
    """The step a choice is made for: the run's step one, or the step of a longer batch planned for again (`again`:
    its batch, tokens)."""
    return f"the step of {again[0]} x {again[1]:,} tokens" if again is not None else "step one"


def dry_run_chose(
    seconds: Optional[float],
    config: str,
    budget_mb: float,
    predicted,
    held: int,
    libraries: int,
    kept: str,
    whose: str = "",
    again: Optional[tuple] = None,
) -> str:
    """The dry run's choice, which step one runs: `config` its plans ("" none), `held` what the process holds outside
    the step (`libraries` of it the workspaces made before the dry run), `kept` where the choice went (or ""),
    `whose` the batch it planned where another rank's (`first_of_rank`), `again` the batch (batch, tokens) where it
    plans again for a longer one than the run's first (the step about to run, not the run's step one)."""
    step = step_of(again)
    took = f" in {seconds:,.1f} s" if seconds is not None else ""
    took += whose
    chose = f"`--memory_opt_config {config}`" if config else "to recompute nothing"
    outside = f", with {held / MIB:,.1f} MiB the process held outside the step" if held >= MIB / 10 else ""
    if outside and libraries:
        outside += f" ({libraries / MIB:,.1f} MiB of it cuBLAS's workspaces, made before the dry run)"
    return (
        f"memory_opt_config auto: a dry run of {step}{took} chose {chose}, under the budget of {budget_mb:,.1f} "
        f"MiB: predicted peak {predicted.peak_mb:,.1f} MiB ({predicted.where}{outside}); "
        f"{'that step' if again is not None else step} runs it and is measured to check it{kept}"
    )


def first_of_rank(shape: tuple, rank: int, size: int) -> str:
    """Where step one's dry run planned for another rank's first batch, longer than this one's."""
    batch = f"{shape[0]} x {shape[1]:,}"
    return f" (of rank {rank}'s batch of {batch} tokens, the longest first batch of the {size} processes)"


NOT_KEPT_NO_SHAPE = "memory_opt_config auto: the dry run's choice is not kept: the batch's shape was not read"


def could_not_keep(problem: Exception) -> str:
    return f" (its choice could not be kept for the next run: {problem})"


def kept_in(path: str) -> str:
    return f"; kept in {path}: `--memory_plan_file {path}` starts the next run of this step without one"


# -- a plan file's choice -------------------------------------------------------------------------------------------
def plan_file_other_batch(flag: str, planned, shape: tuple, rank: Optional[int] = None) -> str:
    """A plan file's batch is not the run's first (`rank`: the process whose first batch, longest of all, it is)."""
    whose = f"rank {rank}'s first batch" if rank is not None else "this run's first"
    return (
        f"{flag} planned batches of {planned.batch} x {planned.seq:,} tokens, and {whose} is "
        f"{shape[0]} x {shape[1]:,}; no step was trained. Plan this batch (`memopt-plan ... "
        f"--per_device_train_batch_size {shape[0]} --block_size {shape[1]}`), or drop `--memory_plan_file`"
    )


PLAN_FILE_NO_SHAPE = "; the batch's shape could not be read (no `input_ids` or `inputs_embeds`): step one checks it"


def batch_beyond_planned(
    shape: tuple,
    tokens: int,
    planned: tuple,
    planned_tokens: int,
    asked: str,
    predicted_mb: Optional[float],
    why_once: str,
) -> str:
    """A batch of more tokens than the choice's (`shape` and `planned`: batch, tokens) runs, where `auto` cannot plan
    again for it (`why_once`)."""
    figure = f" (predicted {predicted_mb:,.1f} MiB)" if predicted_mb is not None else ""
    now, then = " x ".join(map(str, shape)), " x ".join(map(str, planned))
    return (
        f"memory_opt_config auto: a batch of {now} tokens ({tokens:,}) runs, more than the {then} "
        f"({planned_tokens:,}) the choice under {asked} was made and checked for{figure}, and nothing plans again "
        f"for it here ({why_once}): a step of more tokens holds more than any figure said, and "
        f"may go over the budget. Give every batch the same length (pad to the longest, or pack), or let the longest "
        f"come first; said once"
    )


def stopped_for_longer(shape: tuple, earlier: List[dict]) -> str:
    """Said after a stop where it is for a batch longer than those planned before it (`earlier`, in order: each one's
    batch, and its choice's figures where one was made)."""
    now, last = " x ".join(map(str, shape)), earlier[-1]
    fitted = " x ".join(map(str, last["batch"]))
    figures, made = " (measured, no choice made for it yet)", ""
    if last.get("predicted_peak_mb") is not None:
        measured = last.get("measured_peak_mb")
        read = f", measured {measured:,.1f}" if measured is not None else ", not yet checked"
        figures, made = (
            f" (its choice predicted {last['predicted_peak_mb']:,.1f} MiB{read})",
            "which its choice was made for, ",
        )
    return (
        f". This is the step of a batch of {now} tokens ({math.prod(shape):,}), planned again after {fitted} "
        f"({math.prod(last['batch']):,}) ran{figures}: batches of at most that many tokens, {made}may keep the run "
        f"within the budget (TRL's `max_length`, where it pads each batch to its longest)"
    )


def planning_again(
    shape: tuple,
    planned: tuple,
    asked: str,
    inside: bool,
    rank: Optional[int] = None,
    measured: Optional[str] = None,
    chosen: bool = True,
) -> str:
    """`auto` plans again for a batch of more tokens than the one its choice was made and checked for; `inside`: the
    batch was a later micro-batch of the last step, which ran under the choice it found; `rank`: the process whose
    batch it is, where several train (each on its own: the longest of all is planned for); `measured`: why no dry run
    plans for it, where the step is measured again instead (with every layer recomputed whole); `chosen`: whether a
    choice was made for the shorter batch (else its step was measured, and the longer one came first)."""
    now, then = " x ".join(map(str, shape)), " x ".join(map(str, planned))
    tokens, planned_tokens = math.prod(shape), math.prod(planned)
    on = f" on rank {rank}" if rank is not None else ""
    if inside:
        which = f"a micro-batch of the last step{on} had {now} tokens ({tokens:,}), more than the {then}"
    else:
        which = f"a batch of {now} tokens ({tokens:,}) runs next{on}, more than the {then}"
    ran = ", and ran under it" if inside else ""
    made = (
        f"the choice under {asked} was made for" if chosen else f"the step measured under {asked} ran, no choice made"
    )
    if measured is not None:
        return (
            f"memory_opt_config auto: {which} ({planned_tokens:,}) {made}: measuring again for {now} (no dry run "
            f"here: {measured}): the step about to run recomputes every layer whole and is measured, the next runs "
            f"the choice made from it and is checked; later batches up to {tokens:,} tokens run it"
        )
    return (
        f"memory_opt_config auto: {which} ({planned_tokens:,}) {made}{ran}: planning again for {now}, as for step "
        f"one (a dry run of that batch chooses; the step about to run runs its choice and is measured and checked); "
        f"later batches up to {tokens:,} tokens run it"
    )


NO_BATCH_SHAPE = (
    "the batch's shape is not read (no `input_ids`, `inputs_embeds` or tensor of two dimensions among its inputs), "
    "so no batch is planned for again"
)


def plan_file_shorter(tokens: int, planned_tokens: int) -> str:
    return (
        f"; this batch has {tokens:,} tokens of the {planned_tokens:,} planned: the choice is for the longest, and "
        f"may recompute more than shorter batches need"
    )


def plan_file_chose(flag: str, plan, budget_mb: float, held: int, predicted, budget_bytes: int, shorter: str) -> str:
    """A plan file's choice, which step one runs: its figure with what this process holds outside the step in place
    of the workspaces the file counted."""
    outside = ""
    if held >= MIB / 10 or plan.workspaces_mb:
        files = plan.workspaces_mb
        instead = f" in place of the file's {files:,.1f} MiB of workspaces" if files else ""
        outside = (
            f"; with the {held / MIB:,.1f} MiB this process holds outside the step{instead}: predicted "
            f"{predicted.peak_mb:,.1f} MiB"
        )
        if predicted.peak_bytes > budget_bytes:
            outside += ", over the budget (the file planned a process holding nothing else)"
    return (
        f"memory_opt_config auto: {flag} chose {plan.config_flag} under the budget of {budget_mb:,.1f} MiB, its dry "
        f"run's peak {plan.peak_mb:,.1f} MiB ({plan.peak_at}){outside}; no dry run here: step one runs it and is "
        f"measured to check it{shorter}"
    )


# -- a choice -------------------------------------------------------------------------------------------------------
def chooser_failed(problem, rank: int) -> str:
    """The rank choosing for all (`StepOne.chooser`) failed: what every other rank raises."""
    return f"{AUTO}: rank {rank}, which chooses for all processes, could not choose: {problem}"


def nothing_fits(asked: str, result, out_dir: Optional[str], unweighed: Sequence[str]) -> str:
    """No choice fits: why (the solver's), the least any recompute reaches, what to change, and the levers not
    weighed (`Lever.unweighed`), so that the figures never pass for the least the levers reach."""
    untried = ""
    if unweighed:
        untried = (
            f". Not weighed, so these figures are not the least the levers reach: {'; '.join(unweighed)}. A dry run "
            f"of step one weighs every way (`--memory_auto_dry_run true`, the default, where one can run); or give "
            f"plans by hand, as in {BY_HAND}"
        )
    return (
        f"{AUTO} found nothing that fits {asked}: {result.why_not}. The least any recompute reaches is "
        f"{result.floor.peak_mb:,.1f} MiB ({result.floor.where}); raise the budget or lower "
        f"`--per_device_train_batch_size`" + _solver_json(out_dir) + untried
    )


def step_one_over(planned_choice: str, real) -> str:
    return (
        f"step one, running {planned_choice}, reads {real.peak_mb:,.1f} MiB ({real.where}) with what later steps hold "
        f"more, over the budget: the solver chose again from it"
    )


def step_one_offers_less(planned_choice: str) -> str:
    return (
        f"step one's profile does not offer every configuration of {planned_choice} (a layer without a graph, or a "
        f"lever's option it does not offer): the solver chose again from step one"
    )


def confirmed_source(planned_choice: str) -> str:
    return f"{planned_choice}, which step one ran and confirms"


def step_one_not_located(problems: List[tuple], several: bool) -> str:
    where = "; ".join((f"rank {rank}: " if several else "") + str(why) for rank, why in problems)
    return (
        f"{AUTO}: the budget solver could not locate step one's peak: {where}; choose plans with `memopt-probe "
        f"--budget_mb MIB -- SCRIPT ...` (fresh runs of the script) and pass them, as in `--memory_opt_config "
        f"Gelu+:1:-1`"
    )


def levers_ran(plans: List[str]) -> str:
    return f", with {', '.join(plans)}" if plans else ""


def _config(result) -> str:
    return f"`--memory_opt_config {result.config()}`" if result.config() else "to recompute nothing"


def _against(result, budget_mb: Optional[float], budget_bytes: Optional[int], why_lower: str) -> str:
    if result.share is not None:
        return (
            f"keeping at most {result.share:.0%} of the {result.activation_bytes / MIB:,.1f} MiB the layers keep for "
            f"backward with nothing recomputed"
        )
    if result.budget_bytes != budget_bytes and why_lower:
        return f"under {result.budget_bytes / MIB:,.1f} MiB ({why_lower})"
    return f"under the budget of {budget_mb:,.1f} MiB"


def chose(planner, result) -> str:
    """The choice in one line (`say`): what runs, its predicted peak and where, against the budget."""
    choices, ranks = planner.choices, planner.reading.ranks.size
    again = " (again)" if len(choices.fits) > 1 else ""
    everyone = f" for all {ranks} processes" if ranks > 1 else ""
    against = _against(result, planner.budget_mb, planner.budget_bytes, choices.why_lower)
    if result.source:  # the dry run's choice, which step one ran: its own figure with what later steps hold
        again = planner.planned_shape if planner.earlier else None  # a longer batch's step, planned for again
        step = step_of(again)
        return (
            f"memory_opt_config auto: {step} ran {choices.planned_choice}{everyone} and keeps it, {against}: "
            f"predicted peak {result.predicted.peak_mb:,.1f} MiB ({result.predicted.where}) from "
            f"{'that step' if again is not None else step}'s own memory and what later steps hold more"
        )
    why = f" ({choices.why_replanned})" if choices.why_replanned and len(choices.fits) == 1 else ""
    return (
        f"memory_opt_config auto{again}: the solver chose {_config(result)}{everyone}, {against}: predicted peak "
        f"{result.predicted.peak_mb:,.1f} MiB ({result.predicted.where}), {result.recompute_seconds * 1000:,.1f} ms "
        f"of recompute per step{why}"
    )


def described(planner, result, shape: tuple) -> str:
    """The figures behind a choice (`detail`): what step one ran and where it peaked, what later steps hold more,
    the choice with what it frees and costs, and the least recompute can reach."""
    choices, one, ranks = planner.choices, planner.step_one, planner.reading.ranks.size
    again = " (again)" if len(choices.fits) > 1 else ""
    if choices.planned is not None:
        ran = f"{choices.planned_choice}, `--memory_opt_config {choices.planned.config()}`"
    else:
        ran = f"every layer recomputed whole{one.levers_ran}"
    if result.share is not None:
        under = (
            f"Keeping at most {result.share:.0%} of the {result.activation_bytes / MIB:,.1f} MiB the layers keep for "
            f"backward with nothing recomputed,"
        )
    elif result.budget_bytes != planner.budget_bytes and choices.why_lower:
        under = f"Under {result.budget_bytes / MIB:,.1f} MiB ({choices.why_lower})"
    else:
        under = f"Under {planner.budget_mb:,.1f} MiB"
    grads = "; gradients across micro-batches" if planner.grad_bytes else ""
    each = f" on each of the {ranks} processes" if ranks > 1 else ""
    return (
        f"memory_opt_config auto{again}: step one ({ran}, first input {'x'.join(map(str, shape)) or '?'}) peaked at "
        f"{one.memory.peak.peak_bytes / MIB:,.1f} MiB{' on rank 0' if ranks > 1 else ''} ({one.memory.peak.name}); "
        f"later steps hold {one.extra / MIB:+,.1f} MiB more (made in step one and kept: the optimizer's state, "
        f"buffers the math libraries and engines made once{grads}). {under}{each} "
        f"{'the choice kept is' if result.source else 'the solver chose'} {_config(result)}"
        f"{' for all of them' if ranks > 1 else ''}: predicted peak {result.predicted.peak_mb:,.1f} MiB "
        f"({result.predicted.where}), {result.freed / MIB:,.1f} MiB freed, {result.recompute_seconds * 1000:,.1f} ms "
        f"of recompute per step (op time measured in step one). The least recompute can reach: "
        f"{result.floor.peak_mb:,.1f} MiB ({result.floor.where})"
    )


# -- a check ----------------------------------------------------------------------------------------------------------
def on_ranks(peaks: List[int], peak: int) -> str:
    """Where several processes read: the rank that peaked, and every rank's figure."""
    if len(peaks) < 2:
        return ""
    every = ", ".join(f"rank {r}: {p / MIB:,.1f}" for r, p in enumerate(peaks))
    return f" on rank {peaks.index(peak)} ({every})"


def checked(
    resets: bool,
    peak: int,
    where: str,
    result,
    verdict: str,
    shorter: Optional[tuple] = None,
    planned: Optional[tuple] = None,
    waited: int = 0,
) -> str:
    """A check's line (`say`): what the step after the choice measured against its prediction, and the verdict. A
    choice running the model's own head counts its returned logits as the caller's (`LeverChoice.returned`): said.
    `waited`: the steps of shorter batches than the `planned` one the check read on through before the one it ended
    at; `shorter`: that step's batch (batch, tokens), where it was shorter too (the check waited no longer): said, as
    the cause of a peak under the prediction."""
    predicted = result.predicted.peak_bytes
    error = (peak - predicted) / predicted * 100 if predicted else 0.0
    what = "the step after the choice" if resets else "training so far (CUDA's counter is the Trainer's)"
    if resets and waited and planned is not None:
        made_for = " x ".join(map(str, planned))
        what = f"the {waited + 1} steps after the choice (read on past {waited} of batches shorter than {made_for})"
    kept = ""
    if result.returned:
        kept = (
            f"; the prediction counts the {result.returned / MIB:,.1f} MiB of logits the model's own head returns as "
            f"held through the step, as a loop that keeps `outputs` over backward holds them; one that drops them "
            f"peaks that much lower"
        )
    if shorter is not None and planned is not None:
        ran, made_for = " x ".join(map(str, shorter)), " x ".join(map(str, planned))
        kept += f"; its batch, {ran} tokens, was shorter than the {made_for} the choice was made for, which holds more"
    return (
        f"memory_opt_config auto: {what} peaked at {peak / MIB:,.1f} MiB{where} (predicted {predicted / MIB:,.1f}, "
        f"{error:+.1f}%{kept}), {verdict}"
    )


def verdict(asked: str, peak: int, budget_bytes: Optional[int], budget_mb: Optional[float]) -> str:
    if budget_bytes is None:
        return f"(the budget is a share of the activations: {asked})"
    return f"{'within' if peak <= budget_bytes else 'over'} the budget of {budget_mb:,.1f} MiB"


def budget_lowered(budget_mb: float, over_mb: float, margin: float, to_floor: bool) -> str:
    return (
        f"the budget of {budget_mb:,.1f} MiB lowered by the {over_mb:,.1f} MiB the check measured over its prediction "
        f"and {margin:.1%} of it as margin" + (", no lower than the least peak recompute reaches" if to_floor else "")
    )


def missed_again(over_mb: float) -> str:
    return f"the least peak recompute reaches: the choice for a lowered budget missed again, by {over_mb:,.1f} MiB"


def cannot_keep(asked: str, result, peak: int, where: str, budget_bytes: int, out_dir: Optional[str]) -> str:
    """The most recompute missed its budget on a check: the run stops rather than train over it."""
    predicted = result.predicted.peak_bytes
    return (
        f"{AUTO} cannot keep {asked}: with the most recompute it has (`--memory_opt_config {result.config()}`, "
        f"predicted {predicted / MIB:,.1f} MiB), the step measured {peak / MIB:,.1f} MiB{where}, "
        f"{(peak - predicted) / MIB:,.1f} MiB over its prediction and {(peak - budget_bytes) / MIB:,.1f} MiB over the "
        f"budget; it stops here rather than train on over it. Raise the budget to at least {peak / MIB:,.1f} MiB or "
        f"lower `--per_device_train_batch_size`" + _solver_json(out_dir)
    )
