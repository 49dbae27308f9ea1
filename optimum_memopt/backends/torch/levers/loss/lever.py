"""The loss lever on one model (`ChunkedLoss`, the lever protocol's `Lever`): which models it takes (`causal_lm`,
`loss_problem`), its forward put on the causal LM's class, and the loss it computes there chunk by chunk.
"""

import functools
import inspect
import logging
import math
import os
import types
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .....plans import FoundPlan, LeverOption
from ... import _torch_api
from ...decide.budget import LeverChoice
from ..protocol import Lever
from .chunks import chunk_losses, smoother_counts_items
from .head_form import head_form
from .measure import HEAD_MARK, HeadMeasure, head_marked, how_measured, measure, taken_over
from .measure import choices as options_of
from .measure import rows as rows_of
from .option import SYNTAX, Chunking, plan_of

logger = logging.getLogger(__name__)


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


# what TRL's fused forward (`trl.trainer.utils.add_fused_lm_head`, 1.16) closes over from the call that made it
_FUSED_SETTINGS = ("temperature", "cast_lm_head_to_fp32", "outputs")


def fused_onto(model: nn.Module, twin: nn.Module, device: Optional[torch.device] = None) -> None:
    """TRL's fused LM head put on `twin` (`decide.from_plan.twin_of(model)`, which drops every forward set on an
    instance) wherever TRL put it on `model`, with the settings it was made with (read from what TRL's forward closes
    over): the dry run then runs the head the step runs (TRL's tiles of 32,768 logits a row whatever the vocabulary,
    not the model's own head). `NoTwin` where it cannot: on `device` (the model's own by default) CUDA or XPU, where
    TRL scores only the positions the labels leave in, in Triton kernels (a count of positions fake tensors do not
    hold); a TRL whose settings cannot be read."""
    from ...decide.from_plan import NoTwin

    fused = {name: vars(module)["forward"] for name, module in model.named_modules() if fused_by_trl(module)}
    if not fused:
        return
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    if device.type in ("cuda", "xpu"):  # where TRL runs kernels of its own (`trl.kernels`)
        raise NoTwin(
            f"TRL's fused LM head (`SFTTrainer`) scores on {device.type.upper()} only the positions the labels' "
            f"values leave in, in kernels of its own, which a dry run on fake tensors cannot run"
        )
    from trl.trainer.utils import add_fused_lm_head

    for name, forward in fused.items():
        function = getattr(forward, "__func__", forward)
        cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
        missing = [setting for setting in _FUSED_SETTINGS if setting not in cells]
        if missing:
            raise NoTwin(
                f"TRL's fused LM head (`SFTTrainer`) was made by a TRL whose settings ({', '.join(missing)}) could "
                f"not be read, so a dry run could not run the head the step runs"
            )
        add_fused_lm_head(twin.get_submodule(name), **{s: cells[s].cell_contents for s in _FUSED_SETTINGS})


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
        # the loop lets go of the forward's outputs before its backward (`WrapSettings.outputs_dropped`): the model's
        # own head's logits are not counted as held through the step (`measure`)
        self.outputs_dropped = False
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
    def build(cls, model, settings, option: Optional[LeverOption], n_layers: int):
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
                    f"`--memory_opt_config` has {SYNTAX.plan_of(option)!r}, but {problem}; drop `Loss+` to train "
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
            lever.outputs_dropped = settings.outputs_dropped
            # step one runs with the least memory any choice needs: every layer whole, the head in chunks whose
            # logits hold no more than the hidden states; `auto` may choose another way as step two's first layer
            # starts (each way measured after step one, where it fits what step one's peak or the budget left free)
            lever.run_as(LeverOption())
            return lever, None
        lever = cls(causal_lm(model), Chunking.of(option))
        lever.smoothing = settings.label_smoothing or None
        lever.outputs_dropped = settings.outputs_dropped
        if lever.trl:
            logger.warning(
                "`%s`: the model's head is chunked already by TRL's fused LM head (`SFTTrainer`), which runs its own "
                "forward; it is not chunked twice, and the step's head and loss are what TRL's head makes of them",
                SYNTAX.plan_of(option),
            )
        lever.install()
        return lever, None

    @property
    def option(self) -> Optional[LeverOption]:
        return self.chunking.option if self.installed and self.chunking is not None else None

    def plan(self) -> str:
        """How the head runs now, as a plan (`Loss+:1:-1@chunks8`; "": the model's own head)."""
        return plan_of(self.chunking) if self.installed else ""

    def smooths_labels(self) -> bool:
        return self.installed and self.smoothing is not None

    def run_as(self, option: Optional[LeverOption]) -> None:
        """Run the head from the next head and loss on (the solver's choice, made between steps or as a step's first
        layer starts): chunked as `option` says (`Chunking.of`), or None: the model's own head."""
        self.chunking = None if option is None else Chunking.of(option)
        if self.chunking is not None:
            self.install()

    @classmethod
    def onto_twin(cls, model, twin) -> None:
        """TRL's fused LM head, where `SFTTrainer` put it on the model (`fused_onto`)."""
        fused_onto(model, twin)

    def marks(self):
        """The head (the model's output embeddings), marked as `HEAD_MARK`: the head's segment holds the peak of each
        stretch it runs in apart from the rest of the segment (the final norm's forward and backward), which its ways
        move (`measure.choices`)."""
        head = self.lm.get_output_embeddings()
        return [(head, HEAD_MARK)] if isinstance(head, nn.Module) and not self.trl else []

    def measured_modules(self):
        head = self.lm.get_output_embeddings()
        return [head] if isinstance(head, nn.Module) and not self.trl else []

    def after_step_one(self, profile, resets: bool) -> None:
        """Between step one and step two (a step reported ended): measure each way the head can run (`measure`)
        into the profile, for the table and the solver."""
        result = measure(self, profile, resets)
        if isinstance(result, str):
            profile.lever_problems[self.name] = result
        else:
            profile.levers[self.name] = result

    def adopt(self, measured, profile) -> bool:
        """The run's dry run's ways of the head (`measure.taken_over`): the same step's shapes, the way step one ran
        among them."""
        if not isinstance(measured, HeadMeasure) or self.trl or (len(profile.shape) < 2 and self.tokens is None):
            return False
        ran = self.chunking if self.installed else None
        taken = taken_over(measured, ran, self.tokens or math.prod(profile.shape[:-1]))
        if taken is None:
            return False
        profile.levers[self.name] = taken
        return True

    def choices(self, profile, measured=None) -> List[LeverChoice]:
        ran = self.chunking if self.installed else None
        return options_of(profile.levers.get(self.name), ran, head_marked(profile.memory))

    def rows(self, profile, drop) -> List[FoundPlan]:
        return rows_of(profile.levers.get(self.name), drop, head_marked(profile.memory))

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
        # a dry run's step is not the run's (`auto`'s choice may leave the head whole): it says nothing
        if not _torch_api.is_fake(hidden):
            self._once(
                "logits",
                f"`Loss+`: {type(lm).__name__}'s training forwards return no logits (`outputs.logits` is None): the "
                f"head and its loss run in {self.chunking.describe()}, and the whole logits never exist; a "
                f"`compute_loss` or callback that reads them in training gets None (evaluation and `predict` keep the "
                f"whole logits)",
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
            count = {"num_items_in_batch": extra.get("num_items_in_batch")} if smoother_counts_items() else {}
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
        parts = chunk_losses(self.logits_of, flat, target, rows, ignore, self.smoothing)
        self.calls += 1
        self.last = {"tokens": flat.shape[0], "rows": rows, "chunks": len(parts)}
        count = kwargs.get("num_items_in_batch")
        if self.smoothing is not None and not smoother_counts_items():
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
