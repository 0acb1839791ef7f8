"""Small statistics helpers (no numpy)."""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` (0..100) of ``values``; nan when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return statistics.median(v) if v else math.nan


def spread(values: Iterable[float]) -> float:
    """(max - min) / median of the repeats, as a fraction: how noisy they were."""
    v = [x for x in values if x is not None and not math.isnan(x)]
    if len(v) < 2:
        return 0.0
    m = statistics.median(v)
    return (max(v) - min(v)) / m if m else math.nan


def ratio(a: float, b: float) -> float:
    if a is None or b is None or math.isnan(a) or math.isnan(b) or b == 0:
        return math.nan
    return a / b
