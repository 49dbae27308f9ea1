"""The head and loss measured each way they can run (`measure`, after step one, on the shared harness `measure.ways`),
and what that measurement gives the solver (`choices`) and the table (`rows`, `how_measured`).
"""

import contextlib
import functools
import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .....memory import MIB
from .....plans import FoundPlan
from ...decide.budget import LeverChoice
from ...measure.profile import HEAD_PLACE
from ...sharding import sharded
from .chunks import chunk_losses
from .option import SYNTAX, Chunking, candidate_chunks, plan_of

REPEATS = 3  # each way of running the head is timed this many times (interleaved), its median taken

HEAD_MARK = "head"  # the head's stretches in its segment, as the watch names them (`engine.mark_inside`)
# the stretches a way of running the head moves: a chunk's head forward, what follows it to the next chunk (its
# logits' loss), a chunk's head backward; not the final norm's forward before the first, nor what follows the last
# chunk's backward (the final norm's backward)
HEAD_STRETCHES = (f"{HEAD_MARK} forward", f"after {HEAD_MARK} forward", f"{HEAD_MARK} backward")


BOUND_MARGIN = 0.25  # a way of running the head is run only where its bound, this much higher, fits (`measure`)


@dataclass(frozen=True)
class HeadOption:
    """One way to run a causal LM's head and loss, measured aside (`measure`): how it chunks the tokens (None: the
    model's own head), the most it held above the level it started at, and its seconds."""

    chunking: Optional[Chunking]
    held_bytes: int
    seconds: float
    bound_bytes: int = 0  # the most it was let hold before it ran (the room it was admitted by: `ModelProfile.room`)
    rows: int = 0  # the rows of logits it makes at once (every token for the model's own head); 0: not known

    @property
    def plan(self) -> str:
        """The way as a plan, its label in the table and messages (`Loss+:1:-1@chunks8`; "": the model's own head)."""
        return plan_of(self.chunking)


@dataclass
class HeadMeasure:
    """The head and loss measured after step one, each way it can run, on the step's shapes. `ran` is the plan the
    step ran (its option is among `options`, which are ordered as measured); a way not measured is said in `why_not`
    (by plan)."""

    tokens: int
    hidden: int
    vocab: int
    ran: str
    options: List[HeadOption]
    why_not: Dict[str, str] = field(default_factory=dict)
    # the logits the model's own head returns (its forward's output holds them: a loop that keeps the outputs, as
    # `outputs = model(**batch)` does, holds them through the backward and the next forward)
    logits_bytes: int = 0
    # measured on a dry run's fake tensors: every choice is then checked by a fake step, exact and harmless where
    # it goes over, so each way is weighed as it held (`choices`)
    fake: bool = False
    # a run's own dry run's, taken over after the run's step one (`taken_over`): weighed as the run's own, said so
    from_dry_run: bool = False

    def option(self, plan: str) -> Optional[HeadOption]:
        return next((o for o in self.options if o.plan == plan), None)

    def seconds(self, option: HeadOption) -> float:
        """`option`'s seconds, never below four thirds of the model's own head's where that was measured: a chunked
        way makes each chunk's logits again in backward (the head's three matmuls become four), and a chunked way
        measured faster than that is the clock's noise (tests/test_torch_budget.py,
        `test_the_heads_ways_are_weighed_...`; docs/STACK.md, "The head's chunks timed alone")."""
        own = self.option("")
        if own is None or not option.plan:
            return option.seconds
        return max(option.seconds, own.seconds * 4 / 3)


def measure(lever, profile, resets: bool = True):
    """The head and loss of `lever` (a `ChunkedLoss`) run each way worth offering on step one's shapes, on the shared
    harness (`measure.ways`: from the fewest rows up, each only where its bound fits what step one's peak, or `auto`'s
    budget where higher, left free, read aside, interleaved repeats): the model's own head, each chunk count of
    `candidate_chunks`, and the chunking the step ran (read from a count that makes as many rows a chunk, where one
    does: the same work). A way's bound is what the way before it held (at first what every way holds besides its rows)
    and the most each further row can add, `BOUND_MARGIN` higher (tests/test_torch_loss.py holds every way under its
    bound). The hidden states and labels come from a generator of the measurement's own (its figures depend on the
    shapes alone; the process's streams stay the user's). A `HeadMeasure`, or the reason there is none."""
    from ... import _torch_api
    from ...measure.storages import block_bytes
    from ...measure.ways import run_ways

    if lever.trl:
        return "the head is TRL's fused LM head, which chunks already"
    shape = profile.shape  # the first layer's input: a VLM's tower's patches, where the head reads the text
    if lever.tokens is None and len(shape) < 2:
        return "step one's layers took no hidden states to count the tokens by"
    head = lever.lm.get_output_embeddings()
    how = sharded(head)
    if how is not None:
        return f"the head's weight is sharded ({how}): measured alone it would be gathered on one process's say"
    if profile.memory is None:
        return (
            "step one's memory was not read, so how much a way of running the head may take without going above "
            "step one's peak is not known"
        )
    weight = head.weight
    tokens = lever.tokens or math.prod(shape[:-1])  # the hidden states the head took in step one
    hidden, vocab = lever.width or weight.shape[1], lever.vocab
    device = weight.device.type
    ran = lever.chunking if lever.installed else None
    ways: List[Optional[Chunking]] = [None] + [Chunking(chunks=c) for c in candidate_chunks(tokens, hidden, vocab)]
    params = [p for p in head.parameters() if p.requires_grad]
    autocast = getattr(torch, profile.autocast) if profile.autocast else None
    itemsize = torch.finfo(autocast).bits // 8 if autocast is not None else weight.element_size()
    # what any way holds besides its rows: the head's gradients (summed, and a chunk's), the hidden states' gradient
    # (by chunk, then whole) and the hidden states the head reads (made inside the way, as the step's final norm makes
    # them in the head's segment), under autocast the weight's copy and its gradient; and what each row adds at most: a
    # chunk's logits and their gradient (in the head's dtype), their fp32 copy and log-softmax (its gradient), soft-
    # capped the cap's two intermediates, under autocast the chunk's hidden states cast and their gradient cast back.
    # Checked against what each way held (tests/test_torch_loss.py); every bound is taken `BOUND_MARGIN` higher, for
    # what the allocator rounds.
    fixed = 2 * sum(p.numel() * p.element_size() for p in params) + 3 * tokens * hidden * weight.element_size()
    upcast = 8 if itemsize != 4 else 4  # in fp32 the loss's upcast is the logits themselves
    per_row = vocab * (2 * itemsize + upcast + (0 if lever.form.bare else 2 * itemsize))
    if autocast is not None:
        fixed += 2 * weight.numel() * itemsize
        per_row += hidden * (itemsize + 4)
    # drawn from a generator of the measurement's own: the process's streams (every dropout mask after step one)
    # stay the ones the run without the plugin draws
    own = torch.Generator(device=weight.device).manual_seed(0)
    hidden_states = torch.randn(
        tokens, hidden, generator=own, dtype=weight.dtype, device=weight.device, requires_grad=True
    )
    labels = torch.randint(0, vocab, (tokens,), generator=own, device=weight.device)

    def run(chunking: Optional[Chunking]) -> None:
        # the head reads a copy made inside the way, as the step's head reads the final norm's output made in its
        # segment: held through the backward where the way keeps it (the chunks' checkpoints; a trained head's weight
        # gradient), let go of after the forward where nothing does (the model's own head, frozen under LoRA: one
        # hidden state less at its backward's peak than the chunks, which the leaf made before the way hid)
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            if chunking is None:
                logits = lever.logits_of(hidden_states.clone())
                loss = F.cross_entropy(logits.float(), labels, reduction="sum")
                del logits
            else:
                rows = chunking.rows(tokens, hidden, vocab)
                parts = chunk_losses(lever.logits_of, hidden_states.clone(), labels, rows, -100, None)
                loss = functools.reduce(torch.add, parts)
                del parts
        grads = torch.autograd.grad(loss, [hidden_states, *params])
        del grads

    def rows_of(way: Optional[Chunking]) -> int:
        return tokens if way is None else min(tokens, way.rows(tokens, hidden, vocab))

    def bound(rows: int, last: Optional[Tuple[int, int]]) -> int:
        last_rows, last_held = last or (0, fixed)  # before any: what any way holds besides its rows
        return int((last_held + (rows - last_rows) * per_row) * (1 + BOUND_MARGIN))

    # the way the step ran, where it makes as many rows a chunk as a count above (the same work: at 8B, 8,192 tokens,
    # `Loss+:1:-1` is 32 chunks of 256 rows), is read from that count, not run a second time
    same = None
    if ran not in ways:
        same = next((w for w in ways if ran is not None and w is not None and rows_of(w) == rows_of(ran)), None)
        if same is None:
            ways.append(ran)
    read_as = ran if same is None else same

    # on the head's GPU as the current one: read there, and its generator given back (`held_aside`)
    with torch.cuda.device(weight.device) if device == "cuda" else contextlib.nullcontext():
        got = run_ways(ways, rows_of, bound, run, device, profile.room(), _torch_api.is_fake(weight), REPEATS, resets)
    why_not = {plan_of(way): why for way, why in got.why_not.items()}
    if not got.ran(read_as):
        how = plan_of(ran) or "the model's own head"
        return f"the way the step ran the head ({how}) was not run alone: {why_not[plan_of(read_as)]}"
    options = [
        HeadOption(way, got.held[way], got.seconds[way], got.bounds[way], rows_of(way)) for way in ways if got.ran(way)
    ]
    if same is not None:  # the way the step ran, read from the count with its rows
        options.append(HeadOption(ran, got.held[same], got.seconds[same], got.bounds[same], rows_of(ran)))
    # what a loop keeping the forward's outputs holds of the model's own head: none where the loop lets go of them
    logits = 0 if lever.outputs_dropped else block_bytes(tokens * vocab * itemsize)
    return HeadMeasure(tokens, hidden, vocab, plan_of(ran), options, why_not, logits, _torch_api.is_fake(weight))


def taken_over(measured: "HeadMeasure", ran: Optional[Chunking], tokens: int) -> Optional["HeadMeasure"]:
    """The run's own dry run's measurement (`measured`, of the same step on fake tensors) as the run's step one's
    (`ChunkedLoss.adopt`): the way the step ran (`ran`) its own, weighed as a run's measurement is (each way's bound
    where it could hold more than the step's way: a real step is not checked by a fake one), or None where it does
    not stand for the step (other shapes; a way step one ran that no way measured makes as many rows a chunk as)."""
    if not measured.fake or measured.tokens != tokens:
        return None
    plan = plan_of(ran)
    options = list(measured.options)
    if measured.option(plan) is None:
        rows = tokens if ran is None else min(tokens, ran.rows(tokens, measured.hidden, measured.vocab))
        same = next((o for o in options if o.rows == rows), None)
        if same is None:
            return None
        options.append(replace(same, chunking=ran))  # the same work (`measure`: a count with its rows)
    return replace(measured, ran=plan, options=options, fake=False, from_dry_run=True)


def head_marked(memory) -> bool:
    """Whether step one's head segment was read stretch by stretch around the head (`HEAD_MARK`: the lever's
    `marks`; not where the peak counter is not reset at the marks)."""
    if memory is None:
        return False
    return any(
        seg.place.in_step() == HEAD_PLACE and any(tag in HEAD_STRETCHES for tag, _ in seg.parts)
        for seg in memory.segments
    )


def choices(head: Optional[HeadMeasure], ran: Optional[Chunking] = None, marked: bool = False) -> List[LeverChoice]:
    """The ways the head and loss can run, as the solver weighs them (`budget.LeverChoice`, in the head's segment):
    the bytes each holds less than the way the step ran, and the seconds it takes more than the fastest way (a
    constant apart from what the step ran: the least total time is the same); where none was measured, the way the
    step ran (`ran`, its chunking; None: the model's own head) alone.

    Where step one's head segment was read stretch by stretch (`marked`: `head_marked`), a way moves the stretches
    the head's chunks run in (`HEAD_STRETCHES`: a chunk's head forward, what follows it to the next chunk, its
    backward) and not the rest of the segment, the final norm's forward before the head and its backward after it
    (`LeverChoice.less_parts`): a step whose head segment peaked in the final norm's backward, the chunks lower, was
    predicted the chunks' change on top of that peak (2.05 MiB over a check's reading at a 4-layer decoder's size,
    129 MiB at 8B and 8,192 tokens; exact to 4 KiB so).

    The rule (tests/test_torch_budget.py, `test_the_heads_ways_are_weighed_...`): each way is weighed as it held run
    alone, and the model's own head (outside a dry run) as returning its logits to a loop that keeps them (a loop
    that keeps `outputs` over the backward holds them through it and the next forward: `returned`; the checks say
    what a loop that drops them holds less; none where the loop is known to let go of them, transformers' own step:
    `HeadMeasure.logits_bytes`). What a way holds alone is what it adds in a step to a few KiB since the
    ways read hidden states made inside them and move only the head's stretches: on the CPU (torch 2.13) the checks
    of choices made from a measured step read 1 to 10 KiB under their predictions for the own head and coarser
    chunks (fp32 and LoRA, vocabulary / hidden 4 to 32), 0.4 MiB under with the own head in bf16. Before, a way
    that held more than the step's, or made more rows at once, was weighed by its bound (what the shapes let it hold,
    25% over: `measure`), which put a choice of the own head 2.3 MiB over its check on the tests' decoder and 15 MiB
    at vocabulary / hidden 32 (4,096 / 128), and kept a measured run chunking where the whole head fitted
    (docs/STACK.md, "The head's ways alone and in a step"). In a dry run (`HeadMeasure.fake`) no logits are
    returned: the choice is checked by a fake step of the run's own loop, which counts what the card would to the
    byte."""
    if head is None:
        return [_choice(ran)]
    ran_option = head.option(head.ran)
    fastest = min(head.seconds(o) for o in head.options)
    return [
        _choice(
            o.chunking,
            ran_option.held_bytes - o.held_bytes,
            head.seconds(o) - fastest,
            head.logits_bytes if o.chunking is None and not head.fake else 0,
            marked,
        )
        for o in head.options
    ]


def _choice(
    chunking: Optional[Chunking], less: int = 0, seconds: float = 0.0, returned: int = 0, marked: bool = False
) -> LeverChoice:
    """The `LeverChoice` of the head run in `chunking` (None: the model's own head, the lever off); `marked`: its
    bytes held less in the head's stretches (`choices`), else in the whole head segment."""
    option = None if chunking is None else chunking.option
    if marked:
        parts = tuple((HEAD_PLACE, tag, less) for tag in HEAD_STRETCHES) if less else ()
        return LeverChoice(SYNTAX.name, option, plan_of(chunking), (), seconds, returned, less_parts=parts)
    where = ((HEAD_PLACE, less),) if less else ()
    return LeverChoice(SYNTAX.name, option, plan_of(chunking), where, seconds, returned)


def rows(head: Optional[HeadMeasure], drop, marked: bool = False) -> List[FoundPlan]:
    """One row per way of chunking the head and loss measured after step one: SAVING, what the head's own peak holds
    less than the model's own head (or, where the step ran chunks, than the chunks it ran); PEAK DROP, how much lower
    step one's peak would be with it alone; TIME, what it adds to a step."""
    if head is None:
        return []
    ran = head.option(head.ran)
    base = head.option("") or ran
    out = []
    for option in head.options:
        if not option.plan:
            continue
        on = option.plan == head.ran
        saving = base.held_bytes - option.held_bytes
        out.append(
            FoundPlan(
                config=option.plan,
                enabled=on,
                frequency=1,
                saving_bytes=float(saving),
                applied_count=int(on),
                applied_saving_bytes=float(saving if on else 0),
                # the dry run's clock is not this run's: not timed here (`how_measured`)
                recompute_seconds=None if head.from_dry_run else max(0.0, head.seconds(option) - head.seconds(base)),
                lever=SYNTAX.name,
                **(
                    drop([_choice(option.chunking, ran.held_bytes - option.held_bytes, marked=marked)])
                    if drop is not None
                    else {}
                ),
            )
        )
    return out


OWN_HEAD = "the model's own head"


def how_measured(head: HeadMeasure) -> str:
    """The table's note on how the head's ways were measured."""
    base = head.option("") or head.option(head.ran)
    against = "the model's own head" if base.plan == "" else f"{head.ran}, which the step ran"
    how = (
        "each way run alone in the run's dry run before step one, on fake tensors of its shapes (every byte as the "
        "device counts it; not run again on the device, so no TIME)"
        if head.from_dry_run
        else "each way run alone after step one on its shapes"
    )
    read = "read after every op" if head.from_dry_run else "read after every op, once after a warm-up"
    return (
        f"the head and loss (`Loss+` rows): {how} ({head.tokens:,} tokens, "
        f"hidden {head.hidden}, vocabulary {head.vocab:,}; random values: memory and time depend on the shapes) and "
        f"{read}; the head alone held {base.held_bytes / MIB:,.1f} MiB at most "
        f"as {against}; SAVING is what a row's head holds less, PEAK DROP how much lower step one's peak would be "
        f"with it alone, TIME what it adds to a step (each chunk's logits made again in backward)"
        + "".join(f"; {plan or OWN_HEAD} was not run: {why}" for plan, why in head.why_not.items())
    )
