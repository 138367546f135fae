"""How sure a paired step-time ratio is: a distribution-free interval for the median of per-round ratios.

A round times one step of every method back to back (``benchmarks.run``, methods alternating), so the
ratio of two methods' steps in one round shares that moment's machine: the per-round ratios are the
evidence, their median the figure. On 2 CPU cores shared by 2-4 ranks a single round's ratio moves by
10-20% (Note [How sure a step-time ratio is]), so a figure without its interval cannot tell 0.97x from
1.00x.

Note [How sure a step-time ratio is]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
For n independent rounds, the number of per-round ratios below the true median is Binomial(n, 1/2),
whatever their distribution. So the k-th smallest and k-th largest ratios bracket the median with
probability 1 - 2 P(Binomial(n, 1/2) < k); ``median_interval`` takes the largest k that keeps this at
or above the confidence asked for (95%). Nothing is assumed about the shape of the noise (a loaded host
gives long tails one way), only that rounds are exchangeable. Below 6 rounds no order statistic reaches
95%: no interval. With 7 rounds the interval is the smallest to the largest ratio (98.4%); it narrows as
1/sqrt(n): for normal noise its half-width is about 2.5 standard deviations of one round's ratio over
sqrt(n), so +-2% at 151 rounds where one round's ratio moves by 10%.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """An interval holding the median of the distribution ``values`` were drawn from, with at least
    ``confidence`` (Note [How sure a step-time ratio is]); None when there are too few values."""
    n = len(values)
    tail = (1 - confidence) / 2
    below, k = 0.0, 0  # below: P(Binomial(n, 1/2) < k + 1)
    while k < n // 2:
        below += math.comb(n, k) / 2**n
        if below > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def paired_ratios(times: Sequence[float], reference: Sequence[float]) -> list[float]:
    """Per-round ratios of one method's step times to the reference's, timed in the same rounds."""
    return [t / r for t, r in zip(times, reference, strict=True)]


def slowest_rank_interval(
    per_rank: Sequence[tuple[Sequence[float], Sequence[float]]], confidence: float = 0.95
) -> tuple[float, float] | None:
    """The interval of the paired ratio a run reports: that of the rank whose median ratio is largest, as
    the step time is the slowest rank's. ``per_rank``: (times, reference times) of each rank."""
    ratios = [paired_ratios(times, reference) for times, reference in per_rank]
    return median_interval(max(ratios, key=statistics.median), confidence)


def interval_verdict(interval: tuple[float, float] | None, relation: str, bound: float) -> bool | None:
    """Met (True) when the whole interval is on the bound's side, not met (False) when the whole interval
    is on the other, None when it spans the bound or there is none."""
    if interval is None:
        return None
    low, high = interval
    inside = high <= bound if relation == "<=" else low >= bound
    outside = low > bound if relation == "<=" else high < bound
    return True if inside else (False if outside else None)


def interval_text(interval: list[float] | None) -> str:
    """A paired ratio's 95% interval ("" when there is none); three decimals, so that an end a hair over
    a bound does not print as the bound."""
    return "" if not interval else f"{interval[0]:.3f}-{interval[1]:.3f}"
