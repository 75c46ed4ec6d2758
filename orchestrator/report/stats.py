"""Statistics of a comparison over seeds: intervals, paired and unpaired tests, Holm's correction and power.

Pure functions over plain numbers; every distribution and resampling comes from scipy.stats (t and
noncentral t, `ttest_rel`, `ttest_ind`, `permutation_test`, `bootstrap`), so what is written here is only the
choice of test and the bookkeeping around it. The choices, in the words docs/report.md uses:

- a method's score: mean over seeds with a Student-t interval (`mean_interval`), optionally a percentile
  bootstrap interval (`bootstrap_interval`);
- a method against the reference: paired over the seeds both ran (one run per seed; a method that ran seeds
  0-2 against a reference on 0-4 is paired on 0-2, saying so), the paired t-test and its t interval. The exact
  sign-flip permutation test of the same differences is shown beside it as a distribution-free check, with the
  smallest p it can reach with that many seeds (2 / 2^n: 0.0625 with 5 seeds), and a row says when the two
  disagree at alpha. The verdict is the t-test's, so the interval printed beside it is the one that test
  inverts. Seed sets that share fewer than two seeds fall back to Welch's unequal-variance t-test (`compare`);
- many methods against one reference: Holm's step-down correction of the p-values (`holm`);
- power: for the t-test the comparison used, the smallest difference detectable at 80% power with the seeds
  that were run, and the seeds it would take to detect the observed difference (`power_analysis`), both
  from the noncentral t distribution and the observed spread.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy import optimize, stats

EXACT_FLIPS_UP_TO = 16
"""The sign-flip check enumerates all 2^n flips up to this many seeds (65,536), and draws 9,999 beyond."""
POWER = 0.8
"""The power the minimum detectable difference and the seeds needed are computed for."""
MAX_SEEDS = 10_000
BOOTSTRAP_RESAMPLES = 9_999
PAIRED_T, WELCH = "paired t", "Welch (unpaired)"


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
    """PAIRED_T or WELCH; "" when there are too few runs for any test."""
    n: int
    """Seeds paired on (shared by both), or the smaller of the two run counts (Welch)."""
    diff: float
    ci: Interval
    """The t interval of `diff` at the comparison's level (uncorrected; `interval` gives any other level)."""
    p_value: float
    mdd: float
    """Minimum detectable difference (absolute, metric units) at `alpha` and POWER with these seeds."""
    seeds_needed: float
    """Seeds per method for POWER to detect |diff|; inf when diff is 0, nan when unknown."""
    note: str = ""
    se: float = math.nan
    """Standard error of `diff` (0 when every seed's difference is the same)."""
    df: float = math.nan
    """Degrees of freedom of the t distribution of the test (n - 1 paired; Welch-Satterthwaite)."""
    check_p: float = math.nan
    """Paired only: the sign-flip test's two-sided p of the same differences (the distribution-free check)."""
    check_min_p: float = math.nan
    """The smallest p the sign-flip test can give with these seeds, 2 / 2^n."""

    def interval(self, level: float) -> Interval:
        """The test's t interval of `diff` at `level` (a Holm-adjusted level for the verdict's interval)."""
        if not (math.isfinite(self.se) and math.isfinite(self.df)):
            return Interval.none()
        if self.se == 0.0:
            return Interval(self.diff, self.diff)
        half = float(stats.t.ppf(0.5 + level / 2.0, self.df)) * self.se
        return Interval(self.diff - half, self.diff + half)


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


def sign_flip_p(differences: np.ndarray, seed: int = 0) -> float:
    """Two-sided p of the paired sign-flip permutation test of mean(differences) = 0: exact over all 2^n flips
    up to EXACT_FLIPS_UP_TO seeds, 9,999 random flips beyond."""
    resamples = np.inf if len(differences) <= EXACT_FLIPS_UP_TO else 9_999
    result = stats.permutation_test((differences,), np.mean, permutation_type="samples", n_resamples=resamples,
                                    vectorized=True, rng=np.random.default_rng(seed))
    return float(result.pvalue)


def _paired(method: Mapping[str, float], reference: Mapping[str, float], seeds: list, level: float) -> Comparison:
    alpha = 1.0 - level
    x = np.array([method[s] for s in seeds], dtype=float)
    y = np.array([reference[s] for s in seeds], dtype=float)
    d, n = x - y, len(seeds)
    smallest = 2.0 / 2**n
    notes = []
    if len(seeds) < max(len(method), len(reference)):
        notes.append(f"paired on the {n} shared seeds (method ran {len(method)}, reference {len(reference)})")
    if np.all(d == 0.0):
        notes.append("identical scores on every seed")
        return Comparison(PAIRED_T, n, 0.0, Interval(0.0, 0.0), 1.0, math.nan, math.inf, "; ".join(notes), 0.0,
                          n - 1.0, 1.0, smallest)
    diff = float(np.mean(d))
    if np.ptp(d) == 0.0:  # the same difference on every seed: no spread, the t statistic is infinite
        se, p_value = 0.0, 0.0
    else:
        se, p_value = float(stats.sem(d)), float(stats.ttest_rel(x, y).pvalue)
    check = sign_flip_p(d)
    if (p_value < alpha) != (check < alpha):
        floor = f"; its smallest possible p with {n} seeds is {smallest:.3g}" if smallest >= alpha else ""
        notes.append(f"the sign-flip check disagrees: p = {check:.3g}{floor}")
    mdd, needed = power_analysis(diff, [float(np.std(d, ddof=1))], n, alpha)
    comparison = Comparison(PAIRED_T, n, diff, Interval.none(), p_value, mdd, needed, "; ".join(notes), se,
                            n - 1.0, check, smallest)
    return replace(comparison, ci=comparison.interval(level))


def compare(method: Mapping[str, float], reference: Mapping[str, float], level: float) -> Comparison:
    """Method against reference, each given as seed -> score. Paired on the seeds both ran (a None seed is not a
    seed) when they share at least two, else Welch. Too few runs give a Comparison with test "" and NaNs."""
    alpha = 1.0 - level
    shared = sorted((set(method) & set(reference)) - {None}, key=str)
    if len(shared) >= 2:
        return _paired(method, reference, shared, level)
    x = np.array(list(method.values()), dtype=float)
    y = np.array(list(reference.values()), dtype=float)
    diff = float(np.mean(x) - np.mean(y)) if len(x) and len(y) else math.nan
    if len(x) < 2 or len(y) < 2:
        return Comparison("", min(len(x), len(y)), diff, Interval.none(), math.nan, math.nan, math.nan,
                          note="needs two runs of each method")
    result = stats.ttest_ind(x, y, equal_var=False)
    sds = [float(np.std(x, ddof=1)), float(np.std(y, ddof=1))]
    se, df = _standard_error(sds, min(len(x), len(y)), (len(x), len(y)))
    mdd, needed = power_analysis(diff, sds, min(len(x), len(y)), alpha, unequal=(len(x), len(y)))
    comparison = Comparison(WELCH, min(len(x), len(y)), diff, Interval.none(),
                            float(result.pvalue) if np.isfinite(result.pvalue) else 1.0, mdd, needed,
                            note="seed sets differ", se=se, df=df)
    return replace(comparison, ci=comparison.interval(level))


def holm_level(alpha: float, p_value: float, p_holm: float) -> float:
    """The confidence level whose t interval excludes 0 exactly when Holm's adjusted p is below `alpha`: the
    interval inverts the test at alpha x p / p_Holm (alpha / m for the smallest p, as Bonferroni). An interval
    printed beside a Holm verdict at the plain level could exclude 0 beside "indistinguishable"."""
    if not (math.isfinite(p_value) and math.isfinite(p_holm)) or p_value <= 0.0 or p_holm <= 0.0:
        return 1.0 - alpha
    return 1.0 - alpha * p_value / p_holm


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
