"""The Trainer hook's ONNX Runtime parts, in one place: optimum's `ORTTrainer` underneath the mixin (optimum <= 1.27,
the ORT stack) and the loss computed inside ORT's graph (`--ort_loss_in_graph`). `OrtTrainerParts` is a base of
`MemoptTrainerMixin`, between it and the Trainer class; with the torch backend, or none, nothing here acts.
"""

import contextlib
from typing import Optional

from .losses import LossInGraph


def fire_pre_optimizer_step(trainer, optimizer) -> None:
    """optimum's ORTTrainer runs a copy of an older training loop that fires no `on_pre_optimizer_step` (where the
    memory phases take `post_backward`): fire it from the optimizer's own step pre-hook, as the loop would just
    before `optimizer.step()`."""
    inner = optimizer
    while hasattr(inner, "optimizer"):  # accelerate's / DeepSpeed's wrappers
        inner = inner.optimizer
    if getattr(inner, "_memopt_pre_step_hook", None) is not None:
        return

    def pre_step(opt, args, kwargs):
        trainer.control = trainer.callback_handler.on_pre_optimizer_step(trainer.args, trainer.state, trainer.control)

    inner._memopt_pre_step_hook = inner.register_step_pre_hook(pre_step)


def is_optimum_ort_trainer(cls) -> bool:
    """Whether a Trainer class derives from optimum's `ORTTrainer` (optimum <= 1.27), which wraps the model in
    ORTModule itself inside its own training loop."""
    return any(c.__name__ == "ORTTrainer" and c.__module__.startswith("optimum.onnxruntime") for c in cls.__mro__)


@contextlib.contextmanager
def _attribute(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def check_ort_trainer_args(args) -> None:
    """What cannot hold when optimum's ORTTrainer runs the training loop (it always wraps in ORTModule)."""
    if not args.memory_opt_on:
        raise ValueError(
            "`--memory_opt_backend none` with optimum's ORTTrainer: ORTTrainer always trains through ORTModule; for a "
            "plain PyTorch run put MemoptTrainerMixin over transformers' Trainer (`MemoptTrainer`) instead"
        )
    if args.memory_opt.backend != "ort":
        raise ValueError(
            f"`--memory_opt_backend {args.memory_opt.backend}` with optimum's ORTTrainer: ORTTrainer wraps the model "
            f"in ORTModule itself, so only `--memory_opt_backend ort` applies there; for the torch backend use "
            f"`MemoptTrainer`"
        )


class OrtTrainerParts:
    """The mixin's ORT-only overrides: optimum's ORTTrainer's loop (its `ModuleWithLoss`, its ORTModule, its missing
    `on_pre_optimizer_step`) and the in-graph loss (the model wrapped in `LossInGraph`, the label smoother left to the
    graph in training, the wrapper's `model.` prefix taken off what is saved)."""

    _memopt_over_ort_trainer = False
    _memopt_loss_wrapper: Optional[LossInGraph] = None

    def _memopt_ort_before_init(self, targs):
        """Before the Trainer's `__init__`: whether optimum's ORTTrainer is underneath, its arguments checked; the
        context to run that `__init__` in."""
        from .trainer_args import MemoptTrainingArguments

        self._memopt_over_ort_trainer = is_optimum_ort_trainer(type(self))
        if self._memopt_over_ort_trainer and isinstance(targs, MemoptTrainingArguments):
            check_ort_trainer_args(targs)
        return self._memopt_optimum_args(targs)

    def _memopt_ort_after_init(self, args) -> None:
        self._memopt_loss_wrapper = None
        if args.memory_opt_on and args.ort_loss_in_graph:
            # The loss is computed in the graph from the labels alone: the Trainer scales it for gradient
            # accumulation itself. (transformers 4.47 would otherwise read LossInGraph's **kwargs as a model that
            # takes num_items_in_batch and skip that scaling.)
            self.model_accepts_loss_kwargs = False

    def _memopt_in_graph_loss(self, model):
        """The model the backend wraps: with `--ort_loss_in_graph`, inside `LossInGraph`."""
        if self.args.ort_loss_in_graph:
            self._memopt_loss_wrapper = model = LossInGraph(model, self.args.label_smoothing_factor)
        return model

    def train(self, *args, **kwargs):
        if not self._memopt_over_ort_trainer:
            return super().train(*args, **kwargs)
        # With `use_module_with_loss`, ORTTrainer.train() trains `self._training_model` (its ModuleWithLoss, not
        # built here): the model itself, whose loss the backend computes in the graph.
        self._training_model = self.model
        with self._memopt_builds_ort_trainers_module():
            return super().train(*args, **kwargs)

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self._memopt_loss_wrapper is None or model is self._memopt_plain_model:
            return super().compute_loss(model, inputs, *args, **kwargs)
        # The smoothing is computed inside the graph (LossInGraph); in evaluation the smoother applies as usual.
        smoother, self.label_smoother = self.label_smoother, None
        try:
            return super().compute_loss(model, inputs, *args, **kwargs)
        finally:
            self.label_smoother = smoother

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        if state_dict is not None and self._memopt_loss_wrapper is not None:
            state_dict = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in state_dict.items()}
        return super()._save(output_dir, state_dict=state_dict)

    def _memopt_optimum_args(self, targs):
        """optimum's ORTTrainer builds its `ModuleWithLoss` in `__init__` when `use_module_with_loss` is set, and that
        class cannot be built with transformers >= 4.46 (docs/STACK.md); the arguments already turned the flag into
        the in-graph loss, so ORTTrainer's `__init__` sees it off (the arguments keep it as given)."""
        if self._memopt_over_ort_trainer and getattr(targs, "use_module_with_loss", False):
            return _attribute(targs, "use_module_with_loss", False)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def _memopt_builds_ort_trainers_module(self):
        """While ORTTrainer trains, `torch_ort.ORTModule` (which its loop imports to wrap the model) builds the
        module through this trainer's backend, with the run's plans; `isinstance` checks still see ORT's class."""
        import torch_ort

        real = torch_ort.ORTModule
        trainer = self

        class _Through(type):
            def __instancecheck__(cls, obj):
                return isinstance(obj, real)

            def __call__(cls, module, debug_options=None):
                # ORTTrainer's DebugOptions come from `--save_onnx` / `--onnx_prefix`, which the arguments turned
                # into `--ort_save_onnx_dir`; the backend builds the same options from those.
                if trainer.memopt_backend.find(module) is not None:
                    return module  # already wrapped (a second train() call): wrapped once
                return trainer._memopt_wrap(module)

        torch_ort.ORTModule = _Through("ORTModule", (), {})
        try:
            yield
        finally:
            torch_ort.ORTModule = real
