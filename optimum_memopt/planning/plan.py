"""`optimum_memopt.plan(...)`: what a training step holds at its real size on a device, before renting it, for each
way to run it (eager, transformers' checkpointing, the backend's levers, `auto`'s choice), from dry runs
(`dry_run`): the peak split into its parts, whether it fits, the step's time on the device's roofline, and the flag
to paste.

    import optimum_memopt

    plan = optimum_memopt.plan("meta-llama/Llama-3.1-8B", batch=1, seq=8192, bf16=True, lora={"r": 16},
                               device="H100-80GB")
    print(plan.table())
    plan.write_json("plan.json")

The step time is a roofline (each op at the longer of its FLOPs at the device's rate and its bytes at its bandwidth,
no overlap, no launch costs): it ranks configurations, it is not a measured time.
"""

import json
import logging
import os
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, Iterator, List, Optional, Union

from ..backends.torch.measure.attention import CudaKernels
from .devices import DEFAULT_DEVICE, DEVICES, WORKSPACES_MIB, Device, find
from .dry_run import NOT_SEEN, PARTS, DryRun, StepSpec, dry_run
from .plan_file import CPU, model_facts

MIB = float(1024 * 1024)
ROOFLINE = (
    "step seconds: a roofline on the device's data-sheet rates (each op at the longer of its FLOPs and its bytes, "
    "no overlap, no launch costs): for ranking, not a measured time"
)


@dataclass
class Configuration:
    """One way to run the step, its flags, and what its dry run counted."""

    name: str
    flags: str  # what to add to the training command
    peak_mb: Optional[float] = None
    before_training_mb: Optional[float] = None
    parts_mb: Dict[str, float] = field(default_factory=dict)
    peak_at: str = ""
    fits: Optional[bool] = None
    step_seconds: Optional[float] = None
    problem: Optional[str] = None  # why it has no figures (refused, or `auto` found nothing that fits)
    choice: Optional[str] = None  # `auto`'s choice in the plan grammar ("" for nothing recomputed)
    dry_run_seconds: float = 0.0
    note: Optional[str] = None  # what `auto` makes of it, where that is not what its figures suggest
    host_mb: float = 0.0  # what the layers' offloaded tensors held on the host at their most (`Offload+`)


@dataclass
class Plan:
    model: str
    spec: StepSpec
    device: Optional[Device]
    budget_mb: Optional[float]
    configurations: List[Configuration]
    auto_solver: Optional[dict] = None  # `auto`'s figures from its dry run (for the picture)
    # the largest batch (at the plan's sequence) and the longest sequence (at its batch) whose least-memory
    # configuration fits the budget, each found by dry runs: {"batch": n, "seq": n, "under": name, "runs": [...]}
    reach: Optional[dict] = None
    # the attention and dropout kernels the dry runs ran: a CUDA card's by compute capability ("cuda 9.0"), or "cpu"
    kernels: str = ""
    host_mb: Optional[float] = None  # `--memory_host_mb`: the host memory offloaded tensors may hold (None: not given)

    def record(self) -> dict:
        """Every figure of the table (what `--json` writes)."""
        spec = {k: v for k, v in asdict(self.spec).items() if k != "config"}
        return {
            "model": self.model,
            "step": spec,
            "device": None if self.device is None else asdict(self.device),
            "budget_mb": self.budget_mb,
            "host_mb": self.host_mb,
            "unit": "MiB of tensor storages as CUDA's caching allocator counts them (512-byte blocks)",
            "not_seen": NOT_SEEN,
            "workspaces_mb": WORKSPACES_MIB if self.device is not None else 0.0,
            "step_seconds_are": ROOFLINE,
            "configurations": [asdict(c) for c in self.configurations],
            "reach": self.reach,
            # what a training run given this file (`--memory_plan_file`) compares with its own step (`plan_file`)
            "run": {
                "model_config": model_facts(self.spec.config),
                "kernels": self.kernels,
                "auto_budget_mb": None if self.budget_mb is None else float(int(self.budget_mb)),
            },
        }

    def write_json(self, path: str) -> None:
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.record(), f, indent=2)
            f.write("\n")

    def picture(self, path: str):
        """`auto`'s dry run drawn as the training run draws it (step one by mark, the budget, the choice)."""
        if self.auto_solver is None:
            raise RuntimeError("optimum-memopt: the plan has no `auto` dry run to draw (give a device or a budget)")
        from ..callbacks.step_memory import draw_step_memory

        return draw_step_memory(self.auto_solver, path)

    def table(self) -> str:
        return format_plan(self)


def _what(spec: StepSpec, model: str) -> str:
    precision = f"{spec.autocast} autocast" if spec.autocast else spec.dtype
    lora = "" if spec.lora is None else f", LoRA r={spec.lora.get('r', 8)}"
    accum = f" x {spec.grad_accum} accumulated" if spec.grad_accum > 1 else ""
    sharded = f", FSDP2 over {spec.fsdp} processes (what rank 0 holds)" if spec.fsdp > 1 else ""
    if spec.ddp > 1:
        sharded = f", DDP over {spec.ddp} processes (each: the whole model and DDP's gradient buckets)"
    return (
        f"{model}: batch {spec.batch}{accum} x {spec.seq:,} tokens, weights {spec.dtype}, {precision}, "
        f"{spec.optimizer}{lora}{sharded}"
    )


def format_plan(plan: Plan) -> str:
    """The table a person reads in ten seconds."""
    lines = [f"memopt-plan (a dry run on fake tensors): {_what(plan.spec, plan.model)}"]
    if plan.device is not None:
        lines.append(f"device {plan.device.describe_budget()}")
    elif plan.budget_mb is not None:
        lines.append(f"budget: {plan.budget_mb:,.0f} MiB")
    short = {"weights": "weights", "gradients": "grads", "optimizer state": "optim", "activations": "activ"}
    short.update({"head and loss": "head+loss", "other": "other"})
    host = any(c.host_mb for c in plan.configurations)  # a column for what offloaded tensors hold on the host
    header = ["", "peak MiB", *(short[p] for p in PARTS), *(["host"] if host else []), "fits", "step s"]
    header.append("where it peaks")
    rows = [header]
    for c in plan.configurations:
        if c.peak_mb is None:  # the problem says why
            rows.append([c.name, "-", *("" for _ in PARTS), *([""] if host else []), "-", "", c.problem or ""])
            continue
        fits = "" if c.fits is None else ("yes" if c.fits else "no")
        secs = "" if c.step_seconds is None else f"{c.step_seconds:.3g}"
        parts = [_mb(c.parts_mb.get(p, 0.0)) for p in PARTS]
        rows.append([c.name, _mb(c.peak_mb), *parts, *([_mb(c.host_mb)] if host else []), fits, secs, c.peak_at])
    widths = [max(len(r[i]) for r in rows if i < len(r) - 1 or r is rows[0]) for i in range(len(header) - 1)]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [r[i].rjust(widths[i]) for i in range(1, len(header) - 1)]
        lines.append("  ".join(cells) + "  " + r[-1])
    for c in plan.configurations:
        if c.choice is not None:
            chose = f"`--memory_opt_config {c.choice}`" if c.choice else "nothing recomputed"
            step = " (its row: the choice's step, which a run's step one runs)" if plan.spec.fsdp == 1 else ""
            lines.append(f"auto chose: {chose}{step}")
    for c in plan.configurations:
        if c.note:
            lines.append(f"{c.name}: {c.note}")
    if plan.reach is not None:
        r = plan.reach
        capped = " (the model's max_position_embeddings)" if r["seq"] and r["seq"] >= r["seq_cap"] else ""
        line = (
            f"auto fits up to batch {_n(r['batch'])} at {plan.spec.seq:,} tokens, and up to {_n(r['seq'])} tokens"
            f"{capped} at batch {plan.spec.batch} (where {r['under']} fits: the least memory it reaches; each a dry "
            f"run)"
        )
        hosts = r.get("host_mb") or {}
        if any(hosts.values()):  # the floor offloads: what the host must hold there is part of the answer
            at = {"batch": f"batch {_n(r['batch'])}", "seq": f"{_n(r['seq'])} tokens"}
            held = ", ".join(f"{_mb(hosts[k])} MiB at {at[k]}" for k in at if hosts.get(k) is not None)
            whose = "each process's" if max(plan.spec.fsdp, plan.spec.ddp) > 1 else "its"  # the dry run is one's
            line += f"; {whose} offloaded tensors hold on the host {held}"
            if plan.host_mb is None:
                line += (
                    " (the host's room not given: the training machine's available memory must hold them, "
                    "`--memory_host_mb` checks it)"
                )
        lines.append(line)
    fitting = [c for c in plan.configurations if c.fits]
    timed = [c for c in fitting if c.step_seconds is not None]
    if timed:
        best = min(timed, key=lambda c: c.step_seconds)
        lines.append(f"fastest that fits: {best.name}; paste: {best.flags}")
    elif fitting:
        lines.append(f"fits: {', '.join(c.name for c in fitting)} (name a device for the step times)")
    elif plan.device is not None or plan.budget_mb is not None:
        ways = ["lower the batch or the sequence"]
        if plan.spec.lora is None:
            ways.append("train LoRA (`--use_peft`)")
        if plan.spec.fsdp == 1:
            ways.append("shard it over several cards (`--fsdp 'full_shard auto_wrap' --num_processes 8`)")
        ways.append("a card with more memory")
        lines.append(f"nothing fits: {', or '.join(ways)}")
    if host:
        room = f"`--memory_host_mb {plan.host_mb:g}`" if plan.host_mb is not None else "not given (`--memory_host_mb`)"
        processes = max(plan.spec.fsdp, plan.spec.ddp)
        if plan.host_mb is not None and processes > 1:
            room += f", shared by the {processes} processes: {_mb(plan.host_mb / processes)} MiB each"
        lines.append(
            f"host: MiB the layers' offloaded tensors hold in the host's memory at their most (`Offload+`), copied at "
            f"the card's link ({plan.device.host_link_name if plan.device else 'PCIe'}); the host's room: {room}"
        )
    if plan.device is not None:
        lines.append(f"counted in other: cuBLAS's workspaces, {WORKSPACES_MIB:g} MiB (as measured on an H200)")
    lines.append(f"not seen by a dry run (leave room for them): {NOT_SEEN}")
    lines.append(ROOFLINE)
    return "\n".join(lines)


def _n(value: Optional[int]) -> str:
    return "none (not even 1)" if not value else f"{value:,}"


def _mb(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _config(model: Union[str, object]):
    if not isinstance(model, str):
        return model, type(model).__name__
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model), model


_LEVEL1 = "level 1 (every layer recomputed)"
_TILED_PLANS = "Layer+:1:-1,Loss+:1:-1,MLP+:1:-1@tiles8"  # the least memory `auto` reaches on a dense causal LM
_TILED = "level 1 + Loss+ + MLP+ (8 tiles)"
_OFFLOADED_PLANS = _TILED_PLANS + ",Offload+:1:-1"  # and every layer's input on the host: the least a card reaches
_OFFLOADED = "level 1 + Loss+ + MLP+ + Offload+"
_FLOOR_PLANS = {"level 1 + Loss+": "Layer+:1:-1,Loss+:1:-1", _TILED: _TILED_PLANS, _OFFLOADED: _OFFLOADED_PLANS}


def _configurations(
    causal: bool, plans: Optional[str], level: int, budget_mb: Optional[float], card: bool = False
) -> List[tuple]:
    """(name, flags, dry_run's keywords) for each way the table compares."""
    out = [
        ("eager", "--memory_opt_backend none", dict(backend=False)),
        (
            "transformers' checkpointing",
            "--gradient_checkpointing true --memory_opt_backend none",
            dict(checkpointing=True),
        ),
        (_LEVEL1, "--memory_opt_level 1", dict(level=1)),
    ]
    if causal:
        out.append(("Loss+ (the head in chunks)", "--memory_opt_config 'Loss+:1:-1'", dict(plans="Loss+:1:-1")))
        out.append(
            ("level 1 + Loss+", "--memory_opt_config 'Layer+:1:-1,Loss+:1:-1'", dict(plans="Layer+:1:-1,Loss+:1:-1"))
        )
        out.append((_TILED, f"--memory_opt_config '{_TILED_PLANS}'", dict(plans=_TILED_PLANS)))
        if card:  # the host is another memory than the card's: offload frees the card's
            out.append((_OFFLOADED, f"--memory_opt_config '{_OFFLOADED_PLANS}'", dict(plans=_OFFLOADED_PLANS)))
    if plans and plans != "auto":
        out.append((f"yours: {plans}", f"--memory_opt_config '{plans}'", dict(plans=plans)))
    elif level:
        out.append((f"yours: level {level}", f"--memory_opt_level {level}", dict(level=level)))
    if budget_mb is not None:
        flags = f"--memory_opt_config auto --memory_budget_mb {budget_mb:.0f}"
        out.append(("auto", flags, dict(plans="auto", budget_mb=float(int(budget_mb)))))
    return out


def plan(
    model,
    *,
    name: Optional[str] = None,
    batch: int = 1,
    seq: int = 2048,
    bf16: bool = False,
    fp16: bool = False,
    dtype: Optional[str] = None,
    lora: Optional[dict] = None,
    optim: str = "adamw_torch_fused",
    gradient_accumulation_steps: int = 1,
    plans: Optional[str] = None,
    level: int = 0,
    budget_mb: Optional[float] = None,
    device: Optional[str] = None,
    search: bool = True,
    fsdp: int = 1,
    ddp: int = 1,
    rows: Optional[List[str]] = None,
    host_mb: Optional[float] = None,
) -> Plan:
    """Dry-run the step of `model` (a hub name or a local folder: its config only; or a transformers config) under
    each configuration the table compares, on `device` (the device table: `devices.DEVICES`) or under `budget_mb`.

    `dtype` is the weights' dtype as loaded (default: float32, or bfloat16 under LoRA with `bf16`, as PEFT recipes
    load them); `bf16` / `fp16` turn on autocast as the Trainer's flags do. With `search` and a budget, the largest
    batch and the longest sequence `auto` fits are found by dry runs of its floor (`Plan.reach`). `fsdp`: the number
    of processes FSDP2 shards every layer and the model over (`--fsdp full_shard`), each figure what one of them
    holds (1: no sharding). `ddp`: the number of processes DistributedDataParallel replicates the step over (several
    processes without `--fsdp`: accelerate's default), each holding the whole model and DDP's gradient buckets.
    `rows`: the configurations to dry-run, by name (None: every one; `["auto"]`: what `--memory_plan_file` reads).
    `host_mb`: the host memory the layers' offloaded tensors may hold (`Offload+`, on a card: a row offloading every
    layer's input and `auto` weigh it; a row whose copies hold more does not fit), shared evenly by the step's
    processes (`fsdp`, `ddp`: each holds its own copies); None: not given, `auto` weighs this machine's available
    memory."""
    config, found = _config(model)
    name = name or found
    autocast = "bfloat16" if bf16 else ("float16" if fp16 else None)
    if dtype is None:
        dtype = "bfloat16" if (lora is not None and bf16) else "float32"
    spec = StepSpec(
        config,
        batch=batch,
        seq=seq,
        dtype=dtype,
        autocast=autocast,
        optimizer=optim,
        grad_accum=gradient_accumulation_steps,
        lora=lora,
        fsdp=fsdp,
        ddp=ddp,
    )
    on_cpu = device is not None and device.strip().lower() == CPU
    if on_cpu and budget_mb is None:
        raise ValueError("`--device cpu` plans the CPU's step, which has no memory size here: give a budget")
    target = None if on_cpu else find(device)
    if budget_mb is None and target is not None:
        budget_mb = target.budget_mb
    # a card's cuBLAS workspaces (the forward's thread and autograd's), which its counter reads and no storage shows
    held = int(WORKSPACES_MIB * MIB) if target is not None else 0
    # the card's attention kernels (fp32 and masks take others than the CPU's, which keep other tensors); the CPU's own
    # (None) with `device="cpu"`, as a run on the CPU counts its own step
    capability = (target or DEVICES[DEFAULT_DEVICE]).capability
    kernels = None if on_cpu else CudaKernels(capability)
    causal = any(a.endswith("ForCausalLM") for a in (getattr(config, "architectures", None) or ["ForCausalLM"]))
    out = Plan(name, spec, target, budget_mb, [], kernels=CPU if on_cpu else f"cuda {capability[0]}.{capability[1]}")
    out.host_mb = host_mb
    # the machine's host memory, shared by the processes of the step on it (each holds its own copies): one's share
    each_host = None if host_mb is None else host_mb / max(fsdp, ddp)
    for label, flags, kwargs in _configurations(causal, plans, level, budget_mb, card=not on_cpu):
        if rows is not None and label not in rows:
            continue
        conf = Configuration(label, flags)
        try:
            if kwargs.get("plans") == "auto":
                kwargs = {**kwargs, "host_mb": each_host}
            with _quiet():
                result = dry_run(spec, **kwargs, cost_device=target, held_bytes=held, kernels=kernels)
        except (RuntimeError, ValueError) as e:
            conf.problem = _short(str(e))
        else:
            # a run of one process starts `auto` from a dry run of its own step: its step one runs the choice
            _fill(
                conf,
                result,
                budget_mb,
                choice_only=kwargs.get("plans") == "auto" and spec.fsdp == 1,
                host_mb=each_host,
            )
            if kwargs.get("plans") == "auto":
                out.auto_solver = result.solver
                if result.auto is not None and result.auto.get("config") is not None:
                    conf.choice = result.auto["config"]
            if label == _TILED:
                conf.note = _untiled_by_auto(result, spec.lora)
        out.configurations.append(conf)
    # the least memory `auto` reaches: every layer recomputed whole, the head in chunks, and the MLPs in the most tiles
    # it weighs where the layers' MLPs can be tiled (a mixture of experts' cannot: that row says why; an MLP drawing
    # several dropout masks a forward `auto` never tiles: its note says so)
    floors = [_OFFLOADED, _TILED, "level 1 + Loss+"] if causal else [_LEVEL1]
    usable = [
        c
        for c in out.configurations
        if c.peak_mb is not None and c.note is None and (each_host is None or c.host_mb <= each_host)
    ]
    floor = next((c for n in floors for c in usable if c.name == n), None)
    if search and budget_mb is not None and floor is not None:
        out.reach = _reach(spec, floor, budget_mb, held, kernels, each_host)
    return out


def _untiled_by_auto(result: DryRun, lora: Optional[dict]) -> Optional[str]:
    """Why `auto` would not tile the MLPs the tiled row tiles (they draw dropout masks that tiles draw otherwise on a
    GPU: `levers.mlp.MLPMeasure.draws_as_whole`), from that row's dry run; None where it would."""
    measured = getattr(result.profile, "levers", {}).get("mlp") if result.profile is not None else None
    if measured is None or measured.draws_as_whole():
        return None
    fix = "; `--lora_dropout 0` lets it, where the masks are LoRA's" if lora and lora.get("lora_dropout") else ""
    return (
        f"`auto` does not tile these MLPs: each draws {measured.draws} dropout mask(s) a forward, which tiles draw in "
        f"another order on a GPU{fix}"
    )


@contextmanager
def _quiet() -> Iterator[None]:
    """What the training run would warn about (how `Loss+` returns no logits, transformers' cache under
    checkpointing) is not the plan's to say: warnings of the package and of transformers are held back meanwhile."""
    loggers = [logging.getLogger(n) for n in ("optimum_memopt", "transformers")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def largest(
    spec: StepSpec,
    field: str,
    budget_bytes: float,
    kwargs: dict,
    known: int,
    cap: int,
    step: int = 1,
    host_bytes: Optional[float] = None,
    known_host: float = 0.0,
):
    """The largest `field` ("batch" or "seq", a multiple of `step`, at most `cap`) whose dry run under `kwargs` peaks
    within `budget_bytes` (and, with `host_bytes`, whose offloaded tensors hold no more on the host): a line through
    two dry runs (the plan's own value, whose peak is `known` and host figure `known_host`, and twice it), then dry
    runs at its prediction, moved down until one fits (at most four); the value and every run's figures. With
    `host_bytes` the host's figures are a line too, and each prediction is the lower of the two lines' (the host's
    room bound the 8B plan at batch 31 while its memory allowed 42: moved down by the memory's overshoot alone, a
    step at a time, the search gave up at batch 1). A value is dry-run once: one already run (twice the plan's value,
    where the cap makes it the prediction too) gives its peak again. A run whose host figure is over `host_bytes`
    does not fit (its figures as counted)."""
    peaks = {}  # each value run, in the order run: its peak
    hosts = {}  # and what its offloaded tensors held on the host

    def peak_at(n: int) -> int:
        if n not in peaks:
            with _quiet():
                result = dry_run(replace(spec, **{field: n}), **kwargs, peak_only=True)
            peaks[n], hosts[n] = result.peak_bytes, result.host_peak_bytes
        return peaks[n]

    def fits_at(n: int) -> bool:
        return peak_at(n) <= budget_bytes and (host_bytes is None or hosts[n] <= host_bytes)

    def runs() -> list:
        return [
            {field: n, "peak_mb": nbytes / MIB, **({"host_mb": hosts[n] / MIB} if hosts.get(n) else {})}
            for n, nbytes in peaks.items()
        ]

    start = getattr(spec, field)
    twice = min(2 * start, cap)
    if twice == start:
        return (start if known <= budget_bytes else None), runs()
    slope = (peak_at(twice) - known) / (twice - start)
    if slope <= 0:
        return None, runs()
    host_slope = (hosts[twice] - known_host) / (twice - start) if host_bytes is not None else 0.0

    def reaches(n: int, peak: float, host: float) -> float:
        """Where the lines through `n`'s figures meet the budget and, where it binds, the host's room."""
        at = n + (budget_bytes - peak) / slope
        if host_slope > 0:
            at = min(at, n + (host_bytes - host) / host_slope)
        return at

    fits, over = (start if known <= budget_bytes else 0), cap + step
    n = reaches(start, known, known_host)
    for _ in range(4):
        n = max(step, min(cap, int(n) // step * step))
        if n <= fits or n >= over:
            break
        if fits_at(n):
            fits = n
            n = reaches(n, peaks[n], hosts[n])
        else:
            over = n
            n = min(n - step, reaches(n, peaks[n], hosts[n]))
    return (fits or None), runs()


def _reach(spec: StepSpec, floor: Configuration, budget_mb: float, held: int = 0, kernels=None, host_mb=None) -> dict:
    kwargs = dict(level=1) if floor.name == _LEVEL1 else dict(plans=_FLOOR_PLANS[floor.name])
    kwargs["held_bytes"], kwargs["kernels"] = held, kernels
    budget = budget_mb * MIB
    known = int((floor.peak_mb or 0) * MIB)
    most_tokens = getattr(spec.config.get_text_config(), "max_position_embeddings", None) or 1 << 20
    host = None if host_mb is None else host_mb * MIB
    known_host = (floor.host_mb or 0.0) * MIB
    batch, batch_runs = largest(
        spec, "batch", budget, kwargs, known, cap=1 << 16, host_bytes=host, known_host=known_host
    )
    seq, seq_runs = largest(
        spec, "seq", budget, kwargs, known, cap=int(most_tokens), step=128, host_bytes=host, known_host=known_host
    )
    runs = batch_runs + seq_runs

    def host_at(field: str, n: Optional[int]) -> Optional[float]:
        """What the floor's offloaded tensors hold on the host at the value found (the plan's own: its row's)."""
        if n is None:
            return None
        if n == getattr(spec, field):
            return floor.host_mb
        return next((run.get("host_mb", 0.0) for run in runs if run.get(field) == n), None)

    hosts = {"batch": host_at("batch", batch), "seq": host_at("seq", seq)}
    return {
        "batch": batch,
        "seq": seq,
        "seq_cap": int(most_tokens),
        "under": floor.name,
        "host_mb": hosts,
        "runs": runs,
    }


def _fill(
    conf: Configuration, result: DryRun, budget_mb: Optional[float], choice_only: bool = False, host_mb=None
) -> None:
    """The configuration's figures from its dry run: the whole run's highest count; `auto`'s (`choice_only`), its
    choice's step's (`DryRun.answer_step`): a training run's `auto` starts from a dry run of its own step, and its
    step one runs the choice (`backends.torch.decide.from_plan`), never the step this dry run measured the choice
    from (every layer recomputed whole, the MLP whole: at long sequence more than the choice)."""
    peak, parts, at = result.peak_bytes, result.parts, result.peak_at
    if choice_only and result.step_parts:
        peak, (parts, at) = result.step_peaks[result.answer_step], result.step_parts[result.answer_step]
    conf.peak_mb = peak / MIB
    conf.before_training_mb = result.before_training_bytes / MIB
    conf.parts_mb = {p: b / MIB for p, b in parts.items()}
    conf.peak_at = at
    conf.host_mb = result.host_peak_bytes / MIB
    conf.fits = (
        None if budget_mb is None else conf.peak_mb <= budget_mb and (host_mb is None or conf.host_mb <= host_mb)
    )
    conf.step_seconds = result.step_seconds
    conf.dry_run_seconds = result.seconds


def _short(text: str) -> str:
    text = text.replace("optimum-memopt: ", "")
    return text if len(text) < 300 else text[:297] + "..."
