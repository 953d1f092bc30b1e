"""Statistics for benchmarks on a noisy machine: medians with distribution-free intervals, and
pairs of placements told apart only when two tests agree."""
from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

# Step times of one placement come in rounds (blocks measured in turn with the other placements,
# so every placement sees the machine's drift alike). A median's interval is distribution-free
# (order statistics); two placements are told apart only when a rank-sum test and the bootstrap
# interval of their ratio both say so, which keeps false alarms near 5% even at 15 steps each.
BOOT = 2000
LEVEL = 0.95
MIN_STEPS = 5  # fewer timed steps than this per placement: no pair is called, everything ties
PREDICTED_TIE = 0.02  # predicted within 2% of each other: the simulator calls the pair even


def _pooled(rounds: list[list[float]]) -> np.ndarray:
    return np.asarray([t for r in rounds for t in r], dtype=np.float64)


def _binomial_cdf(k: int, n: int) -> float:
    """P(X <= k) for X ~ Binomial(n, 1/2)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n


def median_ci(rounds: list[list[float]]) -> tuple[float, float, float]:
    """(median, low, high): the median step time of all rounds and its distribution-free interval
    of at least 95% (order statistics: the number of steps below the true median is Binomial(n,
    1/2)), so it is honest however few steps there are; under six it is the whole range."""
    x = np.sort(_pooled(rounds))
    n = len(x)
    # x_(k) lies above the median when at most k steps fall below it, P(X <= k): the largest k with
    # that at most (1 - LEVEL) / 2 gives the interval [x_(k), x_(n-1-k)].
    k = 0
    while k + 1 < n - 1 - k and _binomial_cdf(k + 1, n) <= (1 - LEVEL) / 2:
        k += 1
    return float(np.median(x)), float(x[k]), float(x[n - 1 - k])


def _rank_sum_p(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sided p-value of the Mann-Whitney U test (normal approximation with tie correction and
    continuity correction): does one placement's step time tend to be lower than the other's?"""
    n1, n2 = len(a), len(b)
    both = np.concatenate([a, b])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    ranks[order] = np.arange(1, len(both) + 1)
    _, inverse, counts = np.unique(both, return_inverse=True, return_counts=True)
    sums = np.zeros(len(counts))
    np.add.at(sums, inverse, ranks)
    ranks = (sums / counts)[inverse]  # ties share their mean rank
    u = ranks[:n1].sum() - n1 * (n1 + 1) / 2
    n = n1 + n2
    var = n1 * n2 / 12 * ((n + 1) - float((counts ** 3 - counts).sum()) / (n * (n - 1)))
    if var <= 0:
        return 1.0  # every step took the same time
    z = max(abs(u - n1 * n2 / 2) - 0.5, 0.0) / math.sqrt(var)
    return math.erfc(z / math.sqrt(2))


def compare(a: list[list[float]], b: list[list[float]], seed: int = 0) -> dict[str, Any]:
    """The ratio of median step times a/b, its 95% bootstrap interval, and the rank-sum test's
    p-value. `faster`: "a" or "b" only when the test rejects equal speed at 5% *and* the interval
    leaves out 1, with at least MIN_STEPS steps each; otherwise None, a tie: this many steps cannot
    tell them apart. (Either rule alone is too eager with few steps: a bootstrap of 15 steps calls
    about 8% of equal pairs different.)"""
    xa, xb = _pooled(a), _pooled(b)
    rng = np.random.default_rng(seed)
    ratio = float(np.median(xa) / np.median(xb))
    boot = (np.median(xa[rng.integers(0, len(xa), (BOOT, len(xa)))], axis=1)
            / np.median(xb[rng.integers(0, len(xb), (BOOT, len(xb)))], axis=1))
    q = (1 - LEVEL) / 2
    lo, hi = float(np.quantile(boot, q)), float(np.quantile(boot, 1 - q))
    p = _rank_sum_p(xa, xb)
    faster = None
    if min(len(xa), len(xb)) >= MIN_STEPS and p < 1 - LEVEL:
        faster = "a" if hi < 1 else ("b" if lo > 1 else None)
    return {"ratio": ratio, "low": lo, "high": hi, "p": p, "faster": faster}


def ranking(predicted: dict[str, float], measured: dict[str, list[list[float]]],
            same_placement: Callable[[str, str], bool] = lambda _a, _b: False) -> dict[str, Any]:
    """Does the simulator order the placements as the measurements do? Every pair is compared:
    - "same" / "reversed": the measurements separate the pair (see `compare`), in the predicted
      order or against it;
    - "tie": the measurements cannot separate the pair, which agrees with either prediction,
      because there is no order to get wrong;
    - "predicted tie": the simulator puts the pair within 2% but the measurements separate them:
      a miss of resolution, reported but not a reversal;
    - "same placement": two placers chose the same assignment, so there is nothing to rank.
    `same_ranking` holds when no pair is reversed."""
    names = sorted(predicted, key=lambda k: predicted[k])
    pairs = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:  # a is predicted no slower than b
            c = compare(measured[a], measured[b])
            pr = predicted[a] / predicted[b]
            if same_placement(a, b):
                verdict = "same placement"
            elif c["faster"] is None:
                verdict = "tie"
            elif pr > 1 - PREDICTED_TIE:
                verdict = "predicted tie"
            else:
                verdict = "same" if c["faster"] == "a" else "reversed"
            pairs.append({"predicted_faster": a, "other": b, "predicted_ratio": pr,
                          "measured_ratio": c["ratio"], "measured_low": c["low"], "measured_high": c["high"],
                          "p": c["p"], "verdict": verdict})
    med = {k: float(np.median(_pooled(v))) for k, v in measured.items()}
    return {"ranking_predicted": names, "ranking_measured": sorted(med, key=lambda k: med[k]),
            "pairs": pairs, "same_ranking": all(p["verdict"] != "reversed" for p in pairs),
            "strict_same_order": names == sorted(med, key=lambda k: med[k])}


__all__ = ["compare", "median_ci", "ranking"]
