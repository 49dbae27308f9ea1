"""The probe: which plans are worth turning on, measured on the user's own script and machine.

Runs the script a few steps without recompute, then with each candidate plan ORT reported, then
at levels 1 and 2, and reports for each: ORT's predicted saving, the measured saving, the extra
time per step, and the ranking by memory saved per second of extra step time.
"""

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

from ..plans import PlanReport
from .measure import Measurement, Runner, backend_label, memory_flags, run_child, script_backend

# the `--memory_opt_level`s each backend has (the torch backend refuses 2: PyTorch has no "recompute with compromise")
BACKEND_LEVELS = {"ort": (1, 2), "torch": (1,)}

MIB = 1024.0 * 1024.0


@dataclass
class ProbeRow:
    label: str
    kind: str  # baseline | plan | level | pytorch
    config: str
    level: int
    measurement: Measurement
    predicted_saving_mb: Optional[float] = None
    measured_saving_mb: Optional[float] = None
    extra_time_s: Optional[float] = None

    @property
    def mb_per_extra_s(self) -> Optional[float]:
        if self.measured_saving_mb is None or self.extra_time_s is None:
            return None
        if self.extra_time_s <= 0:
            return math.inf if self.measured_saving_mb > 0 else 0.0
        return self.measured_saving_mb / self.extra_time_s

    def as_dict(self):
        m = self.measurement
        return {
            "label": self.label,
            "kind": self.kind,
            "config": self.config,
            "level": self.level,
            "ok": m.ok,
            "error": m.error,
            "batch_size": m.batch_size,
            "peak_mb": m.peak_mb,
            "step_time_s": m.step_time_s,
            "samples_per_s": m.samples_per_s,
            "resident_peak_mb": m.resident_peak_mb,
            "predicted_saving_mb": self.predicted_saving_mb,
            "measured_saving_mb": self.measured_saving_mb,
            "extra_time_s": self.extra_time_s,
            "mb_saved_per_extra_s": (
                None
                if self.mb_per_extra_s is None
                else ("inf" if math.isinf(self.mb_per_extra_s) else self.mb_per_extra_s)
            ),
        }


@dataclass
class ProbeReport:
    script_argv: List[str]
    batch_size: int
    steps: int
    device: Optional[str]
    rows: List[ProbeRow] = field(default_factory=list)
    backend: str = "ort"  # the backend the script trains through: labels say "ORT" or "torch backend"

    @property
    def label(self) -> str:
        return backend_label(self.backend)

    @property
    def baseline(self) -> Optional[ProbeRow]:
        return next((r for r in self.rows if r.kind == "baseline"), None)

    def ranked_plans(self) -> List[ProbeRow]:
        """Measured plans that saved memory, cheapest time per MiB first."""
        plans = [r for r in self.rows if r.kind == "plan" and r.measurement.ok and (r.measured_saving_mb or 0) > 0]
        return sorted(
            plans, key=lambda r: (-(r.mb_per_extra_s if r.mb_per_extra_s is not None else -1), -r.measured_saving_mb)
        )

    def as_dict(self):
        return {
            "script_argv": self.script_argv,
            "batch_size": self.batch_size,
            "steps": self.steps,
            "device": self.device,
            "backend": self.backend,
            "rows": [r.as_dict() for r in self.rows],
            "ranking": [r.config for r in self.ranked_plans()],
        }


def _fmt(x, digits=1, unit=""):
    if x is None:
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "no cost measured"
    return f"{x:,.{digits}f}{unit}"


def format_table(report: ProbeReport, markdown: bool = False) -> str:
    head = [
        "config",
        "peak MiB",
        f"{report.label} predicted saving MiB" if report.backend == "ort" else f"{report.label} measured table MiB",
        "measured saving MiB",
        "step s",
        "extra s/step",
        "MiB saved per extra s",
    ]
    rows = []
    for r in report.rows:
        m = r.measurement
        if not m.ok:
            rows.append([r.label, "failed" + (" (OOM)" if m.oom else ""), "-", "-", "-", "-", (m.error or "")[:60]])
            continue
        rows.append(
            [
                r.label,
                _fmt(m.peak_mb),
                _fmt(r.predicted_saving_mb, 2),
                _fmt(r.measured_saving_mb),
                _fmt(m.step_time_s, 3),
                _fmt(r.extra_time_s, 3),
                _fmt(r.mb_per_extra_s, 1),
            ]
        )
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in [head] + rows)


def _candidates(report: Optional[PlanReport], max_plans: int) -> List[tuple]:
    """The plans to probe, largest predicted saving first, as (plan string, predicted saving MiB)."""
    if report is None:
        return []
    found = [(p.as_request(), (p.saving_bytes or 0.0) / MIB) for p in report.plans if p.as_request()]
    found.sort(key=lambda x: -x[1])
    return found[:max_plans]


def probe(
    script_argv: Sequence[str],
    batch_size: int,
    steps: int = 6,
    max_plans: int = 6,
    levels: Optional[Sequence[int]] = None,
    include_pytorch: bool = False,
    progress: Callable[[str], None] = print,
    timeout: float = 1800,
    runner: Runner = run_child,
) -> ProbeReport:
    """`levels`: the `--memory_opt_level`s to measure; None for every level the script's backend has (ORT: 1 and 2;
    the torch backend: 1, as it refuses 2)."""
    script_argv = list(script_argv)
    report = ProbeReport(script_argv, batch_size, steps, None, backend=script_backend(script_argv))
    if levels is None:
        levels = BACKEND_LEVELS.get(report.backend, (1,))
    name = report.label
    total_hint = 1 + max_plans + len(levels) + int(include_pytorch)
    done = [0]

    def measure(label, flags):
        done[0] += 1
        progress(f"[probe {done[0]}/~{total_hint}] {label}: running {steps} steps at batch {batch_size} ...")
        m = runner(script_argv, label, flags, batch_size, steps=steps, timeout=timeout)
        status = (
            f"peak {m.peak_mb:,.1f} MiB, {m.step_time_s:.3f} s/step"
            if m.ok and m.step_time_s
            else f"failed: {m.error}"
        )
        progress(f"[probe {done[0]}/~{total_hint}] {label}: {status} ({m.wall_s:.0f} s)")
        return m

    base = measure(f"{name}, no recompute", memory_flags(True))
    report.device = base.device
    report.rows.append(ProbeRow(f"{name}, no recompute", "baseline", "", 0, base, 0.0, 0.0, 0.0))
    if not base.ok:
        return report
    candidates = _candidates(base.plans, max_plans)
    total_hint = 1 + len(candidates) + len(levels) + int(include_pytorch)
    for config, predicted in candidates:
        m = measure(config, memory_flags(True, config=config))
        report.rows.append(ProbeRow(config, "plan", config, 0, m, predicted))
    for level in levels:
        m = measure(f"level {level}", memory_flags(True, level=level))
        predicted = None
        if m.ok and m.plans:
            predicted = m.plans.saving_mb(enabled_only=True)
        report.rows.append(ProbeRow(f"level {level}", "level", "", level, m, predicted))
    if include_pytorch:
        plain = "PyTorch (no ORT)" if report.backend == "ort" else "PyTorch (no backend)"
        m = measure(plain, memory_flags(False))
        report.rows.append(ProbeRow(plain, "pytorch", "", 0, m))
    for row in report.rows[1:]:
        if row.measurement.ok:
            row.measured_saving_mb = base.peak_mb - row.measurement.peak_mb
            if row.measurement.step_time_s is not None and base.step_time_s is not None:
                row.extra_time_s = row.measurement.step_time_s - base.step_time_s
    return report


def plot(report: ProbeReport, path: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    colors = {"baseline": "black", "plan": "tab:blue", "level": "tab:red", "pytorch": "tab:green"}
    for r in report.rows:
        m = r.measurement
        if not m.ok or m.step_time_s is None or m.peak_mb is None:
            continue
        ax.scatter(m.step_time_s, m.peak_mb, color=colors[r.kind], s=40)
        ax.annotate(
            r.label if len(r.label) < 40 else r.label[:37] + "...",
            (m.step_time_s, m.peak_mb),
            fontsize=7,
            xytext=(4, 3),
            textcoords="offset points",
        )
    ax.set_xlabel("step time (s)")
    what = "MiB, allocated" if report.device == "cuda" else "MiB in use at the allocator, above the pre-training level"
    ax.set_ylabel(f"peak memory ({what})")
    ax.set_title(f"Memory vs step time, batch {report.batch_size} ({report.device})")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
