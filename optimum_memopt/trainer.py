"""The Trainer hook: the one place that touches Trainer internals.

`MemoptTrainerMixin` asks a backend (`optimum_memopt.backends`) to wrap the model inside
`Trainer._wrap_model`, the point where the Trainer is about to hand `self.model` to accelerate (DDP)
or DeepSpeed, so the order is `DeepSpeedEngine(ORTModule(model))` / `DistributedDataParallel(ORTModule(model))`.
A callback cannot do this: `on_train_begin` fires after `accelerator.prepare`.

During and after training `trainer.model` is the wrapped model (attribute access falls through to the
Hugging Face model). Evaluation and prediction run the plain PyTorch model, which shares the wrapped
model's parameters, so no second (inference) graph is exported. Checkpoints and `save_model` hold the
plain Hugging Face model, loadable with `from_pretrained` without ORT.
"""

import contextlib
import logging
import os
import sys
from typing import List, Optional

import transformers
from torch import nn
from transformers import Trainer, TrainerCallback

from . import checkpoints, transformers_releases
from .backends import Backend, WrapSettings, get_backend, optimizer_for
from .backends.base import Budget
from .callbacks.base import PlanLog
from .ort_trainer_parts import OrtTrainerParts, fire_pre_optimizer_step
from .trainer_args import MemoptTrainingArguments

logger = logging.getLogger(__name__)


IN_PROCESS = (
    "the budget solver's choice: from a dry run of step one, checked by step one (`--memory_auto_dry_run`, the "
    "default), or from step one measured with every layer recomputed whole, running from step two"
)


class _StepDone(TrainerCallback):
    """Tells the backend each optimizer step's end (the torch backend's budget solver counts steps by it)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        backend = self.trainer.memopt_backend
        wrapped = backend.find(self.trainer.model) if backend is not None else None
        if wrapped is not None:
            backend.step_done(wrapped)


class _OptimizerReady(TrainerCallback):
    """Gives the backend the optimizer once it exists (DeepSpeed builds it inside `accelerator.prepare`,
    after `_wrap_model`; `on_train_begin` is the first point where it does)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.message = None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        trainer = self.trainer
        # transformers 4.49 passes the optimizer given at __init__ (usually None) here: read the trainer's own.
        optimizer = trainer.optimizer if trainer.optimizer is not None else optimizer
        if getattr(trainer, "_memopt_over_ort_trainer", False) and optimizer is not None:
            fire_pre_optimizer_step(trainer, optimizer)
        if self.message is not None or trainer.memopt_backend is None or optimizer is None:
            return
        self.message = trainer.memopt_backend.on_optimizer_ready(optimizer, args, trainer.is_deepspeed_enabled) or ""
        if self.message and state.is_world_process_zero:
            logger.info("%s", self.message)


# What each training log line carries of the plugin's figures (rounded to 0.01) unless `--log_all_memory_metrics`:
# the step's peak, what forward left for backward, the input and label density, and (once) the plans. Every other
# figure is in the reports' CSVs (`memory_phases.csv`, `input_density.csv`) and `memory_plans.json`.
LOG_LINE_METRICS = (
    "memopt/mem_step_peak_mb",
    "memopt/mem_forward_held_mb",
    "memopt/embed_density_pct",
    "memopt/label_density_pct",
    "memopt/plans_found",
    "memopt/plans_on",
    "memopt/planned_saving_mb",
)


class MemoptTrainerMixin(OrtTrainerParts):
    """Trains through a memory backend (the torch backend, or ORTModule) with the settings of
    `MemoptTrainingArguments`; its ORT-only parts (optimum's ORTTrainer underneath, the in-graph loss) are
    `ort_trainer_parts.OrtTrainerParts`, its base.

    Put it first in the bases of any Trainer subclass: ``class MyTrainer(MemoptTrainerMixin, SFTTrainer)``.
    Over optimum's `ORTTrainer` (``class MyTrainer(MemoptTrainerMixin, ORTTrainer)``) the model is still wrapped
    once: where ORTTrainer builds its ORTModule, this backend builds it with the run's plans.
    It overrides `train` (resolves `--memory_opt_config auto` first), `_wrap_model` (wrap), `_save` and
    `_load_best_model` (the plain model), `training_step` / `compute_loss` (what the callbacks observe),
    `log` (the callbacks' metrics reach every reporter) and `get_optimizer_cls_and_kwargs` (`adamw_ort_fused`).
    """

    def __init__(self, *args, **kwargs):
        targs = kwargs.get("args", args[1] if len(args) > 1 else None)
        if not callable(getattr(Trainer, "_wrap_model", None)):
            raise RuntimeError(
                f"optimum-memopt wraps the model in `Trainer._wrap_model`, which transformers "
                f"{transformers.__version__} does not have: the run would train without the recompute asked for. "
                f"Use a transformers release optimum-memopt supports (setup.cfg), or pass `--memory_opt_backend none`"
            )
        if isinstance(targs, MemoptTrainingArguments) and targs.memory_opt_on:
            get_backend(targs.memory_opt.backend).before_trainer(targs)
        problem = transformers_releases.accelerate_problem()
        if problem:
            raise RuntimeError(problem)
        with self._memopt_ort_before_init(targs):  # optimum's ORTTrainer underneath, if it is (ort_trainer_parts)
            super().__init__(*args, **kwargs)
        if not isinstance(self.args, MemoptTrainingArguments):
            raise TypeError(
                f"{type(self).__name__} needs MemoptTrainingArguments, got {type(self.args).__name__}; build the "
                f"arguments with `MemoptTrainingArguments(...)` or `HfArgumentParser(MemoptTrainingArguments)`"
            )
        a = self.args
        logger.setLevel(a.get_process_log_level())
        logging.getLogger("optimum_memopt").setLevel(a.get_process_log_level())
        # what the run says of its plans: a few lines, the rest in output_dir's memory_plans.txt (rank 0)
        self.memopt_log: Optional[PlanLog] = PlanLog(a.output_dir) if self.is_world_process_zero() else None
        self.memopt_backend: Optional[Backend] = None
        if a.memory_opt_on:
            backend = get_backend(a.memory_opt.backend)
            refusal = backend.refusal(by_default=getattr(a, "_memopt_backend_by_default", False))
            if refusal:
                raise RuntimeError(refusal)
            backend.check(a)
            self.memopt_backend = backend
        self._memopt_plain_model = self.model
        self.memopt_handle = None  # the model under the backend, once wrapped (`optimum_memopt.api.MemoptHandle`)
        self._memopt_prepared = None
        self._memopt_wrap_seen = False
        self._memopt_ort_after_init(a)
        # The plans the run trains with: the validated ones, or auto's choice once `resolve_memory_plan` ran.
        self.memory_plan = (list(a.memory_opt.entries), a.memory_opt.level) if not a.memory_opt.auto else None
        self.memory_plan_reason: Optional[str] = None
        if a.process_index == 0:
            for note in a.memory_opt_warnings:
                logger.warning("%s", note)
            for note in a.memory_opt_notes:
                logger.info("%s", note)
            unsharded = _fsdp_asked_but_off(self)
            if unsharded:
                logger.warning("%s", unsharded)
        if self.model is not None:
            self._memopt_prepare(self.model)
        self.add_callback(_StepDone(self))  # before the plan table's callback: step one's memory is complete there
        from .callbacks import default_callbacks

        present = {type(cb) for cb in self.callback_handler.callbacks}
        for callback in default_callbacks(a, self):
            if type(callback) not in present:
                self.add_callback(callback)
        if a.memory_measure_out:
            from .advisor.measure import MeasureCallback

            self.add_callback(MeasureCallback(a.memory_measure_out, self))
        self._memopt_optimizer_ready = _OptimizerReady(self)
        self.add_callback(self._memopt_optimizer_ready)

    # -- the plans -----------------------------------------------------------------------------------
    def resolve_memory_plan(self, script_argv: Optional[List[str]] = None) -> str:
        """With `--memory_opt_config auto`: measure this script's plans under the budget and choose.

        ``script_argv`` is the command that re-runs this training script (default: ``sys.argv``, which
        needs a script file: from a notebook, pass it, or run `memopt-probe` and give its plans).
        Called by `train()`; returns the reason for the choice.
        """
        if self.memory_plan is not None:
            return self.memory_plan_reason or "plans given"
        if self.memopt_backend is not None and self.memopt_backend.plans_in_process:
            # chosen in this process from its first step (`WrapSettings.budget`), which runs with whole layers
            self.memory_plan = ([], 1)
            self.memory_plan_reason = IN_PROCESS
            return IN_PROCESS
        argv = list(script_argv if script_argv is not None else sys.argv)
        if not argv or not os.path.isfile(argv[0]):
            raise RuntimeError(
                f"`--memory_opt_config auto` re-runs the training script to measure plans, but this process has no "
                f"script to re-run (sys.argv[0] is {argv[:1]}); call `trainer.resolve_memory_plan(script_argv=["
                f"'train.py', ...])`, or run `memopt-probe --budget_mb MIB -- train.py ...` and pass the plans it "
                f"chooses, as in `--memory_opt_config Gelu+:1:-1`"
            )
        from .advisor.auto import choose_for_script
        from .callbacks.base import show

        # auto runs in one process; its progress and probe table reach a script without logging too (TRL's sft.py)
        entries, level, reason = choose_for_script(self.args, argv, progress=show)
        self.memory_plan, self.memory_plan_reason = (entries, level), reason
        return reason

    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        if resume_from_checkpoint:
            # a save cut short (a kill while `checkpoint-N/` was written) is skipped, not crashed on
            resume_from_checkpoint, notes = checkpoints.resolve(resume_from_checkpoint, self.args.output_dir)
            for note in notes:
                logger.warning("%s", note)
            problem = transformers_releases.resume_refusal()
            if problem:
                raise RuntimeError(problem)
        if self.args.memory_opt_on:
            self.resolve_memory_plan()
        self._memopt_wrap_seen = False  # each `train()` checks that the model it trains holds the backend
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_rng_state(self, checkpoint):
        try:
            return super()._load_rng_state(checkpoint)
        except transformers_releases.UNPICKLING_ERRORS:
            # transformers 4.51-4.52 with torch 2.4: the numpy types in the RNG state need allowlisting
            with transformers_releases.numpy_safe_globals():
                return super()._load_rng_state(checkpoint)

    # -- wrapping ------------------------------------------------------------------------------------
    @property
    def plain_model(self) -> nn.Module:
        """The Hugging Face model, outside any ORTModule / DDP / DeepSpeed wrapper."""
        return self._memopt_plain_model

    @property
    def backend_model(self):
        """The backend's module once training started (ORTModule, or the model whose layers the torch backend
        runs), else None."""
        return self.memopt_backend.find(self.model) if self.memopt_backend is not None else None

    @property
    def ort_model(self):
        """The name `backend_model` had when ORT was the only backend."""
        return self.backend_model

    def _memopt_prepare(self, model):
        if self.memopt_backend is None or model is self._memopt_prepared:
            return
        for line in self.memopt_backend.prepare(model):
            if self.args.process_index == 0:
                logger.warning("%s", line)
        self._memopt_prepared = model

    def memopt_wrap_settings(self) -> WrapSettings:
        a = self.args
        entries, level = self.memory_plan if self.memory_plan is not None else ([], 0)
        return WrapSettings(
            entries=entries,
            level=level,
            measure_memory=bool(a.print_memory_stats or a.memory_measure_out),
            options=self.memopt_backend.options(a) if self.memopt_backend is not None else {},
            budget=self._memopt_budget() if self.memory_plan_reason == IN_PROCESS else None,
            reset_peaks=bool(a.skip_memory_metrics),
            label_smoothing=float(a.label_smoothing_factor or 0.0),
            loss_reader="the Trainer's `compute_loss_func`" if self.compute_loss_func is not None else None,
            outputs_dropped=self._memopt_drops_outputs(),
        )

    def _memopt_drops_outputs(self) -> bool:
        """Whether the training step lets go of the model's outputs before its backward: transformers' own
        `training_step` and `compute_loss` run it (this mixin's hand on to them), no subclass's (TRL's, a user's),
        which may hold them longer (`WrapSettings.outputs_dropped`)."""
        for name in ("training_step", "compute_loss"):
            owner = next(
                c for c in type(self).__mro__ if name in vars(c) and not c.__module__.startswith("optimum_memopt")
            )
            if owner is not transformers.Trainer:
                return False
        return True

    def _memopt_budget(self) -> Budget:
        a = self.args
        rank0 = self.is_world_process_zero()
        grads = 0
        if a.gradient_accumulation_steps > 1 and self.model is not None:
            grads = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        return Budget(
            budget_mb=None if a.memory_opt.budget_mb is None else float(a.memory_opt.budget_mb),
            share=a.memory_opt.activation_budget,
            say=self.memopt_log.say if rank0 else (lambda text: None),
            detail=self.memopt_log.detail if rank0 else (lambda text: None),
            report_dir=os.path.join(a.output_dir, "memory_auto") if rank0 else None,
            grad_bytes=grads,
            grad_accum=a.gradient_accumulation_steps,
            autocast="bfloat16" if a.bf16 else ("float16" if a.fp16 else None),
            dry_run=a.memory_auto_dry_run,
            no_dry_run=self._memopt_no_dry_run(),
            ddp=self._memopt_ddp_processes(),
            plan_file=self._memopt_plan_file() if a.memory_plan_file is not None else None,
            instruments=self._memopt_instruments() if a.memory_auto_dry_run else None,
            keep_plan=self._memopt_keep_plan() if rank0 and a.memory_auto_dry_run else None,
            host_mb=a.memory_host_mb,
        )

    def _memopt_run_step(self):
        """The step this run is about to train as a plan file states one (`planning.plan_file.run_step`), for one
        process or DDP's; PlanFileError where the model has no config."""
        from .planning.plan_file import run_step

        a = self.args
        return run_step(
            self.model,
            device=a.device,
            autocast="bfloat16" if a.bf16 else ("float16" if a.fp16 else None),
            optimizer=getattr(a.optim, "value", a.optim),
            grad_accum=a.gradient_accumulation_steps,
            fsdp=1,
            ddp=self._memopt_ddp_processes(),
        )

    def _memopt_keep_plan(self):
        """Where `auto`'s dry run keeps its choice for the next run of this step: `memory_auto/plan.json` in the
        output directory, with this run's step (`--memory_plan_file` takes it); None where the model has no config
        to write (a run from the file compares it) or a plan file starts this run."""
        from .planning.plan_file import PlanFileError, keeper

        a = self.args
        if a.memory_plan_file is not None or self.model is None or self._memopt_no_dry_run() is not None:
            return None
        try:
            step = self._memopt_run_step()
        except PlanFileError:
            return None
        config = getattr(self.model, "config", None)
        return keeper(os.path.join(a.output_dir, "memory_auto", "plan.json"), step, type(config).__name__)

    @staticmethod
    def _memopt_instruments():
        """What `auto`'s dry run of step one is handed: the package's `optimize_memory` and the default device's
        roofline, as `memopt-plan` hands them (`planning.dry_run.instruments`): the same dry run, the same figure."""
        from .planning.dry_run import instruments

        return instruments()

    def _memopt_plan_file(self):
        """`--memory_plan_file`, read and compared with the step this run is about to train (the batch's shape at
        step one: `BudgetPlanner`); ValueError naming every difference, before any step."""
        from .planning.plan_file import FLAG, PlanFileError, read

        a = self.args
        path = a.memory_plan_file
        if getattr(self, "is_deepspeed_enabled", False):
            raise ValueError(
                f"`{FLAG} {path}`: memopt-plan plans no DeepSpeed step (ZeRO's partitions are DeepSpeed's own code); "
                f"drop `{FLAG}` (`auto` then measures step one), or train without `--deepspeed`"
            )
        if getattr(self, "is_fsdp_enabled", False):
            raise ValueError(
                f"`{FLAG} {path}`: a run starts from memopt-plan's choice on one process or under DDP; under FSDP "
                f"`auto` measures step one itself: drop `{FLAG}`"
            )
        try:
            plan = read(path)
            run = self._memopt_run_step()
            plan.check(run)
        except PlanFileError as e:
            raise ValueError(str(e)) from None
        return plan

    def _memopt_no_dry_run(self) -> Optional[str]:
        """Why `auto` cannot start from a dry run of this run's own step (None where it can): the model it would copy
        is the whole one, which FSDP and DeepSpeed shard after this point (`memopt-plan --fsdp` plans a sharded
        step)."""
        if getattr(self, "is_fsdp_enabled", False):
            return "FSDP shards the model after the plugin wraps it (`memopt-plan --fsdp` plans a sharded step)"
        if getattr(self, "is_deepspeed_enabled", False):
            return "DeepSpeed partitions the model and owns its optimizer"
        return None

    def _memopt_ddp_processes(self) -> int:
        """The processes DistributedDataParallel replicates the model over (what accelerate wraps it in with several
        processes and neither FSDP nor DeepSpeed on), else 1."""
        a = self.args
        sharded = getattr(self, "is_deepspeed_enabled", False) or getattr(self, "is_fsdp_enabled", False)
        return a.world_size if a.world_size > 1 and not sharded else 1

    def _memopt_plan_summary(self) -> str:
        if self.memory_plan_reason is None:
            return self.args.memory_opt_summary
        if self.memory_plan_reason == IN_PROCESS:
            return f"{self.args.memory_opt_summary}: {IN_PROCESS}"
        entries, level = self.memory_plan
        chosen = f"level {level}" if level else (",".join(map(str, entries)) or "no recompute")
        return f"{chosen} (chosen by auto: {self.memory_plan_reason})"

    def _wrap_model(self, model, training=True, dataloader=None):
        backend = self.memopt_backend
        if not training:
            if backend is not None and backend.find(model) is not None:
                return self._memopt_plain_model
            return super()._wrap_model(model, training=training, dataloader=dataloader)
        if backend is not None and backend.find(self.model) is None and model is self.model:
            # `model_init` builds a new model at train(): that is the one to prepare, wrap and save.
            # The Trainer hands `self.model` to accelerate / DeepSpeed right after this call.
            self.model = self.model_wrapped = model = self._memopt_wrap(self.model)
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    def _memopt_wrap(self, model):
        backend = self.memopt_backend
        self._memopt_plain_model = model
        self._memopt_prepare(model)
        inner = self._memopt_in_graph_loss(model)
        from .api import attach

        # the one path of `optimum_memopt.optimize_memory`; the Trainer reports each optimizer step (`step_done`)
        self.memopt_handle = attach(backend, inner, self.memopt_wrap_settings(), self.args.memory_opt)
        wrapped = self.memopt_handle.model
        if self.is_world_process_zero():
            logger.info(
                "Training through %s, memory optimizer: %s", backend.describe(wrapped), self._memopt_plan_summary()
            )
        return wrapped

    # -- what the callbacks observe --------------------------------------------------------------------
    def _memopt_notify(self, method: str, *args):
        for callback in self.callback_handler.callbacks:
            fn = getattr(callback, method, None)
            if fn is not None:
                fn(*args)

    def _memopt_check_wrapped(self, model) -> None:
        """A configured backend must be in the model the Trainer trains: never train silently without it."""
        backend = self.memopt_backend
        if backend is None or self._memopt_wrap_seen:
            return
        if backend.find(model) is None and backend.find(self.model) is None:
            raise RuntimeError(
                f"optimum-memopt: `--memory_opt_backend {backend.name}` is configured, but the model this Trainer "
                f"trains ({type(model).__name__}) holds no module of that backend: transformers "
                f"{transformers.__version__} trained a model that did not pass through `Trainer._wrap_model`, where "
                f"the backend wraps it, so the run would go on without the recompute asked for. Use a transformers "
                f"release optimum-memopt supports (setup.cfg), or pass `--memory_opt_backend none` to train without it"
            )
        self._memopt_wrap_seen = True

    def training_step(self, model, inputs, *args, **kwargs):
        self._memopt_check_wrapped(model)
        # Every micro-batch, before the loss is computed (a label smoother or a custom compute_loss may pop labels).
        self._memopt_notify("observe_batch", inputs, self.state)
        return super().training_step(model, inputs, *args, **kwargs)

    def compute_loss(self, model, inputs, *args, **kwargs):
        handle = self.memopt_handle
        if (
            self.label_smoother is not None
            and model.training
            and handle is not None
            and handle.backend.smooths_labels(handle.model)
        ):
            # the model's training forward smooths the labels itself (a chunked head makes no whole logits): it is
            # handed the labels, as it is without label smoothing
            smoother, self.label_smoother = self.label_smoother, None
            try:
                result = super().compute_loss(model, inputs, *args, **kwargs)
            finally:
                self.label_smoother = smoother
        else:
            result = super().compute_loss(model, inputs, *args, **kwargs)  # the in-graph loss: ort_trainer_parts
        loss = result[0] if isinstance(result, tuple) else result
        if model.training and getattr(loss, "requires_grad", False):
            self._memopt_notify("observe_loss", loss)
        return result

    # -- saving and loading ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _memopt_plain_in_place(self):
        current = self.model
        self.model = self._memopt_plain_model
        try:
            yield
        finally:
            self.model = current

    def _save(self, output_dir: Optional[str] = None, state_dict=None):
        if self.args.memory_measure_out:
            logger.info("measuring run (--memory_measure_out): the model is not saved")
            return None
        with self._memopt_plain_in_place():
            return super()._save(output_dir, state_dict=state_dict)

    def _load_best_model(self, *args, **kwargs):
        # The plain model shares its parameters with the wrapped one, so loading into it updates both.
        with self._memopt_plain_in_place():
            return super()._load_best_model(*args, **kwargs)

    # -- metrics -------------------------------------------------------------------------------------
    def log(self, logs, *args, **kwargs):
        # Reporting callbacks run before user callbacks in on_log, so metrics added there would reach no
        # reporter; merging here sends them through every reporter and the log history. A new dict, so the
        # caller's own (the train / eval metrics returned to the script) is left as it was.
        if not any(k.startswith(("eval_", "test_")) for k in logs):
            extra = {}
            for callback in self.callback_handler.callbacks:
                pop = getattr(callback, "pop_metrics", None)
                if pop is not None:
                    extra.update(pop())
            if extra and not getattr(self.args, "log_all_memory_metrics", False):
                extra = {k: v for k, v in extra.items() if k in LOG_LINE_METRICS}
            if extra:
                logs = {**logs, **{k: round(v, 2) if isinstance(v, float) else v for k, v in extra.items()}}
        return super().log(logs, *args, **kwargs)

    # -- optimizer -----------------------------------------------------------------------------------
    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        chosen = optimizer_for(args)  # a backend's own `--optim` name (`adamw_ort_fused`)
        if chosen is not None:
            cls, kwargs, message = chosen
            if args.process_index == 0:
                logger.warning("%s", message) if "instead" in message else logger.info("%s", message)
            return cls, kwargs
        return Trainer.get_optimizer_cls_and_kwargs(args, model)


def _fsdp_asked_but_off(trainer) -> Optional[str]:
    """FSDP asked for (`--fsdp`, or accelerate's FSDP config) but not turned on: accelerate 1.15 turns it on for
    GPU-type process groups only, and on the CPU the Trainer then trains unsharded without a word (docs/STACK.md).
    What the run really does, to be said once on rank 0: every memory figure after it is that run's."""
    args = trainer.args
    asked = bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("true", "1")
    if not asked or getattr(trainer, "is_fsdp_enabled", False) or getattr(trainer, "is_fsdp_xla_enabled", False):
        return None
    state = trainer.accelerator.state
    kind = getattr(state.distributed_type, "value", state.distributed_type)
    how = (
        f"DistributedDataParallel over {state.num_processes} processes, each holding the whole model"
        if state.num_processes > 1
        else "one process holding the whole model"
    )
    import accelerate

    return (
        f"FSDP was asked for (`--fsdp` or accelerate's FSDP config), but accelerate {accelerate.__version__} did not "
        f"turn it on for this run (its distributed type is {kind}; it turns FSDP on for GPU-type process groups "
        f"only): the Trainer trains with {how}, not sharded, and the memory figures reported are that run's"
    )


class MemoptTrainer(MemoptTrainerMixin, Trainer):
    """`transformers.Trainer` training through a memory-optimizer backend; see `MemoptTrainerMixin`."""
