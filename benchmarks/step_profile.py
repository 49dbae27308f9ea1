#!/usr/bin/env python
"""Where one training step's time goes: torch's profiler around one step of a run (benchmarks/decoder.py's
`--profile_step N`), summed into figures that say why one recipe is slower than another on a card.

Per step it writes (`--profile_out`, JSON):

- `wall_ms`: the step on the host's clock, the device synchronized at both ends;
- `device`: the kernels' time on the device, by stream and by kernel (the 30 longest in all), summed;
- `copies`: the copies between host and device (each way: count, bytes, time) and how much of their time ran under
  a kernel of another stream (`hidden_ms`): offload's copies are free where they are hidden;
- `marks`: the backend's recompute, `optimum_memopt: recompute layer` (a layer recomputed whole) and
  `optimum_memopt: recompute ops` (op plans' recipes), their time on the host's timeline and, on a card, the time
  of the device's work under them (the union of their spans on each stream);
- `cpu_ops`: the host's aten ops by total time (on the CPU, where they are the compute).

Two summaries side by side (the recipe first, then the one to explain against it):

    python benchmarks/step_profile.py $OUT/prof_layer.json $OUT/prof_auto.json
"""

import bisect
import json
import os
import sys
from collections import defaultdict
from typing import Dict, Iterable, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from optimum_memopt.backends.torch.apply.recipe import RECOMPUTE_LAYER, RECOMPUTE_OPS  # noqa: E402

RECOMPUTE_MARKS = (RECOMPUTE_LAYER, RECOMPUTE_OPS)
# the Chrome trace's categories: a device's kernel and copy, a profiler range on the device's and the host's timeline
KERNEL, COPY, DEVICE_MARK, HOST_MARK = "kernel", "gpu_memcpy", "gpu_user_annotation", "user_annotation"
CPU_OP = "cpu_op"


def union(intervals: Iterable[Tuple[float, float]]) -> List[Tuple[float, float]]:
    """Intervals (start, end) merged into disjoint ones, in order."""
    merged: List[List[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def covered(merged: List[Tuple[float, float]], a: float, b: float) -> float:
    """How much of [a, b] the disjoint, ordered intervals `merged` cover."""
    i = max(bisect.bisect_right(merged, (a, float("inf"))) - 1, 0)
    total = 0.0
    while i < len(merged) and merged[i][0] < b:
        lo, hi = max(a, merged[i][0]), min(b, merged[i][1])
        total += max(hi - lo, 0.0)
        i += 1
    return total


def _direction(name: str) -> str:
    for way in ("DtoH", "HtoD", "DtoD"):
        if way in name:
            return way
    return "other"


def summarize(events: List[dict], wall_ms: float = 0.0) -> Dict[str, object]:
    """The figures above from a Chrome trace's events (torch.profiler's `export_chrome_trace`; times in us)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in spans if e.get("cat") == KERNEL]
    by_stream: Dict[str, float] = defaultdict(float)
    by_name: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    busy: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
    for e in kernels:
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        by_stream[stream] += e["dur"] / 1e3
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"] / 1e3
        busy[stream].append((e["ts"], e["ts"] + e["dur"]))
    merged = {s: union(v) for s, v in busy.items()}
    copies: Dict[str, Dict[str, float]] = {}
    others_of: Dict[str, List[Tuple[float, float]]] = {}  # every other stream's kernels, merged
    for e in (e for e in spans if e.get("cat") == COPY):
        way = copies.setdefault(_direction(e["name"]), dict(count=0, bytes=0, ms=0.0, hidden_ms=0.0))
        stream = str(e.get("args", {}).get("stream", e.get("tid")))
        a, b = e["ts"], e["ts"] + e["dur"]
        if stream not in others_of:
            others_of[stream] = union(iv for s, m in merged.items() if s != stream for iv in m)
        others = others_of[stream]
        way["count"] += 1
        way["bytes"] += int(e.get("args", {}).get("bytes", 0))
        way["ms"] += e["dur"] / 1e3
        way["hidden_ms"] += covered(others, a, b) / 1e3
    marks = {}
    for name in RECOMPUTE_MARKS:
        host = [e for e in spans if e.get("cat") == HOST_MARK and e["name"] == name]
        device: Dict[str, List[Tuple[float, float]]] = defaultdict(list)
        for e in spans:
            if e.get("cat") == DEVICE_MARK and e["name"] == name:
                device[str(e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
        device_ms = sum(b - a for ivs in device.values() for a, b in union(ivs)) / 1e3
        marks[name] = dict(count=len(host), host_ms=sum(e["dur"] for e in host) / 1e3, device_ms=device_ms)
    ops: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    for e in spans:
        if e.get("cat") == CPU_OP:
            ops[e["name"]][0] += 1
            ops[e["name"]][1] += e["dur"] / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return dict(
        wall_ms=wall_ms,
        device=dict(
            kernels_ms=sum(by_stream.values()),
            by_stream=dict(by_stream),
            top=[dict(name=n, count=c, ms=ms) for n, (c, ms) in top],
        ),
        copies=copies,
        marks=marks,
        cpu_ops=[dict(name=n, count=c, ms=ms) for n, (c, ms) in sorted(ops.items(), key=lambda kv: -kv[1][1])[:30]],
    )


def profile_callback(step: int, out: str):
    """A Trainer callback that profiles training step `step` (1-based, as the Trainer counts) and writes its summary
    to `out` (benchmarks/decoder.py's `--profile_step`)."""
    import tempfile
    import time

    import torch
    from transformers import TrainerCallback

    cuda = torch.cuda.is_available()

    def synchronize():
        if cuda:
            torch.cuda.synchronize()

    class ProfileStep(TrainerCallback):
        def __init__(self):
            self.profiler, self.t0 = None, 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step + 1 != step:
                return
            activities = [torch.profiler.ProfilerActivity.CPU]
            if cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            synchronize()
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.profiler is None:
                return
            synchronize()
            wall_ms = (time.perf_counter() - self.t0) * 1e3
            self.profiler.__exit__(None, None, None)
            with tempfile.TemporaryDirectory() as tmp:
                trace = os.path.join(tmp, "trace.json")
                self.profiler.export_chrome_trace(trace)
                with open(trace) as f:
                    events = json.load(f)["traceEvents"]
            summary = dict(step=step, on="cuda" if cuda else "cpu", **summarize(events, wall_ms))
            with open(out, "w") as f:
                json.dump(summary, f, indent=1)
            self.profiler = None

    return ProfileStep()


def side_by_side(first: dict, second: dict) -> str:
    """Two summaries' figures in one table: the step, the recompute marks, the copies, and the kernels whose time
    differs most between them."""
    lines = [f"{'':44} {'first':>12} {'second':>12} {'second-first':>13}"]

    def row(label, a, b):
        lines.append(f"{label[:44]:44} {a:12.1f} {b:12.1f} {b - a:13.1f}")

    row("step (wall ms)", first["wall_ms"], second["wall_ms"])
    row("device kernels (ms)", first["device"]["kernels_ms"], second["device"]["kernels_ms"])
    for name in RECOMPUTE_MARKS:
        for where in ("host_ms", "device_ms"):
            row(f"{name.split(': ')[1]} {where[:-3]} (ms)", first["marks"][name][where], second["marks"][name][where])
    for way in sorted(set(first["copies"]) | set(second["copies"])):
        a, b = first["copies"].get(way, {}), second["copies"].get(way, {})
        row(f"copies {way} (ms)", a.get("ms", 0.0), b.get("ms", 0.0))
        row(f"copies {way} hidden (ms)", a.get("hidden_ms", 0.0), b.get("hidden_ms", 0.0))
    key = "top" if first["device"]["top"] or second["device"]["top"] else None
    listed = lambda s: {k["name"]: k["ms"] for k in (s["device"]["top"] if key else s["cpu_ops"])}  # noqa: E731
    a, b = listed(first), listed(second)
    for name in sorted(set(a) | set(b), key=lambda n: -abs(b.get(n, 0.0) - a.get(n, 0.0)))[:15]:
        row(name, a.get(name, 0.0), b.get(name, 0.0))
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f1, open(sys.argv[2]) as f2:
        print(side_by_side(json.load(f1), json.load(f2)))
