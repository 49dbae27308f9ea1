"""The largest size that fits a budget, searched by measuring: a batch (benchmarks/loss_decoder.py) or a sequence
length (benchmarks/long_context.py), in multiples of a step. Two measured sizes give a line, the line's guess is
checked with the next size up, and where it undershoots (a peak nearly flat in the size, as `auto`'s) the size
grows by doubling strides; then the last stride is halved down to one step."""

from typing import Callable


def largest_fitting(measured: Callable[[int], object], step: int, most: int, budget: float) -> int:
    """The largest multiple of `step` up to `most` whose measurement (`measured(size)`: the advisor's `Measurement`,
    its `ok` and `peak_mb`; the caller keeps each) fits `budget` MiB; 0 where `step` does not fit."""

    def fits(size: int) -> bool:
        m = measured(size)
        return m.ok and m.peak_mb <= budget

    if not fits(step):
        return 0
    low, high = step, None
    second = 2 * step
    if fits(second):
        low = second
        per = (measured(second).peak_mb - measured(step).peak_mb) / step
        guess = int((budget - measured(second).peak_mb) / per) // step * step + second if per > 0 else second * 4
        guess = max(second + step, min(guess, most))
        stride = step
        while guess <= most:  # the line undershot: strides double
            if fits(guess):
                low = guess
                guess += stride
                stride *= 2
            else:
                high = guess
                break
        while high is not None and high - low > step:  # the line was off: narrow down
            mid = (low + high) // 2 // step * step
            if fits(mid):
                low = mid
            else:
                high = mid
    return low
