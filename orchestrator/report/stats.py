"""Statistics of a comparison over seeds: intervals, paired and unpaired tests, Holm's correction and power.

Pure functions over plain numbers; every distribution and resampling comes from scipy.stats (t and
noncentral t, `ttest_rel`, `ttest_ind`, `permutation_test`, `bootstrap`), so what is written here is only the
choice of test and the bookkeeping around it. The choices, in the words docs/report.md uses:

- a method's score: mean over seeds with a Student-t interval (`mean_interval`), optionally a percentile
  bootstrap interval (`bootstrap_interval`);
- a method against the reference: when both ran the same seeds (one run per seed), the paired difference
  over seeds, its t interval, and the p-value of the paired t-test, or with fewer than `EXACT_BELOW` seeds the
  exact sign-flip permutation test (all 2^n flips): with so few seeds the normality the t-test assumes cannot
  be checked. Different seed sets fall back to Welch's unequal-variance t-test (`compare`);
- many methods against one reference: Holm's step-down correction of the p-values (`holm`);
- power: for the t-test the comparison used, the smallest difference detectable at 80% power with the seeds
  that were run, and the seeds it would take to detect the observed difference (`power_analysis`), both
  from the noncentral t distribution and the observed spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

EXACT_BELOW = 8
"""Paired comparisons with fewer seeds than this get the exact sign-flip test's p-value (2^7 = 128 flips)."""
POWER = 0.8
"""The power the minimum detectable difference and the seeds needed are computed for."""
MAX_SEEDS = 10_000
BOOTSTRAP_RESAMPLES = 9_999
PAIRED_T, SIGN_FLIP, WELCH = "paired t", "exact sign-flip", "Welch (unpaired)"


@dataclass(frozen=True)
class Interval:
    low: float
    high: float

    @classmethod
    def none(cls) -> Interval:
        return cls(math.nan, math.nan)

    def __contains__(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True)
class Comparison:
    """A method against the reference: difference of means (method - reference, in metric units) and its test."""

    test: str
    """PAIRED_T, SIGN_FLIP or WELCH; "" when there are too few runs for any test."""
    n: int
    """Matched seeds (paired), or the smaller of the two run counts (Welch)."""
    diff: float
    ci: Interval
    p_value: float
    mdd: float
    """Minimum detectable difference (absolute, metric units) at `alpha` and POWER with these seeds; inf when
    the exact test cannot reach `alpha` with so few seeds."""
    seeds_needed: float
    """Seeds per method for POWER to detect |diff|; inf when diff is 0, nan when unknown."""
    note: str = ""


def mean_interval(values: Sequence[float], level: float) -> Interval:
    """Student-t interval of the mean over seeds; NaN with fewer than two finite values."""
    x = np.asarray(values, dtype=float)
    if len(x) < 2 or not np.all(np.isfinite(x)):
        return Interval.none()
    mean, sem = float(np.mean(x)), float(stats.sem(x))
    if sem == 0.0:
        return Interval(mean, mean)
    low, high = stats.t.interval(level, df=len(x) - 1, loc=mean, scale=sem)
    return Interval(float(low), float(high))


def bootstrap_interval(samples: Sequence[Sequence[float]], statistic: Callable[..., np.ndarray], level: float, *,
                       paired: bool, seed: int = 0) -> Interval:
    """Percentile bootstrap interval of `statistic(*samples, axis=...)` (vectorised), resampling seeds: jointly
    when `paired` (seed s of every sample together), else each sample on its own. Percentile rather than BCa:
    BCa's acceleration is undefined for the two or three seeds a study often has."""
    arrays = [np.asarray(sample, dtype=float) for sample in samples]
    if any(len(a) < 2 or not np.all(np.isfinite(a)) for a in arrays):
        return Interval.none()
    if all(np.all(a == a[0]) for a in arrays):  # no spread: every resample gives the same value
        value = float(statistic(*[a[None, :] for a in arrays], axis=-1)[0])
        return Interval(value, value)
    result = stats.bootstrap(arrays, statistic, paired=paired, vectorized=True, confidence_level=level,
                             n_resamples=BOOTSTRAP_RESAMPLES, method="percentile", rng=np.random.default_rng(seed))
    return Interval(float(result.confidence_interval.low), float(result.confidence_interval.high))


def mean_of(*samples: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(samples[0], axis=axis)


def _mean_difference(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(x, axis=axis) - np.mean(y, axis=axis)


def compare(method: Mapping[str, float], reference: Mapping[str, float], level: float) -> Comparison:
    """Method against reference, each given as seed -> score. Paired over seeds when the seed sets are equal
    (and known: a None seed is not a seed), else Welch. Too few runs give a Comparison with test "" and NaNs."""
    alpha = 1.0 - level
    paired = set(method) == set(reference) and None not in method and len(method) >= 2
    if paired:
        seeds = sorted(method, key=str)
        x = np.array([method[s] for s in seeds], dtype=float)
        y = np.array([reference[s] for s in seeds], dtype=float)
        if np.all(x - y == 0.0):
            return Comparison(PAIRED_T, len(x), 0.0, Interval(0.0, 0.0), 1.0, math.nan, math.inf,
                              note="identical scores on every seed")
        if np.ptp(x - y) == 0.0:  # the same difference on every seed: no spread, the t statistic is infinite
            ci, p_value = Interval(float(x[0] - y[0]), float(x[0] - y[0])), 0.0
        else:  # two-sided; scipy's interval is for mean(x - y)
            result = stats.ttest_rel(x, y)
            ci, p_value = result.confidence_interval(level), float(result.pvalue)
        test, note = PAIRED_T, ""
        if len(x) < EXACT_BELOW:
            exact = stats.permutation_test((x, y), _mean_difference, permutation_type="samples",
                                           n_resamples=np.inf, vectorized=True)
            p_value, test = float(exact.pvalue), SIGN_FLIP
            smallest = 2.0 / 2 ** len(x)
            if smallest >= alpha:
                note = f"{len(x)} seeds: smallest possible p = {smallest:.3g}"
        sd = float(np.std(x - y, ddof=1))
        mdd, needed = power_analysis(float(np.mean(x - y)), [sd], len(x), alpha)
        if test == SIGN_FLIP and 2.0 / 2 ** len(x) >= alpha:
            mdd = math.inf  # no difference, however large, can reach alpha with these seeds
        if needed < EXACT_BELOW:  # that many seeds would be judged by the exact test: it needs 2 / 2^n < alpha
            needed = max(needed, float(math.floor(math.log2(2.0 / alpha)) + 1))
        return Comparison(test, len(x), float(np.mean(x - y)), Interval(float(ci.low), float(ci.high)),
                          p_value, mdd, needed, note)
    x = np.array(list(method.values()), dtype=float)
    y = np.array(list(reference.values()), dtype=float)
    diff = float(np.mean(x) - np.mean(y)) if len(x) and len(y) else math.nan
    if len(x) < 2 or len(y) < 2:
        return Comparison("", min(len(x), len(y)), diff, Interval.none(), math.nan, math.nan, math.nan,
                          note="needs two runs of each method")
    result = stats.ttest_ind(x, y, equal_var=False)
    ci = result.confidence_interval(level)
    sds = [float(np.std(x, ddof=1)), float(np.std(y, ddof=1))]
    mdd, needed = power_analysis(diff, sds, min(len(x), len(y)), alpha, unequal=(len(x), len(y)))
    return Comparison(WELCH, min(len(x), len(y)), diff, Interval(float(ci.low), float(ci.high)),
                      float(result.pvalue) if np.isfinite(result.pvalue) else 1.0, mdd, needed,
                      note="seed sets differ")


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values (NaN stays NaN and does not count as a comparison): the k-th smallest
    of m p-values is multiplied by m - k + 1, then made monotone, capped at 1."""
    finite = [(p, i) for i, p in enumerate(p_values) if not math.isnan(p)]
    m = len(finite)
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, i) in enumerate(sorted(finite)):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


def _power(noncentrality: float, df: float, alpha: float) -> float:
    """Two-sided t-test power: P(|T| > t_crit) for T noncentral t with `df` and `noncentrality`."""
    critical = stats.t.ppf(1.0 - alpha / 2.0, df)
    # The far tail P(T < -critical) = P(T' > critical) for T' with -noncentrality: scipy's nct.cdf returns NaN
    # out there for some (df, noncentrality), its sf does not.
    return float(stats.nct.sf(critical, df, noncentrality) + stats.nct.sf(critical, df, -noncentrality))


def _standard_error(sds: Sequence[float], n: int, unequal: tuple[int, int] | None) -> tuple[float, float]:
    """(standard error of the difference, degrees of freedom): paired from the sd of differences; unpaired
    (`unequal`: the run counts) Welch-Satterthwaite, or for `n` seeds each when `unequal` is None."""
    if len(sds) == 1:
        return sds[0] / math.sqrt(n), n - 1.0
    n1, n2 = unequal or (n, n)
    v1, v2 = sds[0] ** 2 / n1, sds[1] ** 2 / n2
    if v1 + v2 == 0.0:
        return 0.0, n1 + n2 - 2.0
    df = (v1 + v2) ** 2 / (v1**2 / (n1 - 1) + v2**2 / (n2 - 1)) if v1 * v2 > 0 else max(n1, n2) - 1.0
    return math.sqrt(v1 + v2), df


def power_analysis(diff: float, sds: Sequence[float], n: int, alpha: float,
                   unequal: tuple[int, int] | None = None) -> tuple[float, float]:
    """(minimum detectable difference with the seeds run, seeds per method needed to detect |diff|), both for a
    two-sided t-test at `alpha` with POWER, taking the observed spread as the true one. `sds`: [sd of the
    paired differences], or [sd of the method, sd of the reference] for unpaired runs (`unequal`: run counts)."""
    if not all(math.isfinite(sd) for sd in sds):
        return math.nan, math.nan
    se, df = _standard_error(sds, n, unequal)
    if not math.isfinite(se) or df < 1:
        return math.nan, math.nan
    if se == 0.0:
        return 0.0, (math.inf if diff == 0.0 else 2.0)
    upper = 1.0
    while _power(upper, df, alpha) < POWER:
        upper *= 2.0
    mdd = float(optimize.brentq(lambda nc: _power(nc, df, alpha) - POWER, 0.0, upper)) * se
    if diff == 0.0 or not math.isfinite(diff):
        return mdd, math.inf
    def enough(seeds: int) -> bool:
        se_n, df_n = _standard_error(sds, seeds, None)
        return _power(abs(diff) / se_n, df_n, alpha) >= POWER

    # Power grows with the seeds: double until enough, then bisect for the smallest count.
    low, high = 1, 2
    while not enough(high):
        if high >= MAX_SEEDS:
            return mdd, math.inf
        low, high = high, min(2 * high, MAX_SEEDS)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return mdd, float(high)
