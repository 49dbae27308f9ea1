"""The Trainer hook: the one place that touches Trainer internals.

`MemoptTrainerMixin` wraps the model in ORTModule inside `Trainer._wrap_model`, the point where
the Trainer is about to hand `self.model` to accelerate (DDP) or DeepSpeed, so the order is
`DeepSpeedEngine(ORTModule(model))` / `DistributedDataParallel(ORTModule(model))`. A callback
cannot do this: `on_train_begin` fires after `accelerator.prepare`.

During and after training `trainer.model` is the ORTModule (attribute access falls through to
the Hugging Face model). Evaluation and prediction run the plain PyTorch model, which shares the
ORTModule's parameters, so no second (inference) graph is exported. Checkpoints and
`save_model` hold the plain Hugging Face model, loadable with `from_pretrained` without ORT.
"""

import contextlib
import logging
import os
from typing import Optional

import torch
from torch import nn
from transformers import Trainer, TrainerCallback

from . import ort
from .trainer_args import MemoptTrainingArguments

logger = logging.getLogger(__name__)


def smoothed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, epsilon: float, ignore_index: int = -100):
    """Cross-entropy with label smoothing, averaged over labels that are not ignored.

    Written out with log_softmax and gather because ORT 1.19's exporter refuses
    `cross_entropy(label_smoothing=...)` ("ONNX does not support label_smoothing"). Same value as
    the Trainer's LabelSmoother: (1 - eps) * NLL + eps * mean over classes of -log p.
    """
    log_probs = torch.log_softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
    labels = labels.reshape(-1)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    nll = -log_probs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    smooth = -log_probs.mean(dim=-1)
    per_label = (1.0 - epsilon) * nll + epsilon * smooth
    weights = valid.to(per_label.dtype)
    return (per_label * weights).sum() / weights.sum().clamp(min=1.0)


class LossInGraph(nn.Module):
    """Runs the model and returns only its loss, so the loss is computed inside ORT's graph and the
    logits never leave it (ORT can then drop ignored labels before the loss: label sparsity).

    With ``label_smoothing`` > 0 the smoothed cross-entropy is computed here, inside the graph,
    for models whose labels align with their logits (sequence classification, masked LM).
    """

    def __init__(self, model: nn.Module, label_smoothing: float = 0.0):
        super().__init__()
        self.model = model
        self.label_smoothing = float(label_smoothing)

    def forward(self, *args, **kwargs):
        labels = kwargs.get("labels")
        if self.label_smoothing > 0 and labels is not None:
            kwargs = {k: v for k, v in kwargs.items() if k != "labels"}
            logits = self.model(*args, **kwargs)["logits"]
            loss = smoothed_cross_entropy(logits, labels, self.label_smoothing)
        else:
            outputs = self.model(*args, **kwargs)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
        return (loss,)


def use_eager_attention(model: nn.Module) -> bool:
    """Switch SDPA attention modules to their eager parent class in place.

    ORT 1.19's gradient builder fails on the graph the SDPA path exports (BERT / RoBERTa), while
    the eager path trains. The SDPA classes subclass the eager ones without new state, so the
    switch keeps every parameter. Returns True when something was switched.
    """
    switched = False
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
        config._attn_implementation = "eager"
        switched = True
    for module in model.modules():
        cls = type(module)
        if "Sdpa" in cls.__name__ and len(cls.__mro__) > 1 and issubclass(cls, cls.__mro__[1]):
            parent = cls.__mro__[1]
            if parent is not nn.Module and "Sdpa" not in parent.__name__:
                module.__class__ = parent
                switched = True
        if getattr(module, "attn_implementation", None) == "sdpa":
            module.attn_implementation = "eager"
            switched = True
    return switched


def fp16_optimizer_decision(args, deepspeed_enabled: bool, cuda: bool):
    """Whether ORT's FP16_Optimizer applies, and why (logged either way).

    It replaces the overflow check and gradient-norm code of DeepSpeed's ZeRO stage 1/2 fp16
    optimizer with fused versions; it has nothing to improve elsewhere.
    """
    if not args.use_ort:
        return False, "ORT's FP16_Optimizer skipped: --use_ort false"
    if not args.fp16:
        return False, "ORT's FP16_Optimizer skipped: it only changes fp16 training (--fp16 is off)"
    if not cuda:
        return False, "ORT's FP16_Optimizer skipped: fp16 training needs CUDA"
    if not deepspeed_enabled:
        return False, ("ORT's FP16_Optimizer skipped: it complements DeepSpeed's (or Apex's) fp16 optimizer; "
                       "with torch AMP the GradScaler already does that work")
    return True, "ORT's FP16_Optimizer applied to DeepSpeed's ZeRO fp16 optimizer"


class _Fp16OptimizerHook(TrainerCallback):
    """Applies ORT's FP16_Optimizer once DeepSpeed built its optimizer (inside accelerator.prepare,
    so after `_wrap_model`); `on_train_begin` is the first point where it exists."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.decision = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        if self.decision is not None:
            return
        apply, reason = fp16_optimizer_decision(args, self.trainer.is_deepspeed_enabled, torch.cuda.is_available())
        self.decision = (apply, reason)
        if apply:
            from onnxruntime.training.optim.fp16_optimizer import FP16_Optimizer

            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds DeepSpeed's optimizer
            FP16_Optimizer(inner)  # modifies the instance in place
        if state.is_world_process_zero and (apply or args.fp16):
            logger.info("%s", reason)


class MemoptTrainerMixin:
    """Trains through ORTModule with the settings of `MemoptTrainingArguments`.

    Put it first in the bases of any Trainer subclass: ``class MyTrainer(MemoptTrainerMixin, SFTTrainer)``.
    It overrides `_wrap_model` (wrap), `_save` (save the plain model), `log` (merge the callbacks'
    metrics so every reporter sees them) and `get_optimizer_cls_and_kwargs` (`adamw_ort_fused`).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, MemoptTrainingArguments):
            raise TypeError(
                f"{type(self).__name__} needs MemoptTrainingArguments, got {type(self.args).__name__}; build the "
                f"arguments with `MemoptTrainingArguments(...)` or `HfArgumentParser(MemoptTrainingArguments)`"
            )
        self._memopt_plain_model = self.model
        self._memopt_loss_wrapper: Optional[LossInGraph] = None
        if self.args.use_ort and use_eager_attention(self.model):
            logger.warning(
                "Switched %s from SDPA to eager attention: ONNX Runtime Training 1.19 cannot build the gradient "
                "of the SDPA graph. Load the model with attn_implementation='eager' to skip this switch.",
                type(self.model).__name__,
            )
        if self.args.use_ort and self.args.ort_loss_in_graph:
            # The label smoother would pop the labels before the forward; LossInGraph applies the smoothing inside.
            self.label_smoother = None
        from .callbacks import default_callbacks

        present = {type(cb) for cb in self.callback_handler.callbacks}
        for callback in default_callbacks(self.args):
            if type(callback) not in present:
                self.add_callback(callback)
        from .advisor.measure import ENV_OUT, MeasureCallback

        if os.environ.get(ENV_OUT):  # a probe child: report peak memory and step times
            self.add_callback(MeasureCallback(os.environ[ENV_OUT]))
        if self.args.use_ort and self.args.memory_opt_auto:
            from .advisor.auto import resolve_auto

            resolve_auto(self.args)
        self.fp16_optimizer_hook = _Fp16OptimizerHook(self)
        self.add_callback(self.fp16_optimizer_hook)
        # Said here, once and on rank 0; the arguments are built on every rank.
        if self.args.optimizer_note and self.is_world_process_zero():
            level = logging.INFO if torch.cuda.is_available() else logging.WARNING  # a replacement is worth a warning
            logger.log(level, "optimizer: %s", self.args.optimizer_note)

    # -- wrapping ------------------------------------------------------------------------------
    @property
    def plain_model(self) -> nn.Module:
        """The Hugging Face model, outside any ORTModule / DDP / DeepSpeed wrapper."""
        return self._memopt_plain_model

    @property
    def ort_model(self):
        """The ORTModule once training started, else None."""
        return ort.find_ort_module(self.model)

    def _memopt_settings(self) -> ort.OrtSettings:
        a = self.args
        return ort.OrtSettings(
            entries=a.memory_opt_entries,
            level=a.memory_opt_level,
            log_level=a.ort_log_level,
            fallback_policy=a.ort_fallback_policy,
            save_onnx_dir=a.ort_save_onnx_dir,
            cache_dir=a.ort_cache_dir,
        )

    def _wrap_model(self, model, training=True, dataloader=None):
        if not training:
            if ort.find_ort_module(model) is not None:
                return self._memopt_plain_model
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        if self.args.use_ort and not ort.is_ort_module(self.model) and model is self.model:
            inner = self.model
            if self.args.ort_loss_in_graph:
                self._memopt_loss_wrapper = LossInGraph(inner, self.args.label_smoothing_factor)
                inner = self._memopt_loss_wrapper
            wrapped = ort.wrap_model(inner, self._memopt_settings())
            if self.is_world_process_zero():
                logger.info("Training through ORTModule, memory optimizer: %s", self.args.memory_opt_summary)
            # The Trainer hands `self.model` to accelerate / DeepSpeed right after this call.
            self.model = self.model_wrapped = model = wrapped
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    # -- saving --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _memopt_plain_in_place(self):
        current = self.model
        self.model = self._memopt_plain_model
        try:
            yield
        finally:
            self.model = current

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        if state_dict is not None and self._memopt_loss_wrapper is not None:
            state_dict = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state_dict.items()}
        with self._memopt_plain_in_place():
            return super()._save(output_dir, state_dict=state_dict)

    # -- metrics -------------------------------------------------------------------------------
    def log(self, logs, *args, **kwargs):
        # Reporting callbacks run before user callbacks in on_log, so metrics added there would reach
        # no reporter; merging here sends them through every reporter and the log history.
        if not any(k.startswith(("eval_", "test_")) for k in logs):
            for callback in self.callback_handler.callbacks:
                pop = getattr(callback, "pop_metrics", None)
                if pop is not None:
                    logs.update(pop())
        return super().log(logs, *args, **kwargs)

    # -- optimizer -----------------------------------------------------------------------------
    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        if getattr(args, "ort_fused_adam", False) and torch.cuda.is_available():
            from onnxruntime.training.optim import FusedAdam

            kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
            return FusedAdam, kwargs
        return Trainer.get_optimizer_cls_and_kwargs(args, model)


class MemoptTrainer(MemoptTrainerMixin, Trainer):
    """`transformers.Trainer` training through ORTModule; see `MemoptTrainerMixin`."""
