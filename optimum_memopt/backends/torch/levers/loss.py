"""The loss lever (`Loss+`): a causal LM's head and its cross-entropy run over chunks of tokens.

Once the layers are recomputed, a decoder's step peaks at its head and loss: the whole logits (tokens x vocabulary,
upcast to fp32 by transformers' causal-LM loss) and their gradient. With this lever the whole logits never exist in
training. The model's own forward runs with the head given no position to project (`logits_to_keep`, an empty index:
the backbone, and all the family does around it, run as they are); the final hidden states are taken from the
backbone's output; and the loss is summed chunk by chunk: each chunk's logits are made by the head module, their
cross-entropy summed, and the logits let go. Backward makes each chunk's logits again from the hidden states
(`torch.utils.checkpoint`, RNG state kept: one more head matmul a step, the lever's price). The sum is divided as
transformers divides it: by `num_items_in_batch` where the Trainer passes it, else by the tokens whose label is not
`ignore_index`.

Kept from transformers' loss: the shift (or the caller's `shift_labels`), `ignore_index`, the fp32 upcast,
`num_items_in_batch`, and the head as the model's forward runs it, with what it does to the logits before the loss
(a soft cap, a scale, `.float()`) and adds to the loss after (an MoE's aux loss, with its gradient): both read from
the forward's own source (`head_form`), so any causal LM whose forward has that form is chunked, whatever its family.
The head module sees the same calls (tied embeddings, a LoRA on `lm_head`, ZeRO-3's and FSDP's gathering hooks and
autocast); the Trainer's label smoothing is `LabelSmoother`'s formula, chunk by chunk (`smoothing`, set by the
trainer), with no aux loss added (the Trainer's smoother adds none).

A training output carries no logits (`None`), said once; evaluation, `predict`, generation, and any forward without
labels or without grad run the model's forward untouched. A model whose forward this lever does not know is refused
by name (`loss_problem`), never left whole silently.
"""

import contextlib
import functools
import inspect
import logging
import math
import os
import statistics
import types
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ....memory import MIB
from ....plans import FoundPlan, LeverSyntax
from ..decide.budget import LeverChoice
from ..measure.profile import HEAD_SEGMENT
from .head_form import head_form
from .protocol import Lever, sharded

logger = logging.getLogger(__name__)

SYNTAX = LeverSyntax(
    name="loss",
    plan="Loss+",
    what="the head and loss",
    layers=False,
    parameter="chunking",
    parameters=(("chunks", "N chunks"), ("tokens", "N tokens a chunk")),
    default="chunks whose logits hold no more than the final hidden states",
    examples=("Loss+:1:-1", "Loss+:1:-1@chunks8", "Loss+:1:-1@tokens1024"),
    once="a model has one head",
)
REPEATS = 3  # each way of running the head is timed this many times (interleaved), its median taken
BOUND_MARGIN = 0.25  # a way of running the head is run only where its bound, this much higher, fits (`measure`)


@dataclass(frozen=True)
class Chunking:
    """How the tokens are chunked: `chunks` of equal rows, or `tokens` rows a chunk; neither: chunks whose logits
    hold no more than the final hidden states (rows = tokens x hidden / vocabulary), the bare `Loss+:1:-1`."""

    chunks: Optional[int] = None
    tokens: Optional[int] = None

    @classmethod
    def from_selector(cls, selector: str) -> "Chunking":
        """`chunks8`, `tokens1024` or "" (the plan grammar has checked the form)."""
        if selector.startswith("chunks"):
            return cls(chunks=int(selector[len("chunks") :]))
        if selector.startswith("tokens"):
            return cls(tokens=int(selector[len("tokens") :]))
        return cls()

    def rows(self, n_tokens: int, hidden: int, vocab: int) -> int:
        """The rows (tokens) of one chunk for a step of `n_tokens` tokens."""
        if self.tokens is not None:
            return max(1, self.tokens)
        if self.chunks is not None:
            return max(1, math.ceil(n_tokens / self.chunks))
        return max(1, math.ceil(n_tokens * hidden / vocab))

    @property
    def selector(self) -> str:
        """The chunking as the policy holds it (`chunks8`, `tokens1024`; "" the default)."""
        if self.tokens is not None:
            return f"tokens{self.tokens}"
        return f"chunks{self.chunks}" if self.chunks is not None else ""

    def describe(self) -> str:
        if self.tokens is not None:
            return f"chunks of {self.tokens} tokens"
        if self.chunks is not None:
            return f"{self.chunks} chunk{'s' if self.chunks != 1 else ''}"
        return "chunks whose logits hold no more than the final hidden states"


def causal_lm(model: nn.Module) -> Optional[nn.Module]:
    """The transformers model with the LM head inside `model` (itself, or under PEFT / DDP wrappers, which pass
    attribute reads on to it), or None."""
    from transformers import PreTrainedModel

    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.get_output_embeddings() is not None:
            return module
    return None


def fused_by_trl(lm: nn.Module) -> bool:
    """Whether TRL's fused LM head (`add_fused_lm_head`, which `SFTTrainer` installs) already replaced the forward."""
    forward = vars(lm).get("forward")
    code = getattr(getattr(forward, "__func__", forward), "__code__", None)  # its own (`functools.wraps` copies names)
    return code is not None and "fused_lm_head" in code.co_varnames and "trl" in code.co_filename.split(os.sep)


def loss_problem(model: nn.Module) -> Optional[str]:
    """Why `Loss+` cannot chunk this model's head and loss, or None where it can."""
    lm = causal_lm(model)
    name = type(model).__name__
    if lm is None:
        return f"{name} has no LM head (no `get_output_embeddings()`): `Loss+` chunks a causal LM's head and its loss"
    kind = getattr(lm.config, "model_type", None)
    form = head_form(lm)
    if isinstance(form, str):
        return (
            f"{type(lm).__name__} (model_type {kind!r}): `Loss+` runs a forward whose head's logits go from the "
            f"backbone's last hidden states to `self.loss_function`, with only row-wise statements between; {form}, "
            f"so its head is not chunked"
        )
    if fused_by_trl(lm):
        return None  # said by the lever: the head is chunked already
    replaced = vars(lm).get("forward")
    if replaced is not None and not _ours_inside(lm):
        return (
            f"{type(lm).__name__}'s forward was replaced on the instance "
            f"({getattr(replaced, '__qualname__', type(replaced).__name__)}): `Loss+` runs the model's own forward "
            f"and cannot know what the replacement does"
        )
    from transformers.loss.loss_utils import ForCausalLMLoss

    loss_fn = lm.loss_function
    if loss_fn is not ForCausalLMLoss:
        return (
            f"{type(lm).__name__}'s loss is {getattr(loss_fn, '__qualname__', loss_fn)!r}, not transformers' "
            f"causal-LM loss (`ForCausalLMLoss`): `Loss+` computes that loss and no other"
        )
    return None


_LEVER = "_memopt_loss_lever"  # the attribute of the causal LM holding the lever its forward runs now, if any
_FORWARD = "_memopt_loss_forward"  # ... and the forward the lever put on the instance (`_dispatching`)


def _dispatching(cls: type):
    """The forward the loss lever puts on an instance of `cls`, once: the lever the model holds now runs it
    (`_LEVER`), or, with none (taken off), the class's own forward. One lever after another (a second Trainer on the
    model) takes the same forward over, even where something wrapped it since (accelerate's mixed precision). It
    carries the class forward's name and signature (`functools.wraps`): the Trainer reads the signature for the
    columns to keep and for `num_items_in_batch`."""

    @functools.wraps(cls.forward)
    def forward(model_self, *args, **kwargs):
        lever = vars(model_self).get(_LEVER)
        if lever is None or not lever.installed:
            return type(model_self).forward(model_self, *args, **kwargs)
        return lever._forward(args, kwargs)

    return forward


def _ours_inside(lm: nn.Module) -> bool:
    """Whether the forward on the instance is the lever's, or wraps it (`__wrapped__`, as accelerate's autocast and
    output conversion and `functools.wraps` leave it)."""
    ours = vars(lm).get(_FORWARD)
    forward, seen = vars(lm).get("forward"), 0
    while ours is not None and forward is not None and seen < 16:
        func = getattr(forward, "__func__", forward)
        if func is ours:
            return True
        forward, seen = getattr(func, "__wrapped__", None), seen + 1
    return False


class ChunkedLoss(Lever):
    """The lever on one causal LM (`protocol.Lever`). Its mechanism: `install` makes it run the model's training
    forward (putting `_dispatching` on the instance the first time), `remove` gives the model its own forward back;
    `chunking` may change between steps (the solver's choice), None runs the model's forward as it is."""

    syntax = SYNTAX
    name = SYNTAX.name

    def __init__(self, lm: nn.Module, chunking: Optional[Chunking], say: Callable[[str], None] = logger.warning):
        self.lm = lm
        self.chunking = chunking
        self.say = say
        self.smoothing: Optional[float] = None  # the Trainer's label smoothing, where it is on (set per step)
        self.trl = fused_by_trl(lm)
        self.last: Optional[dict] = None  # the last chunked forward: tokens, rows a chunk, chunks
        # the width of the hidden states the head is given (the backbone's output: ELECTRA's head projects them
        # before its output embeddings, whose input is another width), read at the last training forward
        self.width: Optional[int] = None
        # how many positions the head is given (batch x text length, read there too: a VLM's layer list starts with
        # its tower, whose patches are not the head's tokens)
        self.tokens: Optional[int] = None
        self.calls = 0  # training forwards whose loss was chunked
        self._said = set()
        self.installed = False
        self.signature = inspect.signature(type(lm).forward)
        text = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
        self.vocab = text.vocab_size
        form = head_form(lm)
        if isinstance(form, str):
            raise ValueError(f"`Loss+` cannot chunk {type(lm).__name__}'s head: {form}")
        self.form = form
        self.logits_of = functools.partial(form.logits, lm)  # the head and what the forward does to its logits

    def install(self) -> None:
        if self.installed or self.trl:
            return
        lm = self.lm
        vars(lm)[_LEVER] = self  # a lever installed before on this model (a stale one) runs no more
        if not _ours_inside(lm):
            vars(lm)[_FORWARD] = forward = _dispatching(type(lm))
            lm.forward = types.MethodType(forward, lm)
        self.installed = True

    def remove(self) -> None:
        """Give the model its forward back. Where something wrapped ours since (accelerate's mixed precision wraps
        the instance's forward in autocast), ours stays inside it and runs the model's forward untouched, until a
        lever installed later takes it over."""
        if not self.installed:
            return
        lm = self.lm
        if vars(lm).get(_LEVER) is self:
            del vars(lm)[_LEVER]
            on_top = getattr(vars(lm).get("forward"), "__func__", None)
            if on_top is not None and on_top is vars(lm).get(_FORWARD):  # nothing wrapped ours since
                del lm.forward
                del vars(lm)[_FORWARD]
        self.installed = False

    @classmethod
    def build(cls, model, settings, option: Optional[str], n_layers: int):
        """The lever on the model's head (`protocol.Lever.build`): installed where `Loss+` was asked (`option`, its
        chunking), refused with the reason where it cannot run; under `auto` with a budget in MiB, on a causal LM it
        can run on, there to run step one's head in chunks and measure each way after it (the table's `Loss+` rows,
        the solver's head options). Elsewhere nothing is measured: measuring runs the head between steps, above
        what the step holds then, which only a run that asked for the lever or the solver should pay."""
        problem = loss_problem(model)
        if problem is None and settings.loss_reader:
            problem = (
                f"{settings.loss_reader} computes the loss from the model's logits, which a chunked head never makes "
                f"whole (and the Trainer hands such a loss no labels to the model)"
            )
        if problem is not None:
            if option is not None:
                raise ValueError(
                    f"`--memory_opt_config` has {str(SYNTAX.entry(option))!r}, but {problem}; drop `Loss+` to train "
                    f"with the head whole"
                )
            return None, (f"`Loss+` cannot run on it: {problem}" if causal_lm(model) is not None else None)
        if option is None:
            if settings.budget is None or settings.budget.share is not None:
                return None, (
                    "they are measured where `Loss+` or `--memory_opt_config auto` with `--memory_budget_mb` is "
                    "asked (add 'Loss+:1:-1' to the plans to run the head in chunks and see each way's row)"
                )
            lever = cls(causal_lm(model), None)
            lever.smoothing = settings.label_smoothing or None
            # step one runs with the least memory any choice needs: every layer whole, the head in chunks whose
            # logits hold no more than the hidden states; `auto` may choose another way as step two's first layer
            # starts (each way measured after step one, where it fits what step one's peak left free)
            lever.run_as("")
            return lever, None
        lever = cls(causal_lm(model), Chunking.from_selector(option))
        lever.smoothing = settings.label_smoothing or None
        if lever.trl:
            logger.warning(
                "`%s`: the model's head is chunked already by TRL's fused LM head (`SFTTrainer`), which runs its own "
                "forward; it is not chunked twice, and the step's head and loss are what TRL's head makes of them",
                SYNTAX.entry(option),
            )
        lever.install()
        return lever, None

    @property
    def option(self) -> Optional[str]:
        return self.chunking.selector if self.installed and self.chunking is not None else None

    def plan(self) -> str:
        """How the head runs now, as a plan (`Loss+:1:-1@chunks8`; "": the model's own head)."""
        return plan_of(self.chunking) if self.installed else ""

    def smooths_labels(self) -> bool:
        return self.installed and self.smoothing is not None

    def run_as(self, selector: Optional[str]) -> None:
        """Run the head from the next head and loss on (the solver's choice, made between steps or as a step's first
        layer starts): chunked as `selector` says ("", "chunks8", "tokens1024"), or None: the model's own head."""
        self.chunking = None if selector is None else Chunking.from_selector(selector)
        if self.chunking is not None:
            self.install()

    def after_step_one(self, profile, resets: bool) -> None:
        """Between step one and step two (a step reported ended): measure each way the head can run (`measure`)
        into the profile, for the table and the solver."""
        result = measure(self, profile, resets)
        if isinstance(result, str):
            profile.lever_problems[self.name] = result
        else:
            profile.levers[self.name] = result

    def choices(self, profile, measured=None) -> List[LeverChoice]:
        return choices(profile.levers.get(self.name), self.plan())

    def rows(self, profile, drop) -> List[FoundPlan]:
        return rows(profile.levers.get(self.name), drop)

    def notes(self, profile) -> List[str]:
        measured, problem = profile.levers.get(self.name), profile.lever_problems.get(self.name)
        out = [self.note()] if self.note() else []
        if measured is not None:
            out.append(how_measured(measured))
        elif problem:
            out.append(f"the head and loss were not measured each way they can run: {problem}")
        return out

    def note(self) -> Optional[str]:
        """What the plan table's notes say of the lever: how the last training step's head ran (None where the head
        runs as the model's own: the `Loss+` rows say what chunks would do)."""
        if self.chunking is None and not self.trl:
            return None
        if self.trl:
            return (
                "`Loss+`: the head is TRL's fused LM head, chunked by TRL already: not chunked again, and its memory "
                "is in the step as TRL's head makes it"
            )
        if self.last is None:
            return "`Loss+`: no training forward with labels has run yet, so the head has not been chunked yet"
        last = self.last
        return (
            f"`Loss+` ({self.chunking.describe()}): the head and loss ran in {last['chunks']} chunk(s) of up to "
            f"{last['rows']} of the step's {last['tokens']} tokens, each chunk's logits made again in backward"
        )

    def _once(self, key: str, text: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self.say(text)

    def _forward(self, args, kwargs):
        lm, signature = self.lm, self.signature
        plain = functools.partial(type(lm).forward, lm)
        if args:  # positional arguments (rare: the Trainer passes keywords) are named as the forward names them
            bound = signature.bind(lm, *args, **kwargs)
            bound.arguments.pop(next(iter(signature.parameters)))
            extra = bound.arguments.pop(
                next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), "\0"), {}
            )
            kwargs = {**bound.arguments, **extra}
        labels = kwargs.get("labels")
        if not self.installed or labels is None or not (lm.training and torch.is_grad_enabled()):
            return plain(**kwargs)
        keep = kwargs.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep == 0):
            self._once(
                "keep",
                f"a training forward of {type(lm).__name__} passed `logits_to_keep={keep!r}`: its loss is the head's "
                f"on those positions only, so `Loss+` leaves such forwards whole",
            )
            return plain(**kwargs)
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels")
        captured = []
        backbone = getattr(lm, lm.base_model_prefix)
        hook = backbone.register_forward_hook(lambda module, inputs, output: captured.append(output))
        try:
            out = plain(labels=None, logits_to_keep=torch.empty(0, dtype=torch.long), **kwargs)
        finally:
            hook.remove()
        hidden = captured[-1].last_hidden_state if hasattr(captured[-1], "last_hidden_state") else captured[-1][0]
        self.width = hidden.shape[-1]
        self.tokens = math.prod(hidden.shape[:-1])
        fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
        if self.chunking is None:  # read after the backbone: `auto` may choose as the step's first layer starts
            loss, logits = self._whole(hidden, labels, kwargs)
            return type(out)(loss=self._added(loss, out), logits=logits, **fields)
        loss = self._added(self.loss(hidden, labels, kwargs), out)
        self._once(
            "logits",
            f"`Loss+`: {type(lm).__name__}'s training forwards return no logits (`outputs.logits` is None): the head "
            f"and its loss run in {self.chunking.describe()}, and the whole logits never exist; a `compute_loss` or "
            f"callback that reads them in training gets None (evaluation and `predict` keep the whole logits)",
        )
        return type(out)(loss=loss, logits=None, **fields)

    def _added(self, loss, out):
        """What the forward adds to its loss after it (an MoE's aux loss), from the output of the forward run without
        labels, as the forward adds it; none under the Trainer's label smoothing, whose smoother adds none."""
        return loss if self.smoothing is not None else self.form.add_to(self.lm, loss, out)

    def _whole(self, hidden, labels, kwargs):
        """The model's own head and loss, as its forward runs them (the form tests/test_torch_loss.py holds each
        family's forward to): the head on every position with what the forward does to its logits, the model's loss
        function given the forward's extra keywords; with the Trainer's label smoothing, its `LabelSmoother` on the
        logits."""
        logits = self.logits_of(hidden)
        named = {p.name for p in self.signature.parameters.values() if p.kind is not p.VAR_KEYWORD}
        extra = {k: v for k, v in kwargs.items() if k not in named}
        if self.smoothing is not None:
            from transformers.trainer_pt_utils import LabelSmoother

            smoother = LabelSmoother(epsilon=self.smoothing)
            count = {"num_items_in_batch": extra.get("num_items_in_batch")} if _smoother_counts_items() else {}
            return smoother({"logits": logits}, labels, shift_labels=True, **count), logits
        return self.lm.loss_function(logits=logits, labels=labels, vocab_size=self.vocab, **extra), logits

    def loss(self, hidden: torch.Tensor, labels: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Transformers' causal-LM loss (or the Trainer's smoothed one) from the final hidden states, chunk by
        chunk."""
        ignore = kwargs.get("ignore_index", -100)
        shifted = kwargs.get("shift_labels")
        if shifted is None:
            shifted = F.pad(labels, (0, 1), value=ignore)[..., 1:]
        flat = hidden.reshape(-1, hidden.shape[-1])
        target = shifted.reshape(-1).to(flat.device)
        rows = self.chunking.rows(flat.shape[0], flat.shape[1], self.vocab)
        parts = _chunked(self.logits_of, flat, target, rows, ignore, self.smoothing)
        self.calls += 1
        self.last = {"tokens": flat.shape[0], "rows": rows, "chunks": len(parts)}
        count = kwargs.get("num_items_in_batch")
        if self.smoothing is not None and not _smoother_counts_items():
            count = None  # the installed LabelSmoother divides by the active tokens, whatever the Trainer passes
        if count is None:
            count = (target != ignore).sum()
        elif torch.is_tensor(count):
            count = count.to(flat.device)
        if self.smoothing is None:
            return functools.reduce(torch.add, parts) / count
        nll = functools.reduce(torch.add, [p[0] for p in parts]) / count
        smooth = functools.reduce(torch.add, [p[1] for p in parts]) / (count * self.vocab)
        return (1 - self.smoothing) * nll + self.smoothing * smooth


@functools.lru_cache(maxsize=None)
def _smoother_counts_items() -> bool:
    """Whether the installed transformers' `LabelSmoother` divides by the Trainer's `num_items_in_batch` (5.15 on)."""
    from transformers.trainer_pt_utils import LabelSmoother

    return "num_items_in_batch" in inspect.signature(LabelSmoother.__call__).parameters


def _chunked(logits_of: Callable, hidden, target, rows: int, ignore: int, smoothing) -> list:
    """Each chunk of `rows` tokens' loss sums (`_chunk_sums`), its logits let go after and made again in backward."""
    return [
        checkpoint(_chunk_sums, logits_of, h, y, ignore, smoothing, use_reentrant=False)
        for h, y in zip(hidden.split(rows), target.split(rows))
    ]


def _chunk_sums(logits_of: Callable, hidden, target, ignore: int, smoothing: Optional[float]):
    """One chunk: the sum of its tokens' loss (with smoothing: the two sums of `LabelSmoother`, the labels' and the
    whole vocabulary's); `logits_of`: the head and what the forward does to its logits (`HeadForm.logits`)."""
    logits = logits_of(hidden)
    if smoothing is None:
        return F.cross_entropy(logits.float(), target, ignore_index=ignore, reduction="sum")
    minus = -F.log_softmax(logits, dim=-1)
    padding = target.eq(ignore).unsqueeze(-1)
    nll = minus.gather(dim=-1, index=target.clamp(min=0).unsqueeze(-1)).masked_fill(padding, 0.0)
    smooth = minus.sum(dim=-1, keepdim=True, dtype=torch.float32).masked_fill(padding, 0.0)
    return nll.sum(), smooth.sum()


# -- what each chunking would do, measured ---------------------------------------------------------------------


@dataclass(frozen=True)
class HeadOption:
    """One way to run a causal LM's head and loss, measured aside (`measure`): its plan (`Loss+:1:-1@chunks8`;
    "" for the model's own head), the most it held above the level it started at, and its seconds."""

    plan: str
    held_bytes: int
    seconds: float
    bound_bytes: int = 0  # the most it was let hold before it ran (what step one's peak left free bounded it by)
    rows: int = 0  # the rows of logits it makes at once (every token for the model's own head); 0: not known


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

    def option(self, plan: str) -> Optional[HeadOption]:
        return next((o for o in self.options if o.plan == plan), None)

    def seconds(self, option: HeadOption) -> float:
        """`option`'s seconds, never below what chunking must add to the model's own head, where that was measured:
        a chunked way makes each chunk's logits again in backward (the head's three matmuls, one forward and two
        backward, become four), so it is taken at least a third slower than the own head. A chunked way measured
        faster than that is the clock's noise on a small head (two chunks were measured faster than the whole head
        on the tests' decoder, and `auto` chose them under a budget with room for everything)."""
        own = self.option("")
        if own is None or not option.plan:
            return option.seconds
        return max(option.seconds, own.seconds * 4 / 3)


def plan_of(chunking: Optional[Chunking]) -> str:
    """`Loss+:1:-1@chunks8` for a chunking, "" for the model's own head."""
    if chunking is None:
        return ""
    if chunking.tokens is not None:
        return f"Loss+:1:-1@tokens{chunking.tokens}"
    return f"Loss+:1:-1@chunks{chunking.chunks}" if chunking.chunks is not None else "Loss+:1:-1"


def candidate_chunks(tokens: int, hidden: int, vocab: int) -> List[int]:
    """Chunk counts worth offering: doubling from 2 up to where a chunk's logits hold no more than the final hidden
    states (vocabulary / hidden chunks); none where the logits are no bigger than the hidden states."""
    most = min(tokens, math.ceil(vocab / hidden))
    out, c = [], 2
    while c <= most:
        out.append(c)
        c *= 2
    if out and out[-1] < most:
        out.append(most)
    return out


def measure(lever: "ChunkedLoss", profile, resets: bool = True):
    """The head and loss run each way worth offering, alone, on the first step's shapes (hidden states and labels
    drawn from a generator of its own: the memory and time depend on the shapes only), read aside (`measure.aside`):
    the model's own head, each chunk count of `candidate_chunks`, and the chunking the step ran. Never with more
    memory than step one's peak left free: the ways are run from the fewest rows a chunk up, and a way whose bound
    (what the last way run held, and the most each further row can add) would take the process above step one's
    peak is not run (said in `why_not`). Returns a `HeadMeasure`, or the reason there is none."""
    from .. import _torch_api
    from ..measure.aside import current_bytes, held_aside
    from ..measure.storages import block_bytes

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
    if ran not in ways:
        ways.append(ran)
    params = [p for p in head.parameters() if p.requires_grad]
    autocast = getattr(torch, profile.autocast) if profile.autocast else None
    itemsize = torch.finfo(autocast).bits // 8 if autocast is not None else weight.element_size()
    # what any way holds besides its rows: the head's gradients (summed, and a chunk's), the hidden states' gradient
    # (by chunk, then whole), under autocast the weight's copy and its gradient; and what each row adds at most: a
    # chunk's logits and their gradient (in the head's dtype), their fp32 copy and log-softmax (its gradient), soft-
    # capped the cap's two intermediates, under autocast the chunk's hidden states cast and their gradient cast back.
    # Checked against what each way held (tests/test_torch_loss.py); every bound is taken `BOUND_MARGIN` higher, for
    # what the allocator rounds.
    fixed = 2 * sum(p.numel() * p.element_size() for p in params) + 2 * tokens * hidden * weight.element_size()
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
        with torch.autocast(device, dtype=autocast, enabled=autocast is not None):
            if chunking is None:
                logits = lever.logits_of(hidden_states)
                loss = F.cross_entropy(logits.float(), labels, reduction="sum")
                del logits
            else:
                rows = chunking.rows(tokens, hidden, vocab)
                parts = _chunked(lever.logits_of, hidden_states, labels, rows, -100, None)
                loss = functools.reduce(torch.add, parts)
                del parts
        grads = torch.autograd.grad(loss, [hidden_states, *params])
        del grads

    def rows_of(way: Optional[Chunking]) -> int:
        return tokens if way is None else min(tokens, way.rows(tokens, hidden, vocab))

    fake = _torch_api.is_fake(weight)
    # on the head's GPU as the current one: read there, and its generator given back (`held_aside`)
    with torch.cuda.device(weight.device) if device == "cuda" else contextlib.nullcontext():
        order = sorted(range(len(ways)), key=lambda k: rows_of(ways[k]))
        held, times, why_not, bounds = {}, {}, {}, {}
        last_rows, last_held = 0, fixed  # nothing run yet: what any way holds besides its rows
        for k in order:  # the first time each way runs: the kernels' one-time set-up, not timed, its bound checked
            bound = int((last_held + (rows_of(ways[k]) - last_rows) * per_row) * (1 + BOUND_MARGIN))
            room = profile.memory.peak.peak_bytes - current_bytes(device)  # again: a first run may keep buffers
            if bound > room and not fake:  # a dry run's tensors hold no memory: every way is counted
                why_not[plan_of(ways[k])] = (
                    f"it could hold up to {bound / 2**20:,.1f} MiB, and step one's peak left "
                    f"{max(room, 0) / 2**20:,.1f} MiB free"
                )
                continue
            most, seconds = held_aside(lambda: run(ways[k]), device, resets)
            held[k] = most
            bounds[k] = bound
            last_rows, last_held = rows_of(ways[k]), most
            if fake:  # a dry run's counts and times (a roofline of its ops) are the same every run: this one's
                times[k] = [seconds]
        if ways.index(ran) not in held:
            how = plan_of(ran) or "the model's own head"
            return f"the way the step ran the head ({how}) was not run alone: {why_not[plan_of(ran)]}"
        measured = [k for k in range(len(ways)) if k in held]
        # interleaved: what drifts (a warming allocator, another process) spreads evenly; a dry run's were read by
        # the first run
        for _ in range(0 if fake else REPEATS):
            for k in measured:
                most, seconds = held_aside(lambda: run(ways[k]), device, resets)
                if len(times.setdefault(k, [])) == 0:
                    held[k] = most  # warm: the first timed run's
                times[k].append(seconds)
        options = [
            HeadOption(plan_of(ways[k]), held[k], statistics.median(times[k]), bounds[k], rows_of(ways[k]))
            for k in measured
        ]
        logits = block_bytes(tokens * vocab * itemsize)
        return HeadMeasure(tokens, hidden, vocab, plan_of(ran), options, why_not, logits)


# -- its options for the solver, its rows for the table -------------------------------------------------------------


def choices(head: Optional[HeadMeasure], ran: str = "") -> List[LeverChoice]:
    """The ways the head and loss can run, as the solver weighs them (`budget.LeverChoice`, in the head's segment):
    the bytes each holds less than the way the step ran, and the seconds it takes more than the fastest way (a
    constant apart from what the step ran: the least total time is the same); where none was measured, the way the
    step ran (`ran`, its plan) alone.

    A way that holds more than the step's is weighed by its bound (what it was let take before it ran, above what
    it held): run alone, a way's bytes differ from what it adds in a step (a coarser head was measured 0.3 MiB
    short of its step's on the tests' wide decoder), and a choice that rests on that difference could peak over the
    budget; a way that holds less is weighed as measured (the table's PEAK DROP, within 2% of what runs measure).
    A way that makes more rows of logits at once than the step's (coarser chunks, or the model's own head) is
    weighed by its bound too, whatever it held alone: alone, what the rows add can fall under what every way holds
    besides them (the head's gradients), where in a step, on top of the layers' tensors, it does not (on Llama at
    tiny size chunks of 16 rows and of 8 held the same alone and 12 KiB apart in the step; on Qwen2-VL the own head
    held 28 KiB less than the step's chunks alone and 28 KiB more in the step: `auto` chose them over its budget)."""
    if head is None:
        return [_choice(ran)]
    ran_option = head.option(head.ran)
    fastest = min(head.seconds(o) for o in head.options)

    def held(o) -> int:
        if o.held_bytes > ran_option.held_bytes or o.rows > ran_option.rows:
            return max(o.held_bytes, o.bound_bytes)
        return o.held_bytes

    return [
        _choice(
            o.plan, ran_option.held_bytes - held(o), head.seconds(o) - fastest, head.logits_bytes if not o.plan else 0
        )
        for o in head.options
    ]


def _choice(plan: str, less: int = 0, seconds: float = 0.0, returned: int = 0) -> LeverChoice:
    """The `LeverChoice` of the head run as `plan` ("": the model's own head)."""
    option = plan.partition("@")[2] if plan else None
    return LeverChoice(SYNTAX.name, option, plan, ((HEAD_SEGMENT, less),) if less else (), seconds, returned)


def rows(head: Optional[HeadMeasure], drop) -> List[FoundPlan]:
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
                recompute_seconds=max(0.0, head.seconds(option) - head.seconds(base)),
                head=True,
                **(drop([_choice(option.plan, ran.held_bytes - option.held_bytes)]) if drop is not None else {}),
            )
        )
    return out


OWN_HEAD = "the model's own head"


def how_measured(head: HeadMeasure) -> str:
    """The table's note on how the head's ways were measured."""
    base = head.option("") or head.option(head.ran)
    against = "the model's own head" if base.plan == "" else f"{head.ran}, which the step ran"
    return (
        f"the head and loss (`Loss+` rows): each way run alone after step one on its shapes ({head.tokens:,} tokens, "
        f"hidden {head.hidden}, vocabulary {head.vocab:,}; random values: memory and time depend on the shapes) and "
        f"read after every op, once after a warm-up; the head alone held {base.held_bytes / MIB:,.1f} MiB at most "
        f"as {against}; SAVING is what a row's head holds less, PEAK DROP how much lower step one's peak would be "
        f"with it alone, TIME what it adds to a step (each chunk's logits made again in backward)"
        + "".join(f"; {plan or OWN_HEAD} was not run: {why}" for plan, why in head.why_not.items())
    )


LEVER = ChunkedLoss
