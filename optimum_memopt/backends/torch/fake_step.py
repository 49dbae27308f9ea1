"""A training step at real size on fake tensors: the torch backend's own instrument for `auto`'s dry run of a run's
step one (`decide.from_plan`) and for `memopt-plan`'s tables (`planning.dry_run`, a thin caller): one code path, one
figure. The model (built from its config, or a run's own twin on the meta device) trains a few steps under
`FakeTensorMode` (shapes and dtypes, no memory, no weights), with the backend's engine, levers and planner in place
exactly as in training, and every tensor storage counted as CUDA's caching allocator counts it
(`measure.storages.StorageCount`).

What puts the backend on the model and what the ops are timed by come from above (`Instruments`: the package's
`optimize_memory`, a device's rates from `planning.devices`): this module imports nothing of the package outside the
torch backend (tests/test_seam.py).

What a run counts at its highest is split into parts as each storage was made: the weights (the model and its
adapters, built before training), the gradients (a parameter's `.grad`, moved there as autograd stores it), the
optimizer's state (made inside `optimizer.step` and kept), the activations (made by the layers' forward and the
backward through them, recomputes included), the head and loss (made after the last layer's forward until backward
reaches it), and other (the batch, masks and position tables made before the first layer, the optimizer's
temporaries).

Not seen by a dry run, and said as a margin wherever its figures are shown: the CUDA context, the caching
allocator's rounding beyond 512 bytes and its fragmentation, and what one op holds inside itself (an attention
backward's FP32 buffer for the queries' gradient, a reduction's staging). cuBLAS's workspaces are counted where the
caller gives them (`held_bytes`: a plan for a card, `devices.WORKSPACES_MIB`; a training run's own step, what its
device holds once they are made).
"""

import contextlib
import copy
import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Dict, Iterator, List, Optional

import torch

from . import _torch_api
from .apply.layers import STATE, find_layers, run_order_problem
from .measure import dropout
from .measure.attention import CudaKernels, on_cuda
from .measure.op_costs import OpCosts, clock_for
from .measure.profile import INPUT_KEPT, Place
from .measure.replay import MARK, LayerReplay, ReplayMismatch
from .measure.storages import StorageCount, block_bytes
from .nested import tensors_in

logger = logging.getLogger(__name__)

MIB = float(1024 * 1024)

WEIGHTS = "weights"
GRADIENTS = "gradients"
OPTIMIZER = "optimizer state"
ACTIVATIONS = "activations"
HEAD = "head and loss"
OTHER = "other"
PARTS = (WEIGHTS, GRADIENTS, OPTIMIZER, ACTIVATIONS, HEAD, OTHER)

# The Trainer's `--optim` names a dry run builds (the Trainer's default first), and how.
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "sgd", "adafactor")

NOT_SEEN = (
    "the CUDA context, the caching allocator's rounding beyond 512 bytes and its fragmentation, and what one op holds "
    "inside itself (an attention backward's FP32 buffer, a reduction's staging)"
)


@dataclass(frozen=True)
class Instruments:
    """What a fake step is handed from above. `wrap(model, plans, level, budget_mb, host_mb)`: the memory backend put
    on the model as a run puts it (`host_mb`: what `auto` may offload to the host), returning its handle
    (`api.MemoptHandle`: `planner`, `layers`, `profile`, `report()`, `step_done()`, `remove()`); `device`: the device
    whose roofline times each op (`measure.op_costs`: what the engine's profile, and so the solver, weigh recompute
    by; a `planning.devices.Device`)."""

    wrap: Callable
    device: object


class PartsCount(StorageCount):
    """A storage count that also keeps each storage's part (the phase it was made in, or the one it was moved to),
    and the parts at the highest count of the whole run (`top`, never reset: the step watch resets `peak`)."""

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self.phase = WEIGHTS
        self.parts: Dict[str, int] = {p: 0 for p in PARTS}
        self._part: Dict[int, str] = {}
        self.top = 0  # the highest count of the whole run
        self.top_parts: Dict[str, int] = dict(self.parts)
        self.top_at = ""  # where the run was at its highest
        self.step = 0  # the training step running (set by the driver)
        self.where = "before the layers"  # the mark the step passed last (`_marks`)
        self.step_top = 0  # the highest count of the step running
        self.step_top_parts: Dict[str, int] = dict(self.parts)  # the step's highest count by part, and where
        self.step_top_at = ""
        self.ops: Optional[OpCosts] = None  # each op's FLOPs and bytes, where the driver counts them
        # while a layer's forward or backward is recorded (`measure.replay`): the count and its parts at each op's end
        self.points: Optional[list] = None
        self._born: Dict[int, int] = {}  # a storage's identity -> its birth's number (one address, several storages)
        self._births = 0

    def see(self, t: torch.Tensor) -> None:
        super().see(t)
        if isinstance(t, torch.nn.Parameter) and _torch_api.wrapped_tensors(t) is None:
            # a parameter's data, wherever it was made: FSDP2 gathers a layer's weights into buffers it makes as the
            # layer's forward (or the model's, or a backward) begins, and they are weights from their first use on
            self._to_part(_torch_api.storage_identity(t.untyped_storage()), WEIGHTS)

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` held on the device outside the step, in `other`, from now on (no storage of the run's)."""
        self.current += nbytes
        self.parts[OTHER] += nbytes
        self.peak = max(self.peak, self.current)

    def from_here(self) -> None:
        """Count the run's highest from now on: what came before never reached the device (a model built whole on
        the host and sharded before it is moved to the device, as accelerate prepares FSDP2)."""
        self.top, self.top_parts, self.top_at = self.current, dict(self.parts), "before training"

    def _grew(self, key: int, nbytes: int) -> None:
        if key not in self._part:
            self._births += 1
            self._born[key] = self._births
        part = self._part.setdefault(key, self.phase)
        self.parts[part] += nbytes

    def alive(self) -> set:
        """The storages counted now, each as (identity, birth): told apart from a later one at the same address."""
        return {(key, self._born.get(key)) for key in self._live}

    def identity(self, t: torch.Tensor) -> tuple:
        """`t`'s storage as `alive` names it."""
        key = _torch_api.storage_identity(t.untyped_storage())
        return key, self._born.get(key)

    def forget(self, t: torch.Tensor) -> None:
        key = _torch_api.storage_identity(t.untyped_storage())
        super().forget(t)
        self._part.pop(key, None)
        self._born.pop(key, None)

    @contextmanager
    def adopting_as(self, part: str) -> Iterator[None]:
        """The tensors made inside stand for storages a replayed record counted already (`measure.replay`): each taken
        in, in `part`, at no growth, and no peak read from them (held aside)."""
        phase, self.phase = self.phase, part
        self.adopting, self.aside = True, self.aside + 1
        try:
            yield
        finally:
            self.phase, self.adopting, self.aside = phase, False, self.aside - 1

    def follow(self, start: tuple, points: list, end: tuple, mark: Optional[Callable[[str], None]] = None) -> None:
        """Walk a recorded stretch (`measure.replay`): the count and its parts moved from where they stand now as they
        moved from `start` to each op's end in `points` (each read into the peaks as an op's end is), then to `end`;
        a point that is a watch's mark, `("mark", (name, count, parts))`, made again with `mark(name)` where the count
        stood then."""
        base, base_parts = self.current, dict(self.parts)
        first, first_parts = start
        for current, parts in points:
            if current == MARK:  # the count as the mark read it, then the mark (its reading closes a stretch)
                name, current, parts = parts
                self.current = base + current - first
                self.parts = {p: base_parts[p] + parts[p] - first_parts[p] for p in base_parts}
                if mark is not None:
                    mark(name)
                continue
            self.current = base + current - first
            self.parts = {p: base_parts[p] + parts[p] - first_parts[p] for p in base_parts}
            self.peak = max(self.peak, self.current)
            self._reached()
        current, parts = end
        self.current = base + current - first
        self.parts = {p: base_parts[p] + parts[p] - first_parts[p] for p in base_parts}

    def resized(self, storage) -> None:
        """Resized in place outside any op: FSDP2's gathered weights (freed after a layer's forward and gathered
        again for its backward), counted as weights whatever the step is doing."""
        super().resized(storage)
        self._to_part(_torch_api.storage_identity(storage), WEIGHTS)

    def _gone(self, key: int, ref) -> None:
        self._born.pop(key, None)
        part = self._part.pop(key, None)
        if part is not None:
            self.parts[part] -= self._live.get(key, 0)
        super()._gone(key, ref)

    def move(self, t: Optional[torch.Tensor], part: str) -> None:
        """Count `t`'s storage in `part` from now on (a gradient autograd just stored)."""
        if t is None:
            return
        inner = _torch_api.wrapped_tensors(t)
        if inner is not None:  # a DTensor (FSDP2's sharded gradient): the shard it wraps
            for shard in inner:
                self.move(shard, part)
            return
        self.see(t)
        self._to_part(_torch_api.storage_identity(t.untyped_storage()), part)

    def _to_part(self, key: int, part: str) -> None:
        old = self._part.get(key)
        if old is not None and old != part:
            nbytes = self._live.get(key, 0)
            self.parts[old] -= nbytes
            self.parts[part] += nbytes
            self._part[key] = part

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if _torch_api.returns_no_tensor(func):  # a query of metadata: no storage, no time
            return out
        name = _torch_api.op_name(func)
        if "all_gather" in name or "allgather" in name:  # FSDP2 gathering weights: its buffers and the shards
            for t in tensors_in(out) + tensors_in(args):
                if _torch_api.wrapped_tensors(t) is None:
                    self._to_part(_torch_api.storage_identity(t.untyped_storage()), WEIGHTS)
        if self.aside:  # a lever's measurement aside is neither the step's time nor its peak
            return out
        if self.ops is not None:
            self.ops.add(func, args, kwargs or {}, out)
        self._reached()
        if self.points is not None:
            self.points.append((self.current, dict(self.parts)))
        return out

    def _reached(self) -> None:
        """The count at an op's end read into the step's highest and the run's."""
        if self.current > self.step_top:
            self.step_top = self.current
            self.step_top_parts, self.step_top_at = dict(self.parts), f"step {self.step}, {self.where}"
            if self.current > self.top:
                self.top, self.top_parts = self.current, dict(self.parts)
                self.top_at = f"step {self.step}, {self.where}"


@dataclass
class StepSpec:
    """The training step a dry run runs: the model's config and what the Trainer's flags set."""

    config: object  # a transformers PretrainedConfig
    batch: int = 1  # --per_device_train_batch_size
    seq: int = 2048  # --block_size / max length: tokens per sequence
    dtype: str = "float32"  # the weights' dtype as loaded (`torch_dtype`)
    autocast: Optional[str] = None  # --bf16 / --fp16: "bfloat16" / "float16"
    optimizer: str = "adamw_torch_fused"  # --optim
    grad_accum: int = 1  # --gradient_accumulation_steps
    lora: Optional[dict] = None  # --use_peft: LoraConfig's r, lora_alpha, lora_dropout, target_modules
    attention: Optional[str] = None  # attn_implementation; None: transformers' default for it (SDPA where it has it)
    # --use_cache: the Trainer sets the model's `config.use_cache` to it (False by default); a model that keeps its
    # KV cache in training holds every layer's keys and values until the step's outputs are let go of
    use_cache: bool = False
    # --fsdp full_shard with this many processes: every decoder layer and the model sharded with FSDP2
    # (`fully_shard`), counted as rank 0 holds it (1: no sharding)
    fsdp: int = 1
    # several processes without --fsdp or --deepspeed: accelerate's DistributedDataParallel over this many, each
    # holding the whole model and DDP's gradient buckets (`_ddp_buckets`; 1: no DDP)
    ddp: int = 1

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"`--optim {self.optimizer}` has no dry run here; accepted: {', '.join(OPTIMIZERS)} "
                f"(as in `--optim adamw_torch_fused`)"
            )
        for name in ("batch", "seq", "grad_accum", "fsdp", "ddp"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"a dry run's {name} must be at least 1, not {getattr(self, name)!r}")
        if self.fsdp > 1 and self.ddp > 1:
            raise ValueError(f"a dry run shards with FSDP2 ({self.fsdp} processes) or replicates with DDP, not both")


@dataclass
class DryRun:
    """What one configuration's dry run counted (bytes, as CUDA's caching allocator counts tensor storages)."""

    peak_bytes: int  # the highest count of the whole run
    before_training_bytes: int  # held before the first step: the weights (and adapters), buffers
    parts: Dict[str, int]  # the count at its highest, by part (`PARTS`)
    peak_at: str  # where: "step 2, layer 3 backward"
    steps: int
    seconds: float  # the dry run's own wall time
    profile: object = None  # the engine's step one (`ModelProfile`), where the backend ran
    auto: Optional[dict] = None  # `auto`'s choice and its check, where asked
    solver: Optional[dict] = None  # `auto`'s figures (solver.json's), where asked
    report: object = None  # the plan table's data (`PlanReport`), where the backend ran
    fit: object = None  # `auto`'s first choice (`budget.Fit`), where asked
    problem: Optional[str] = None
    step_peaks: List[int] = field(default_factory=list)  # each step's highest count
    step_parts: List[tuple] = field(default_factory=list)  # each step's highest count by part, and where it was
    # `auto`'s: the step whose figures are its choice's (in `step_peaks`, `step_parts`): the last, or an earlier
    # check's where the dry run ended without running its answer again (no step priced)
    answer_step: int = -1
    step_seconds: Optional[float] = None  # the last step on the cost device's roofline
    # where the step ran layers but not the layer list's first (a VLM's tower on text alone): what to say, the flag
    # for the layers that ran (`RecomputeState.first_layer_idle`)
    first_layer_idle: Optional[tuple] = None
    # `auto`'s: the layers the step runs, where it leaves some of the list out (`layer_order`); None: every layer
    running: Optional[List[int]] = None
    # the attention kernels the step ran as a CUDA card runs them, by kernel: calls (`kernels`); None: the CPU's own
    attention: Optional[Dict[str, int]] = None
    # what the layers' offloaded tensors held on the host at their most (`Offload+`), in bytes: 0 where none ran
    host_peak_bytes: int = 0
    # the layer calls replayed from a record instead of run (`measure.replay`): 0 where every layer ran
    layers_replayed: int = 0


@contextmanager
def _collections_of_its_own() -> Iterator[None]:
    """The process's objects made before the dry run held out of the garbage collector's reach while it runs
    (`gc.freeze`, undone after): the collections its planner makes before each step it measures, so that no reference
    cycle left from earlier is freed by chance inside the step, then have only the dry run's own objects to scan (a
    full collection of a process that imported transformers took 0.25-0.3 s, three or more a dry run of `auto`), and
    what came before is not freed inside it either. Where something else has frozen objects already, nothing is
    changed (undoing a freeze would undo theirs)."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextmanager
def _autocast(dtype: Optional[str], device: str) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device, dtype=getattr(torch, dtype)):
        yield


@contextmanager
def _experts_kernel() -> Iterator[None]:
    """transformers' MoE experts run `torch.nn.functional.grouped_mm` where torch has it, and on the CPU its kernel
    takes fp32; torch's fake (meta) rule for it takes bf16 only (torch 2.13: "Expected inputs of BF16 type"), so a
    dry run of an fp32 MoE failed there. On fake tensors that are not bf16 the experts take transformers' own
    fallback (a custom op with a fake rule of its own), which keeps the same tensors for backward (its inputs)."""
    try:
        from transformers.integrations import moe
    except ImportError:  # pragma: no cover - a transformers without MoE kernels has nothing to patch
        yield
        return
    chosen = getattr(moe, "_can_use_grouped_mm", None)
    if chosen is None:
        yield
        return

    def can_use(input, weight, offs) -> bool:
        if _torch_api.is_fake(weight) and weight.dtype != torch.bfloat16:
            return False
        return chosen(input, weight, offs)

    moe._can_use_grouped_mm = can_use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = chosen


@contextmanager
def _masking_replaced(name: str, replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    """transformers' `masking_utils.<name>` replaced by `replacement(original)` inside; nothing where the installed
    transformers has none."""
    try:
        from transformers import masking_utils
    except ImportError:  # pragma: no cover - a transformers without it builds its masks otherwise
        yield
        return
    found = getattr(masking_utils, name, None)
    if found is None:
        yield
        return
    setattr(masking_utils, name, replacement(found))
    try:
        yield
    finally:
        setattr(masking_utils, name, found)


def _unpacked():
    """transformers looks for sequences packed into one row by reading the position ids' values (`masking_utils.
    find_packed_sequence_indices`), which fake tensors do not have: it then takes them for packed and builds a whole
    mask the real step never makes. A dry run's rows are one sequence each, as the plan says: the search finds none."""
    return _masking_replaced("find_packed_sequence_indices", lambda found: lambda position_ids: None)


def _mask_read_as(every_token: bool):
    """transformers reads a 2D attention mask's values to leave SDPA's mask out where it attends to every token
    (`masking_utils._ignore_causal_mask_sdpa`: SDPA then runs causal, without a mask); a fake mask has no values, so
    the fake step always built a 4D mask and ran another kernel than the real step (README's main job: its dry run
    read 6.1 MiB more than its step one). A run's own dry run reads its real batch's mask first: where it attends to
    every token (`every_token`), a fake mask is taken as none there, as the real step takes it."""
    if not every_token:
        return contextlib.nullcontext()

    def reading(found):
        def ignore(padding_mask, *args, **kwargs):
            if padding_mask is not None and _torch_api.is_fake(padding_mask):
                padding_mask = None
            return found(padding_mask, *args, **kwargs)

        return ignore

    return _masking_replaced("_ignore_causal_mask_sdpa", reading)


def _build(spec: StepSpec):
    """The model (and its adapters) built on the meta device, as from_config and PEFT build them, then given fake
    storages on the CPU device under the dry run's mode: each parameter and buffer once (tied ones stay tied),
    counted as the weights. On meta, nothing initialises (no kernel runs) and PEFT's dtype moves work as on a real
    model (on fake tensors `Module.to` cannot swap a tensor the fake mode's converter holds)."""
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, spec.dtype)
    config = copy.deepcopy(spec.config)
    config.use_cache = spec.use_cache  # as the Trainer sets it
    with _default_dtype(dtype), torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=spec.attention)
        if spec.lora is not None:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **spec.lora))
    return model


def _materialize(model, fakes: bool = True, device: str = "cpu") -> None:
    """Give every meta parameter and buffer a storage on `device`: a fake one under the fake mode (on the CPU), or
    (`fakes` False: the same step run for real, to hold a dry run to) one drawn small from the seeded generator."""
    made: Dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
            if not fakes and new.is_floating_point():
                with torch.no_grad():
                    new.normal_(0.0, 0.02)
            if isinstance(t, torch.nn.Parameter):
                new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
            made[id(t)] = new
        return made[id(t)]

    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = fake(p)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = fake(b)
        for name, t in list(vars(module).items()):  # a tensor kept as a plain attribute (a rotary table's copy)
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                setattr(module, name, fake(t))


def _optimizer(spec: StepSpec, params):
    if spec.optimizer == "adamw_torch_fused":
        return torch.optim.AdamW(params, lr=5e-5, fused=True)
    if spec.optimizer == "adamw_torch":
        return torch.optim.AdamW(params, lr=5e-5, foreach=True)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=5e-5)
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)


def _marks(model, layers, count: PartsCount):
    """Hooks that tell the count the step's phase and its last mark as the step runs (see the module's docstring):
    each layer's forward and backward starting, the head after the last layer; the handles."""
    handles = []

    def forward_starts(index, module, args):
        if not _torch_api.in_backward() and torch.is_grad_enabled():
            count.phase, count.where = ACTIVATIONS, str(Place.forward(index))

    def forward_ends(index, module, args, out):
        if _torch_api.in_backward() or not torch.is_grad_enabled():
            return
        first = next((t for t in _tensors(out) if t.requires_grad), None)
        if first is not None:
            first.register_hook(partial(backward_reached, index))
        if index == len(layers) - 1:
            count.phase, count.where = HEAD, "the head and loss"

    def backward_reached(index, grad):
        count.phase, count.where = ACTIVATIONS, str(Place.backward(index))
        return grad

    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(partial(forward_starts, index)))
        handles.append(layer.register_forward_hook(partial(forward_ends, index)))
    for p in model.parameters():
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(lambda p: count.move(p.grad, GRADIENTS)))
    return handles


def _prime(optimizer, params, count: PartsCount) -> None:
    """Make the optimizer's state before the first step (a step on zero gradients, which are then let go of), so that
    the first step holds what every later step holds: one step measures what two would (a dry run's time is the
    fake dispatch of every op)."""
    count.phase, count.where = OPTIMIZER, "the optimizer's state, made before the first step"
    count.aside += 1  # its own peak is none of the run's
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    finally:
        count.aside -= 1


@contextmanager
def _sharding(spec: StepSpec) -> Iterator[object]:
    """The device mesh FSDP2 shards over (None without `spec.fsdp`): the launch's process group where one is up (a
    real run of the same step, which the tests hold a dry run to), else a fake one of `spec.fsdp` processes in this
    one, taken down after. Made before the fake mode: inside it, the mesh's ranks cannot be read."""
    if spec.fsdp <= 1:
        yield None
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    ours = not dist.is_initialized()
    if ours:
        _torch_api.fake_process_group(spec.fsdp)
    elif dist.get_world_size() != spec.fsdp:
        raise ValueError(
            f"a dry run for `--fsdp` over {spec.fsdp} processes started in a launch of {dist.get_world_size()}"
        )
    try:
        yield init_device_mesh("cpu", (spec.fsdp,))
    finally:
        if ours:
            dist.destroy_process_group()


def _shard(model, layers, mesh, spec: StepSpec) -> None:
    """FSDP2 as accelerate applies it (`--fsdp full_shard`, version 2): each decoder layer, then the whole model; under
    `--bf16` / `--fp16` with accelerate's mixed-precision policy (weights gathered, gradients reduced and outputs made
    in 16 bits) and the trained parameters upcast to fp32 first, as accelerate upcasts them."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if spec.autocast is not None:
        low = getattr(torch, spec.autocast)
        policy = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low, output_dtype=low)
        for p in model.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.to(torch.float32)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _ddp_buckets(params, device: str) -> List[torch.Tensor]:
    """DistributedDataParallel's gradient buckets, made as its reducer makes them when DDP wraps the model, and held
    for the whole run: a flat tensor of each trained parameter's gradient, one per dtype (DDP splits them into
    `bucket_cap_mb` pieces, which sum to the same). With `gradient_as_bucket_view` off, as the Trainer and accelerate
    leave it, each gradient is copied into its bucket for the all-reduce and back: the step holds both. DDP's own
    reducer is C++ that reads every parameter's storage, which a fake tensor has not, so the dry run makes its buckets
    here (their sizes are what `DistributedDataParallel._get_ddp_logging_data()["bucket_sizes"]` sums to: tested)."""
    numels: Dict[torch.dtype, int] = {}
    for p in params:
        numels[p.dtype] = numels.get(p.dtype, 0) + p.numel()
    return [torch.empty(n, dtype=dtype, device=device) for dtype, n in numels.items()]


class LayerOrderError(ValueError):
    """A step runs its layers in a way step one cannot be measured over (`layer_order`): out of the list's order, or
    one layer several times."""


_ALWAYS_RUN = object()  # a form of call whose output cannot be made again (`_layers_replayed`)
_VALUES = (bool, int, float, str, type(None), torch.dtype, torch.device)


@dataclass(frozen=True)
class _Made:
    """A tensor of a layer's output, as `_replayed_call` makes it again."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    def again(self) -> torch.Tensor:
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)


@contextmanager
def _layers_replayed(layers) -> Iterator[None]:
    """Each layer's forward, in the forward without autograd that finds the layers' order (`layer_order`), run once
    for each form of call (the layer's class, its parameters' and buffers' shapes, its arguments' shapes and values,
    an object among them by identity) and its output made again, as new fake storages of the same shapes, for every
    later call of that form: on fake tensors a layer's output depends on nothing else, and what `layer_order` reads
    (the layers run, in their order, and where the model's own code lets go of each layer's input) is the model's
    code, around the layers. An 8B model's 32 layers then run one layer's ops, not 32 (about 3,700 of the 3,800
    fake ops that forward ran). A call whose output shares a storage with its arguments or with another of its
    outputs (a layer handing on its input), or holds a tensor that is not fake, runs every time."""
    forms: Dict[tuple, object] = {}
    own = []
    for layer in layers:
        own.append((layer, vars(layer).get("forward")))
        layer.forward = partial(_replayed_call, forms, layer, layer.forward)
    try:
        yield
    finally:
        for layer, forward in own:
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _replayed_call(forms: Dict[tuple, object], layer, forward: Callable, *args, **kwargs):
    key = _call_form(layer, args, kwargs)
    form = forms.get(key, _ALWAYS_RUN)
    if form is not _ALWAYS_RUN:
        spec, leaves = form
        return _torch_api.unflatten([v.again() if isinstance(v, _Made) else v for v in leaves], spec)
    out = forward(*args, **kwargs)
    if key not in forms:
        forms[key] = _output_form(out, args, kwargs)
    return out


def _leaf_form(leaf) -> object:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.storage_offset(), leaf.dtype, leaf.device)
    return leaf if isinstance(leaf, _VALUES) else ("object", type(leaf), id(leaf))


def _call_form(layer, args, kwargs) -> tuple:
    leaves, spec = _torch_api.flatten((args, kwargs))
    weights = tuple((name, tuple(t.shape), t.dtype) for name, t in [*layer.named_parameters(), *layer.named_buffers()])
    return (type(layer), weights, str(spec), tuple(_leaf_form(leaf) for leaf in leaves))


def _output_form(out, args, kwargs) -> object:
    """What `_replayed_call` makes a later call's output from: its structure, and each leaf a tensor's
    `empty_strided` arguments or the value itself; `_ALWAYS_RUN` where it cannot be made again."""
    leaves, spec = _torch_api.flatten(out)
    seen = {_torch_api.storage_identity(t.untyped_storage()) for t in tensors_in(args) + tensors_in(kwargs)}
    made = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            key = _torch_api.storage_identity(leaf.untyped_storage()) if _torch_api.is_fake(leaf) else None
            if key is None or key in seen or _torch_api.wrapped_tensors(leaf) is not None:
                return _ALWAYS_RUN
            seen.add(key)
            made.append(_Made(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype, leaf.device))
        else:
            made.append(leaf)
    return spec, made


def layer_order(
    model, layers, forward: Callable[[], object], inputs_gone: Optional[Dict[int, int]] = None, replayed: bool = False
) -> Optional[List[int]]:
    """The layers a training step runs, from one forward of it (`forward`, run here without autograd: nothing is
    kept, so the dry run's count is not raised): None where it runs the whole list in order; the indices it runs,
    in order, where it leaves some out (a vision-language model's tower on text alone). Raises `LayerOrderError`
    where it runs a layer before one listed earlier (BLT's patchers, listed after the layers they feed) or one layer
    several times (HRM's cycles): `apply.layers.run_order_problem`.

    `inputs_gone`, filled with where the model's own code lets go of each layer's input (its first argument, the
    hidden states): layer -> the first layer whose forward starts with that storage freed, `len(layers)` where only
    the head's does (the model's output embeddings), `INPUT_KEPT` where not even then. Without autograd nothing but
    the model's code holds it, so this is what is left of it once autograd's saves are taken off (what the offload
    lever copies to the host): a decoder's loop lets go of layer i's input as layer i + 1 starts, but Llama's forward
    keeps `inputs_embeds`, the first layer's input, in a local through every layer (an 8B model at 8,192 tokens:
    64 MiB the offload lever does not free until the head). A layer whose input is still held as the forward ends,
    with no head seen, is left out (not known).

    `replayed` (fake tensors only): each layer run once for each form of call, its output made again for the others
    (`_layers_replayed`); where that forward raises, the forward is run again with every layer run."""
    if replayed:
        try:
            with _layers_replayed(layers):
                return layer_order(model, layers, forward, inputs_gone)
        except LayerOrderError:
            raise
        except Exception as e:  # a layer whose output is more than its form: every layer run
            logger.debug("optimum-memopt: the order forward with layers replayed raised (%r); run in full", e)
            if inputs_gone is not None:
                inputs_gone.clear()
    calls: List[int] = []
    pending: Dict[int, object] = {}  # layer -> a weak reference to its input's storage, until seen freed

    def starts(k: int, module, args, kwargs) -> None:
        calls.append(k)
        if inputs_gone is None:
            return
        seen_freed(k)
        first = next(iter(tensors_in(args) or tensors_in(kwargs)), None)
        if first is not None and k not in pending and k not in inputs_gone:
            pending[k] = _torch_api.storage_ref(first)

    def seen_freed(at: int) -> None:
        for i, ref in list(pending.items()):
            if ref.expired():
                inputs_gone[i] = at
                del pending[i]

    hooks = [layer.register_forward_pre_hook(partial(starts, k), with_kwargs=True) for k, layer in enumerate(layers)]
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_seen = []

    def head_starts(module, args) -> None:
        head_seen.append(True)
        seen_freed(len(layers))

    if inputs_gone is not None and isinstance(head, torch.nn.Module):
        hooks.append(head.register_forward_pre_hook(head_starts))
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in hooks:
            h.remove()
    if inputs_gone is not None and head_seen:
        for i in pending:
            inputs_gone[i] = INPUT_KEPT
    problem = run_order_problem(calls, [type(layer).__name__ for layer in layers], type(model).__name__)
    if problem is not None:
        raise LayerOrderError(problem)
    return calls if calls and len(calls) < len(layers) else None


def _local_bytes(p: torch.Tensor) -> int:
    """What a parameter's gradient holds on this process, in CUDA's blocks (a sharded one: its local shards)."""
    inner = _torch_api.wrapped_tensors(p)
    return sum(_local_bytes(t) for t in inner) if inner is not None else block_bytes(p.numel() * p.element_size())


def _loss(out) -> torch.Tensor:
    """The loss a model's training forward returned (with the labels given), as the Trainer takes it."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)) and out:
        loss = out[0]
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"the model's forward returned no loss ({type(out).__name__}); a dry run trains on its loss")
    return loss


def _tensors(value) -> List[torch.Tensor]:
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    return tensors_in(value)


def run(
    spec: StepSpec,
    instruments: Instruments,
    plans: Optional[str] = None,
    level: int = 0,
    checkpointing: bool = False,
    budget_mb: Optional[float] = None,
    backend: bool = True,
    price_step: bool = False,
    fake: bool = True,
    device: str = "cpu",
    model=None,
    batch: Optional[Callable[[], tuple]] = None,
    optimizer_from: Optional[Callable] = None,
    held_bytes: int = 0,
    running_into: Optional[list] = None,
    kernels: Optional[CudaKernels] = None,
    peak_only: bool = False,
    mask_attends_all: bool = False,
    host_mb: Optional[float] = None,
    replay_layers: bool = True,
    remake: Optional[Callable[[], object]] = None,
) -> DryRun:
    """Train `spec`'s step on fake tensors under one configuration: the torch backend with `plans` (`auto` with
    `budget_mb`) or `level`, or transformers' own checkpointing (`checkpointing`, no backend), or nothing
    (`backend=False`: the plain step). The optimizer's state is made before the first step (`_prime`), so one step
    holds what every later one does. Under `auto` step one measures and each step after it runs a choice, checked
    as its step ends (`BudgetPlanner.search`: at most `search_checks` choices, each solved with what the checks
    before it read segment by segment), and the last runs the least recompute whose step fitted: `DryRun.fit`, its
    figure that step's, and `step_peaks[answer_step]` / `step_parts[answer_step]` the step a run's step one runs
    (where the answer is an earlier check's and no step is priced, no step runs it again: `answer_step` that
    check's step; else the last). The ops' times the
    engine profiles (what the solver weighs recompute by) are `instruments.device`'s roofline, and with `price_step`
    the last step's ops are priced on it (`DryRun.step_seconds`); the backend goes on the model through
    `instruments.wrap`. `fake` False runs the same step on real tensors on `device` under the same count and clock
    (what the tests, and the GPU kit on CUDA, hold a dry run to).

    A training run's own step (`auto` starting from the plan: `backends.torch.decide.from_plan`) gives its `model` (on
    the meta device, built in place of `spec.config`'s), its `batch` (called under the fake mode: one micro-batch's
    positional and keyword arguments, fake copies of the real ones) and `optimizer_from` (the trained parameters to
    an optimizer like the run's); the planner then chooses for this process alone, whatever process group is up.
    `held_bytes` is what that process holds on its device outside the step (another model, tensors kept from before:
    `measure.live.held_outside`), counted from the start in `other`, as the device counts it in every reading.

    Under `auto`, a forward of the step without autograd first finds the layers it runs (`layer_order`: a VLM on text
    alone leaves its tower out; a step that runs them out of the list's order, or one several times, raises
    `LayerOrderError`): step one is measured over them (`DryRun.running`; put in `running_into` too as soon as known,
    for a caller whose dry run may raise after).

    `kernels`: the CUDA card whose attention kernels the fake step runs (`attention.CudaKernels`: the kernel each
    `scaled_dot_product_attention` takes there and the tensors it keeps, counted in `DryRun.attention`), and whose
    dropout it runs (`dropout.on_cuda`: a one-byte mask kept); None: the fake tensors' own device's, the CPU's (what a
    real step on the CPU runs).

    `mask_attends_all`: the batch's attention mask, read where it is real (a run's own step), attends to every token:
    SDPA gets no mask, as in the real step (`_mask_read_as`).

    `replay_layers`: alike layers replayed from records (`measure.replay`) on fake tensors, without sharding: the
    plain step's (transformers' checkpointing too), and the engine's after step one; where a record does not hold as
    the step goes on, the dry run is run again without, on the model built again (`remake()` makes a given `model`
    again: without it, a given model's layers all run).

    `peak_only`: the peak, its parts and the steps' peaks alone (what a search for the largest size needs): the last
    step is not reported ended to the backend, so its levers measure nothing after it and no table is made
    (`DryRun.report` None). The peak is the same (a lever's measurement after a step is held aside from the count:
    tests/test_plan.py holds both)."""
    if peak_only and plans == "auto":
        raise ValueError(
            "a dry run of `auto` checks its choices step by step: its peak alone (`peak_only`) is not one"
        )
    began = time.perf_counter()
    steps = 2 if plans == "auto" else 1
    count = PartsCount(device)
    if not fake and device != "cpu":  # real tensors on a card: its storages alone, as its own counter counts
        count.only = torch.device(device).type
    # the engine's op times and the levers' are this device's roofline (the solver weighs recompute by them)
    count.clock = clock_for(instruments.device)
    if kernels is not None:  # a card's step: an offload's copies priced at its link to the host
        link = instruments.device
        count.host_link = (link.host_link, f"{link.name}'s {link.host_link_name}, {link.host_link / 1e9:g} GB/s a way")
    if fake and device != "cpu":
        raise ValueError(f"a dry run's fake tensors are on the CPU device (counted as CUDA counts), not {device!r}")
    if kernels is not None and not fake:
        raise ValueError("a dry run on real tensors runs their device's attention kernels: `kernels` is for fake ones")
    mode = _torch_api.fake_mode() if fake else contextlib.nullcontext()
    unpacked = _unpacked() if fake else contextlib.nullcontext()
    experts = _experts_kernel() if fake else contextlib.nullcontext()
    masks = _mask_read_as(mask_attends_all and fake)
    handle = None
    handles = []
    built_here = model is None  # a step replayed in part runs again on a model of its own where a record fails
    model = _build(spec) if built_here else model
    count.hold(held_bytes)
    card = dropout.on_cuda(kernels is not None)  # a card's dropout keeps a one-byte mask, the CPU's the input's dtype
    with (
        _collections_of_its_own(),
        _sharding(spec) as mesh,
        mode,
        unpacked,
        experts,
        masks,
        on_cuda(kernels) as attention,
        card,
        count,
    ):
        # real tensors are made alike every run; fake ones draw nothing, and a run's own dry run (`from_plan`) must not
        # reseed its devices' generators (`torch.manual_seed` seeds every CUDA device, lazily where none is up yet)
        torch.manual_seed(0) if not fake else torch.default_generator.manual_seed(0)
        _materialize(model, fake, device)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if backend and not checkpointing:
            handle = instruments.wrap(model, plans, level, budget_mb, host_mb)
        layers = handle.layers if handle is not None else find_layers(model)
        vocab = spec.config.get_text_config().vocab_size if batch is None else 0

        def inputs():
            if batch is not None:
                return batch()
            ids = torch.randint(0, vocab, (spec.batch, spec.seq), device=device)
            return (), {"input_ids": ids, "labels": ids}

        running = None
        if plans == "auto" and handle is not None:  # `auto` measures step one over the layers the step runs

            def forward():
                args, kwargs = inputs()
                with _autocast(spec.autocast, device):
                    model(*args, **kwargs)

            count.aside += 1  # finding the order runs a forward of its own, before the steps: none of their peak
            gone: Dict[int, int] = {}
            try:
                running = layer_order(model, layers, forward, gone, replayed=fake)
            finally:
                count.aside -= 1
            getattr(model, STATE).run_over(running, gone)
            if running_into is not None:  # known before the steps, which may raise (`auto` finding nothing fits)
                running_into.append(running)
        if mesh is not None:
            _shard(model, layers, mesh, spec)
            count.from_here()
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = optimizer_from(params) if optimizer_from is not None else _optimizer(spec, params)
        buckets = _ddp_buckets(params, device) if spec.ddp > 1 else []
        for b in buckets:
            count.move(b, GRADIENTS)
        handles = _marks(model, layers, count)
        replay = None
        if replay_layers and fake and (built_here or remake is not None) and mesh is None:
            ran = attention.ran if attention is not None else None
            state = getattr(model, STATE, None) if handle is not None else None
            if handle is None:  # the plain step: the layers' forwards replaced
                replay = LayerReplay(layers, count, ran)
                replay.install()
            elif state is not None:  # the engine's: each layer it runs after step one
                replay = LayerReplay(
                    layers, count, ran, watch=lambda: state.watch, variant_of=state.alike_by, levers=state.levers
                )
                state.replay = replay
        before = count.current
        _prime(optimizer, params, count)
        step_peaks, step_parts, answer_step = [], [], -1
        planner = handle.planner if handle is not None and plans == "auto" else None
        if planner is not None:  # each choice checked by a step of its own (`BudgetPlanner.search`)
            planner.driven_by_a_dry_run(
                # a run's own step, in one of its processes: no collective
                alone=batch is not None,
                # held across micro-batches: a later one holds them (as the Trainer says a run's)
                grad_bytes=sum(_local_bytes(p) for p in params) if spec.grad_accum > 1 else 0,
                # the mark of the k-th check's peak: its step is the one after step one and the k checks before
                peaked_where=lambda k: step_parts[k + 1][1].partition(", ")[2] if len(step_parts) > k + 1 else "",
            )
        try:
            step = 0
            while True:
                step += 1
                count.step, count.phase, count.where = step, OTHER, "before the layers"
                count.step_top = count.current
                count.step_top_parts, count.step_top_at = dict(count.parts), f"step {step}, {count.where}"
                if price_step and step >= steps:  # every step that may be the last, priced
                    count.ops = OpCosts()
                for _ in range(spec.grad_accum):
                    if replay is not None:
                        replay.reset()
                    args, kwargs = inputs()
                    with _autocast(spec.autocast, device):
                        loss = _loss(model(*args, **kwargs))
                    (loss / spec.grad_accum).backward()
                    if replay is not None:  # what the recorded layers kept past their backwards goes with the graph
                        replay.graph_goes()
                    del loss, args, kwargs
                    if replay is not None:
                        replay.graph_gone()
                for p in params:  # FSDP2 stores a sharded gradient itself, past the parameters' hooks
                    count.move(p.grad, GRADIENTS)
                count.phase, count.where = OPTIMIZER, "the optimizer step"
                optimizer.step()
                count.phase = OTHER
                optimizer.zero_grad(set_to_none=True)
                if handle is not None and not peak_only:
                    handle.step_done()
                step_peaks.append(count.step_top)
                step_parts.append((dict(count.step_top_parts), count.step_top_at))
                # `auto`: step one measures, each step after it runs a choice, checked as its step ends; the step the
                # figures are read from is the answer's: the check just read where that was the answer, else an
                # earlier check's, or, where the last step is priced, one more step running it
                if planner is not None and step >= steps:
                    planner.check_ended()
                    # the answer an earlier check's: its step stands for it, unless the last step is to be priced
                    earlier = None if price_step else planner.end_at_earlier_check()
                    if earlier is not None:
                        answer_step = earlier + 1  # after step one, a step a check
                if planner is None or (step >= steps and planner.settled):
                    break
                if step >= steps + planner.search_checks:
                    break
        except ReplayMismatch as e:
            logger.debug("optimum-memopt: the dry run's step runs again without replayed layers: %s", e)
            mismatch = True
        else:
            mismatch = False
        finally:
            for h in handles:
                h.remove()
            if replay is not None:
                replay.remove()
                if handle is not None and getattr(model, STATE, None) is not None:
                    getattr(model, STATE).replay = None
            del buckets
    if mismatch:
        return run(
            spec, instruments, plans, level, checkpointing, budget_mb, backend, price_step, fake, device,
            None if built_here else remake(), batch, optimizer_from, held_bytes, running_into, kernels, peak_only,
            mask_attends_all, host_mb, replay_layers=False,
        )  # fmt: skip
    result = DryRun(
        peak_bytes=count.top,
        before_training_bytes=before,
        parts=dict(count.top_parts),
        peak_at=count.top_at,
        steps=steps,
        seconds=time.perf_counter() - began,
        step_peaks=step_peaks,
        step_parts=step_parts,
        answer_step=answer_step,
        running=running,
        attention=dict(attention.ran) if attention is not None else None,
        layers_replayed=replay.replayed if replay is not None else 0,
    )
    if count.ops is not None:
        result.step_seconds = count.ops.seconds(instruments.device)
    if handle is not None:
        result.profile = handle.profile
        result.host_peak_bytes = sum(lever.host_peak() for lever in handle.levers.values())
        result.report = None if peak_only else handle.report()
        state = getattr(model, STATE, None)
        result.first_layer_idle = state.first_layer_idle() if state is not None else None
        if plans == "auto":
            result.auto = handle.auto
            result.solver = handle.solver_figures()
            planner = handle.planner
            result.fit = planner.searched or (planner.fits[0] if planner.fits else None)
        handle.remove()
    return result
