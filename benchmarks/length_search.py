"""How ``benchmarks.run`` searches for the longest sequence that trains within a memory budget: which
length to measure next from the peaks measured so far, and what counts as running out of memory."""

from __future__ import annotations


def is_out_of_memory(error: BaseException) -> bool:
    import torch

    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def next_candidate(
    points: dict[int, float], budget: float, granularity: int, tolerance: float, cap: int | None
) -> int | None:
    """The next length to measure: between the longest under and the shortest over ``budget``.

    Interpolates the measured peaks linearly (memory grows about linearly with length here); beyond the
    measured range it extrapolates from the two nearest points (at most 4x, at least 2x when going down).
    None when the bracket is within ``tolerance`` or one ``granularity`` step, or at the model's ``cap``.

    Peaks grow a little faster than linearly at long lengths (at sp=4 an 8-layer GPT's bytes per token rise
    from 5.7 KB between 2048 and 4096 tokens to 7.1 KB between 4096 and 5120), so a line through two points
    under-predicts beyond them and a search of two steps ended just over the budget, with the longest fit a
    step short of what it could have found. Going up, it therefore aims half the tolerance under the
    budget; between two points the chord of a convex curve errs on the side that fits already.
    """
    under = sorted(s for s, peak in points.items() if peak <= budget)
    over = sorted(s for s, peak in points.items() if peak > budget)
    lo, hi = (under[-1] if under else None), (over[0] if over else None)
    if lo is not None and hi is not None and hi <= lo * (1 + tolerance):
        return None
    if lo is not None and cap is not None and lo >= cap:
        return None

    def crossing(a: int, b: int, target: float = budget) -> float:
        slope = (points[b] - points[a]) / (b - a)
        return a + (target - points[a]) / slope if slope > 0 else float(b)

    if lo is not None and hi is not None:
        guess = crossing(lo, hi)
    elif lo is not None:  # every point fits: extrapolate up, aiming short (see above)
        guess = crossing(under[-2], lo, budget * (1 - tolerance / 2)) if len(under) > 1 else 2 * lo
        guess = min(guess, 4 * lo)
    else:  # nothing fits: extrapolate down
        guess = crossing(hi, over[1]) if len(over) > 1 else hi / 2
        guess = min(guess, hi / 2)
    candidate = int(guess) // granularity * granularity
    # Rounded onto a measured length, the guess says "about here": measure the neighbour inside the bracket.
    if lo is not None:
        candidate = max(candidate, lo + granularity)
    if hi is not None:
        candidate = min(candidate, hi - granularity)
    if cap is not None:
        candidate = min(candidate, cap)
    if candidate <= 0 or candidate in points:
        return None
    if (lo is not None and candidate <= lo) or (hi is not None and candidate >= hi):
        return None
    return candidate
