"""`MemoryOptConfig`: what the user asked of the memory optimizer, validated, serializable.

It describes; it probes nothing (no installation check, no CUDA query): the trainer hook checks the
environment when the trainer is built. `MemoptTrainingArguments` builds one from its flags (and,
where a flag is not given, from ORT's own `ORTMODULE_*` variables); it can also be built directly:

    MemoryOptConfig(plans="Gelu+:1:-1")
    MemoryOptConfig(level=1)
    MemoryOptConfig(plans="auto", budget_mb=4000)

Errors name the setting and where its value came from (`sources`), quote the value and show an
accepted form.
"""

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Union

from . import plans as grammar
from .plans import PlanEntry, PlanError

CONFIG_FLAG = "--memory_opt_config"
LEVEL_FLAG = "--memory_opt_level"
BUDGET_FLAG = "--memory_budget_mb"
SHARE_FLAG = "--activation_memory_budget"
HOST_FLAG = "--memory_host_mb"
BACKENDS = ("ort", "torch")
BACKEND_FLAG = "--memory_opt_backend"
LEVELS = {0: "the plans of --memory_opt_config", 1: "layer-wise recompute", 2: "layer-wise recompute with compromise"}


def _where(source: str, flag: str) -> str:
    """How a message names a value's origin: the flag, or the variable it was read from."""
    return f"`{flag}`" if source == flag else f"`{flag}` (read from {source})"


@dataclass
class MemoryOptConfig:
    """The memory optimizer's settings.

    Args:
        plans: recompute plans (inline string, JSON file path, list of strings or `PlanEntry`), or `"auto"`.
        level: 0 = the plans; 1 = layer-wise recompute; 2 = layer-wise recompute with compromise.
        backend: the backend that applies them: `"ort"` (ONNX Runtime's ORTModule) or `"torch"` (current PyTorch).
        budget_mb: with `plans="auto"`, the peak (MiB) the chosen plans must fit under.
        activation_budget: with `plans="auto"` (torch backend), instead of `budget_mb`: the share (0 to 1) of the
            bytes the layers keep for backward without recompute that the chosen plans may keep, as
            `torch.compile`'s `activation_memory_budget` is a share.
        probe_max_plans, probe_steps: with `plans="auto"`, how many plans to measure, for how many steps each.
        sources: where each value came from (`{"plans": "$ORTMODULE_MEMORY_OPT_CONFIG"}`), for messages.
    """

    plans: Union[str, Sequence[Union[str, PlanEntry]], None] = None
    level: int = 0
    backend: str = "ort"
    budget_mb: Optional[float] = None
    activation_budget: Optional[float] = None
    probe_max_plans: int = 6
    probe_steps: int = 6
    sources: Dict[str, str] = field(default_factory=dict)
    entries: List[PlanEntry] = field(init=False, default_factory=list)
    auto: bool = field(init=False, default=False)

    def __post_init__(self):
        config_src = self.sources.get("plans", CONFIG_FLAG)
        level_src = self.sources.get("level", LEVEL_FLAG)
        # The level: an int 0-2; True, 1.0 or "1" are not levels.
        if type(self.level) is not int or self.level not in LEVELS:
            raise ValueError(
                f"{_where(level_src, LEVEL_FLAG)} is {self.level!r}; expected the integer 0 (the plans of "
                f"{CONFIG_FLAG}), 1 (layer-wise recompute) or 2 (layer-wise recompute with compromise), as in "
                f"`{LEVEL_FLAG} 1`"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"`{BACKEND_FLAG}` is {self.backend!r}; expected one of {', '.join(map(repr, BACKENDS))}, as in "
                f"`{BACKEND_FLAG} torch`"
            )
        if self.backend == "torch" and self.level == 2:
            raise ValueError(
                f"{_where(level_src, LEVEL_FLAG)} is 2 with `{BACKEND_FLAG} torch`: ONNX Runtime's level 2 adds plans "
                f"that keep part of an activation (type 2, 'recompute with compromise'), which have no counterpart in "
                f"PyTorch; use `{LEVEL_FLAG} 1` (whole layers recomputed) or plans, as in "
                f"`{CONFIG_FLAG} {grammar.EXAMPLE}`"
            )
        value = self.plans
        self.auto = isinstance(value, str) and value.strip().lower() == grammar.AUTO
        if self.auto:
            self.plans = grammar.AUTO
        else:
            if value is not None and not isinstance(value, (str, list, tuple)):
                raise ValueError(
                    f"{_where(config_src, CONFIG_FLAG)} is {value!r} ({type(value).__name__}); expected plans as text "
                    f"or a list of them, as in `{CONFIG_FLAG} {grammar.EXAMPLE}`, or `auto`"
                )
            try:
                if value and not isinstance(value, str):
                    value = [str(v) for v in value]
                self.entries = grammar.parse_plans(value)
            except PlanError as e:
                raise ValueError(f"{_where(config_src, CONFIG_FLAG)} {e}") from None
            self.plans = grammar.to_inline(self.entries) or None
            torch_only = [
                str(e)
                for e in self.entries
                if e.layers or e.parameter or e.subgraph == grammar.LAYER or grammar.lever_syntax(e.subgraph)
            ]
            if self.backend == "ort" and torch_only:
                raise ValueError(
                    f"{_where(config_src, CONFIG_FLAG)} has {', '.join(map(repr, torch_only))}: whole-layer plans "
                    f"(`Layer+`), the levers beyond the layers (the chunked head and loss, `Loss+`), layer selectors "
                    f"(`@...`) and lever parameters are the torch backend's; ONNX Runtime applies a plan "
                    f"to its first N occurrences ({'Gelu+:1:2'!r}) and recomputes every layer at `{LEVEL_FLAG} 1`; "
                    f"pass `{BACKEND_FLAG} torch` to use them"
                )
            compromise = [str(e) for e in self.entries if e.optimization_type == 2]
            if self.backend == "torch" and compromise:
                subgraph, _, count = compromise[0].rsplit(":", 2)
                raise ValueError(
                    f"{_where(config_src, CONFIG_FLAG)} has {', '.join(map(repr, compromise))} with optimization "
                    f"type 2 (recompute with compromise: ONNX Runtime keeps part of the activation), which the torch "
                    f"backend cannot do; use type 1, as in {f'{subgraph}:1:{count}'!r}"
                )
        if self.level in (1, 2) and (self.entries or self.auto):
            who = (
                "ONNX Runtime ignores the plans and applies its own layer-wise plans"
                if self.backend == "ort"
                else "the torch backend ignores the plans and recomputes whole layers"
            )
            raise ValueError(
                f"{_where(level_src, LEVEL_FLAG)} is {self.level} and {_where(config_src, CONFIG_FLAG)} is "
                f"{self.plans!r}, but at level 1 or 2 {who}; give either `{LEVEL_FLAG} 1` or "
                f"`{CONFIG_FLAG} {grammar.EXAMPLE}`"
            )
        if self.budget_mb is not None:
            ok = isinstance(self.budget_mb, (int, float)) and not isinstance(self.budget_mb, bool)
            if not ok or not math.isfinite(self.budget_mb) or self.budget_mb <= 0:
                raise ValueError(
                    f"`{BUDGET_FLAG}` is {self.budget_mb!r}; expected a positive, finite number of MiB, as in "
                    f"`{CONFIG_FLAG} auto {BUDGET_FLAG} 4000`"
                )
            if not self.auto:
                raise ValueError(
                    f"`{BUDGET_FLAG} {self.budget_mb:g}` is only used by `{CONFIG_FLAG} auto`, but "
                    f"{_where(config_src, CONFIG_FLAG)} is {self.plans!r}; add `{CONFIG_FLAG} auto`, or drop "
                    f"`{BUDGET_FLAG}`"
                )
        if self.activation_budget is not None:
            self._check_share(config_src)
        if self.auto and self.budget_mb is None and self.activation_budget is None:
            raise ValueError(
                f"`{CONFIG_FLAG} auto` needs a budget: add `{BUDGET_FLAG}`, as in "
                f"`{CONFIG_FLAG} auto {BUDGET_FLAG} 4000`"
                + (f" (or a share of the activations, `{SHARE_FLAG} 0.3`)" if self.backend == "torch" else "")
            )
        for name in ("probe_max_plans", "probe_steps"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"`--memory_{name}` is {v!r}; expected a positive integer, as in `--memory_{name} 6`")

    def _check_share(self, config_src: str) -> None:
        v = self.activation_budget
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v <= 1
        if not ok:
            raise ValueError(
                f"`{SHARE_FLAG}` is {v!r}; expected the share of the layers' activations to keep, from 0 to 1, as "
                f"in `{CONFIG_FLAG} auto {SHARE_FLAG} 0.3`"
            )
        if not self.auto:
            raise ValueError(
                f"`{SHARE_FLAG} {v:g}` is only used by `{CONFIG_FLAG} auto`, but {_where(config_src, CONFIG_FLAG)} "
                f"is {self.plans!r}; add `{CONFIG_FLAG} auto`, or drop `{SHARE_FLAG}`"
            )
        if self.budget_mb is not None:
            raise ValueError(
                f"`{BUDGET_FLAG} {self.budget_mb:g}` and `{SHARE_FLAG} {v:g}` are two budgets; give one, as in "
                f"`{CONFIG_FLAG} auto {BUDGET_FLAG} 4000` or `{CONFIG_FLAG} auto {SHARE_FLAG} 0.3`"
            )
        if self.backend != "torch":
            raise ValueError(
                f"`{SHARE_FLAG}` is chosen from the first step by the torch backend (`--memory_opt_backend torch`); "
                f"the {self.backend} backend's `auto` measures fresh runs under a peak: use `{BUDGET_FLAG}`, as in "
                f"`{CONFIG_FLAG} auto {BUDGET_FLAG} 4000`"
            )

    @property
    def enabled_entries(self) -> List[PlanEntry]:
        return [e for e in self.entries if e.enabled]

    @property
    def active(self) -> bool:
        """Whether anything is recomputed (or will be, once `auto` has chosen)."""
        return bool(self.enabled_entries) or self.level > 0 or self.auto

    def summary(self) -> str:
        if self.level:
            return f"level {self.level} ({LEVELS[self.level]})"
        if self.auto and self.activation_budget is not None:
            return f"auto keeping {self.activation_budget:.0%} of the layers' activations"
        if self.auto:
            return f"auto under {self.budget_mb:g} MiB"
        if self.entries:
            return grammar.to_inline(self.entries)
        return "off"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["entries"] = [str(e) for e in self.entries]
        return d


def check_host_mb(host_mb, config: "MemoryOptConfig") -> None:
    """`--memory_host_mb`: a positive, finite number of MiB, for `auto` under a budget in MiB (what offload's copies
    may hold on the host); ValueError naming the flag otherwise."""
    if host_mb is None:
        return
    ok = isinstance(host_mb, (int, float)) and not isinstance(host_mb, bool) and math.isfinite(host_mb)
    if not ok or host_mb <= 0:
        raise ValueError(
            f"`{HOST_FLAG}` is {host_mb!r}; expected a positive, finite number of MiB, as in "
            f"`{CONFIG_FLAG} auto {BUDGET_FLAG} 70000 {HOST_FLAG} 200000`"
        )
    if config.backend != "torch":
        raise ValueError(
            f"`{HOST_FLAG} {host_mb:g}` is what the torch backend's `{CONFIG_FLAG} auto` may offload to the host, but "
            f"`--memory_opt_backend {config.backend}` trains; add `--memory_opt_backend torch`, or drop `{HOST_FLAG}`"
        )
    if not config.auto or config.budget_mb is None:
        but = f"the plans are {config.plans!r}" if not config.auto else f"no `{BUDGET_FLAG}` is given"
        raise ValueError(
            f"`{HOST_FLAG} {host_mb:g}` is the host memory `{CONFIG_FLAG} auto` may offload to under a budget in "
            f"MiB, but {but}; add `{CONFIG_FLAG} auto {BUDGET_FLAG} 70000`, or drop `{HOST_FLAG}`"
        )
