"""Statistics of the small-scale benchmark: paired differences and spreads over data orders and seeds.

Two arms are compared run by run: runs that share a key (data order, init seed) saw the same
tokens in the same order from the same initial weights, so their difference cancels both
sources of noise that the arms share. Over the ``n`` keys both arms have, the differences
``d_i = a_i - b_i`` give the mean, the 95% interval ``mean +- t_{0.975, n-1} * sd / sqrt(n)``
and the two-sided p-value of the paired t-test (``scipy.stats.ttest_rel``, Student 1908).
For val losses lower is better: the verdict is "better" only where the whole interval is below
zero, "worse" where it is above, else "no measurable difference".
"""
import math

import numpy as np
from scipy import stats

BETTER, WORSE, NMD, TOO_FEW = "better", "worse", "no measurable difference", "too few pairs"


def paired_difference(a, b, level=0.95):
    """Paired difference of two arms' results, ``a - b``, matched by key.

    Args:
        a, b: ``{key: value}`` (e.g. ``(order, seed) -> final val loss``, float). Keys present in
            only one of them, or with a non-finite value in either, are excluded and listed.
        level: confidence level of the interval.

    Returns:
        dict: ``n`` (pairs used), ``keys`` (sorted), ``diffs`` (float64 array ``(n,)``), ``mean``,
        ``std`` (ddof=1), ``ci`` ``(low, high)``, ``p`` (two-sided), ``verdict`` (lower is better;
        ``too few pairs`` below 2 pairs, where ``ci`` and ``p`` are nan), ``excluded``
        ``[(key, why)]``.
    """
    excluded = []
    for key in sorted(set(a) ^ set(b), key=repr):
        excluded.append((key, "only in " + ("the first" if key in a else "the second") + " arm"))
    keys = []
    for key in sorted(set(a) & set(b), key=repr):
        if math.isfinite(a[key]) and math.isfinite(b[key]):
            keys.append(key)
        else:
            excluded.append((key, "non-finite value"))
    x = np.array([a[k] for k in keys], dtype=np.float64)
    y = np.array([b[k] for k in keys], dtype=np.float64)
    d = x - y
    out = dict(n=len(keys), keys=keys, diffs=d, excluded=excluded, mean=float(d.mean()) if len(d) else math.nan,
               std=float(d.std(ddof=1)) if len(d) > 1 else math.nan, ci=(math.nan, math.nan), p=math.nan,
               verdict=TOO_FEW)
    if len(keys) < 2:
        return out
    res = stats.ttest_rel(x, y)
    ci = res.confidence_interval(level)
    out.update(ci=(float(ci.low), float(ci.high)), p=float(res.pvalue), verdict=verdict(ci.low, ci.high))
    return out


def verdict(low, high):
    """"better" if the interval ``[low, high]`` of a loss difference is below 0, "worse" if above, else n.m.d."""
    if high < 0:
        return BETTER
    if low > 0:
        return WORSE
    return NMD


def spread(values):
    """Mean, sample std (ddof=1) and range (max - min) of finite ``values``; nan where undefined."""
    v = np.array([x for x in values if math.isfinite(x)], dtype=np.float64)
    return dict(n=len(v), mean=float(v.mean()) if len(v) else math.nan,
                std=float(v.std(ddof=1)) if len(v) > 1 else math.nan,
                range=float(v.max() - v.min()) if len(v) else math.nan)


def value_at(xs, ys, x):
    """Linear interpolation of the curve ``(xs, ys)`` (xs increasing) at ``x``; None outside ``[xs[0], xs[-1]]``."""
    if not len(xs) or x < xs[0] or x > xs[-1]:
        return None
    return float(np.interp(x, xs, ys))
