"""Each way a lever can run its piece of the step, run alone between steps and read aside: what each held above its
start, and its median seconds, never with more memory than step one's peak (or the budget `auto` trains under, where
higher) left free.

The rules every lever's measurement follows (the loss lever's and the tiled MLP's: tests/test_torch_loss.py,
tests/test_mlp.py):

- The ways run from the fewest rows up (a way's rows: the tokens it works on at once, a chunk's or a tile's), ties in
  the order given.
- Before a way first runs, its bound (the lever's `bound(rows, last)`: the most it could hold, from the shapes and
  from what the way run before it held) is checked against the room: step one's peak (or `auto`'s budget, where
  higher: `ModelProfile.room`) less what the device holds now, read again before each way (a first run may keep
  buffers). A way whose bound does not fit is not run, nor is any
  way after it (more rows: a bound at least as high); each is said in `why_not` with its own bound. A dry run's
  tensors hold no memory: every way runs.
- Each way runs once untimed (the kernels' one-time set-up; `also` then runs beside it, its result kept), then every
  way that ran is timed `repeats` times, interleaved (what drifts, a warming allocator or another process, spreads
  evenly over the ways), and the median taken. What a way held is its first timed run's. A dry run's counts and
  roofline seconds are the same every run: its ways run once, that run's figures taken.
- Every run is read aside (`aside.held_aside`): unseen by the readings around it, the process's random generators
  given back as it found them.
"""

import statistics
from dataclasses import dataclass, field
from typing import Callable, Dict, Generic, Hashable, List, Optional, Sequence, Tuple, TypeVar

from ....memory import MIB
from .aside import current_bytes, held_aside

Way = TypeVar("Way", bound=Hashable)


@dataclass
class Measured(Generic[Way]):
    """What `run_ways` measured, by way: those it ran (`held`, `seconds`, `bounds`, and `also`'s results) and those it
    did not (`why_not`, with each one's bound)."""

    held: Dict[Way, int] = field(default_factory=dict)  # the most each way held above its start, in bytes
    seconds: Dict[Way, float] = field(default_factory=dict)  # the median of its timed runs
    bounds: Dict[Way, int] = field(default_factory=dict)  # the most it was let hold before it first ran
    also: Dict[Way, object] = field(default_factory=dict)  # `also(way)` at its first run
    why_not: Dict[Way, str] = field(default_factory=dict)

    def ran(self, way: Way) -> bool:
        return way in self.held


def run_ways(
    ways: Sequence[Way],
    rows: Callable[[Way], int],
    bound: Callable[[int, Optional[Tuple[int, int]]], int],
    run: Callable[[Way], None],
    device: str,
    ceiling: Tuple[int, str],
    fake: bool,
    repeats: int,
    resets: bool = True,
    also: Optional[Callable[[Way], object]] = None,
) -> Measured[Way]:
    """Run each of `ways` by `run(way)` under the module's rules: `rows(way)` orders them; `bound(rows, last)` is the
    most a way of `rows` rows could hold, `last` the (rows, bytes held) of the way run before it (None for the
    first); `ceiling` the most the device may hold meanwhile, with its name (`ModelProfile.room`: step one's peak, or
    the budget); `fake`: a dry run's. `resets` as `aside.held_aside` takes it."""
    out: Measured[Way] = Measured()
    most, what = ceiling
    order = sorted(ways, key=rows)
    last: Optional[Tuple[int, int]] = None
    for i, way in enumerate(order):
        limit = bound(rows(way), last)
        room = most - current_bytes(device)
        if limit > room and not fake:
            for rest in order[i:]:
                out.why_not[rest] = (
                    f"it could hold up to {bound(rows(rest), last) / MIB:,.1f} MiB, and {what} left "
                    f"{max(room, 0) / MIB:,.1f} MiB free"
                )
            break
        held, seconds = held_aside(lambda: run(way), device, resets)
        out.bounds[way] = limit
        if also is not None:
            out.also[way] = also(way)
        last = (rows(way), held)
        if fake:
            out.held[way], out.seconds[way] = held, seconds
    measured = [way for way in order if way in out.bounds]
    times: Dict[Way, List[float]] = {}
    for _ in range(0 if fake else repeats):
        for way in measured:
            held, seconds = held_aside(lambda: run(way), device, resets)
            out.held.setdefault(way, held)
            times.setdefault(way, []).append(seconds)
    for way, taken in times.items():
        out.seconds[way] = statistics.median(taken)
    return out
