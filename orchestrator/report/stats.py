"""Statistics of a comparison over seeds: intervals, paired and unpaired tests, Holm's correction and power.

Pure functions over plain numbers; every distribution and resampling comes from scipy.stats (t and
noncentral t, `ttest_rel`, `ttest_ind`, `permutation_test`, `bootstrap`), so what is written here is only the
choice of test and the bookkeeping around it. The choices, in the words docs/report.md uses:

- a method's score: mean over seeds with a Student-t interval (`mean_interval`), optionally a percentile
  bootstrap interval (`bootstrap_interval`);
- a ratio of two methods' seed means (PRR, PEoP): Fieller's interval (`ratio_interval`), paired on the seeds both
  ran, unbounded where the reference's mean is not distinguishable from 0. A percentile bootstrap over 2-5 seeds
  cannot reach past the per-seed ratios and covered the truth 52-82% of the time at a nominal 95%; the delta
  method's R +- t se covers 95% only where the reference's mean is far from 0 (88-89% at 3-5 seeds of one a
  standard deviation from 0, where Fieller's covers 97-98%);
- a method against the reference: paired over the seeds both ran (one run per seed; a method that ran seeds
  0-2 against a reference on 0-4 is paired on 0-2, saying so), the paired t-test and its t interval. The exact
  sign-flip permutation test of the same differences is shown beside it as a distribution-free check, with the
  smallest p it can reach with that many seeds (2 / 2^n: 0.0625 with 5 seeds), and a row says when the two
  disagree at the verdict's level. The verdict is the t-test's, so the interval printed beside it is the one that
  test inverts; where every seed gives the same difference the t statistic is undefined (no spread), and the
  sign-flip test alone decides. Seed sets that share fewer than two seeds fall back to Welch's unequal-variance
  t-test (`compare`);
- many methods against one reference: Holm's step-down correction of the p-values (`holm`);
- power: for the t-test the comparison used, at the level its verdict used (Holm's), the smallest difference
  detectable at 80% power with the seeds that were run, and the seeds it would take to detect the observed
  difference (`power_analysis`, `with_power_at`), both from the noncentral t distribution and the observed spread.
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
PAIRED_T, WELCH, SIGN_FLIP = "paired t", "Welch (unpaired)", "sign-flip"


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
    """PAIRED_T, WELCH, or SIGN_FLIP (every seed's difference the same: no t statistic); "" when there are too few
    runs, or a non-finite score, for any test."""
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
    sds: tuple[float, ...] = ()
    """The spread power is computed from: (sd of the paired differences,) or (sd of the method, of the reference)."""
    runs: tuple[int, int] | None = None
    """Welch only: the two run counts."""

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


def ratio_interval(x: Sequence[float], y: Sequence[float], level: float, *, paired: bool) -> Interval:
    """Fieller's interval of R = mean(x) / mean(y): every R for which x - R y has mean 0 is not rejected by the t-test
    the comparison uses (paired: the differences x_s - R y_s over seeds, n - 1 degrees of freedom; unpaired:
    Welch's, its degrees of freedom at the estimate). Where mean(y) itself is not distinguishable from 0 at `level`
    the set is unbounded, returned as (-inf, inf): no ratio to it is ruled out. The delta method's symmetric
    interval (R +- t se) agrees where mean(y) is many standard errors from 0, and undercovers where it is not.
    NaN with fewer than two finite values on a side."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(a) < 2 or len(b) < 2 or not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))) or np.mean(b) == 0.0:
        return Interval.none()
    mx, my = float(np.mean(a)), float(np.mean(b))
    ratio = mx / my
    if paired:
        cov = np.cov(a, b, ddof=1)
        vxx, vyy, vxy = cov[0, 0] / len(a), cov[1, 1] / len(a), cov[0, 1] / len(a)
        df = len(a) - 1.0
    else:
        vxx, vyy, vxy = float(np.var(a, ddof=1)) / len(a), float(np.var(b, ddof=1)) / len(b), 0.0
        v1, v2 = vxx, ratio**2 * vyy
        df = (v1 + v2) ** 2 / (v1**2 / (len(a) - 1) + v2**2 / (len(b) - 1)) if v1 + v2 > 0 else math.nan
    if vxx - 2 * ratio * vxy + ratio**2 * vyy <= 0.0:  # no spread in x - R y: nothing to be uncertain about
        return Interval(ratio, ratio)
    t2 = float(stats.t.ppf(0.5 + level / 2.0, df)) ** 2
    # (mx - R my)^2 <= t^2 (vxx - 2 R vxy + R^2 vyy): q2 R^2 + q1 R + q0 <= 0
    q2, q1, q0 = my**2 - t2 * vyy, -2.0 * (mx * my - t2 * vxy), mx**2 - t2 * vxx
    if q2 <= 0.0:
        return Interval(-math.inf, math.inf)
    root = math.sqrt(max(q1**2 - 4.0 * q2 * q0, 0.0))  # >= 0: the estimate itself satisfies the inequality
    return Interval((-q1 - root) / (2.0 * q2), (-q1 + root) / (2.0 * q2))


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
    if not np.all(np.isfinite(d)):
        notes.append("a seed's score is not finite (diverged?): no test")
        return Comparison("", n, math.nan, Interval.none(), math.nan, math.nan, math.nan, "; ".join(notes))
    # Differences equal to within float rounding of the scores (0.87 - 0.81 and 0.93 - 0.87 differ in the 16th
    # digit) are equal: their spread is rounding, and a t statistic over it is noise divided by noise.
    rounding = 1e-9 * float(np.max(np.abs(np.concatenate([x, y]))))
    if np.all(np.abs(d) <= rounding):
        notes.append("identical scores on every seed")
        return Comparison(PAIRED_T, n, 0.0, Interval(0.0, 0.0), 1.0, math.nan, math.inf, "; ".join(notes), 0.0,
                          n - 1.0, 1.0, smallest)
    diff, check = float(np.mean(d)), sign_flip_p(d)
    if np.ptp(d) <= rounding:
        # The same difference on every seed (a discrete metric, few seeds): the t statistic is infinite and its
        # interval has no width, which would claim certainty; the sign-flip test's p is still exact.
        notes.append(f"every seed gives the same difference: no spread for a t-test or interval; the exact sign-flip "
                     f"test decides (its smallest possible p with {n} seeds is {smallest:.3g})")
        return Comparison(SIGN_FLIP, n, diff, Interval.none(), check, math.nan, math.nan, "; ".join(notes),
                          check_p=check, check_min_p=smallest)
    sd = float(np.std(d, ddof=1))
    mdd, needed = power_analysis(diff, [sd], n, alpha)
    comparison = Comparison(PAIRED_T, n, diff, Interval.none(), float(stats.ttest_rel(x, y).pvalue), mdd, needed,
                            "; ".join(notes), float(stats.sem(d)), n - 1.0, check, smallest, sds=(sd,))
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
    n = min(len(x), len(y))
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        return Comparison("", n, math.nan, Interval.none(), math.nan, math.nan, math.nan,
                          note="a run's score is not finite (diverged?): no test")
    sds = [float(np.std(x, ddof=1)), float(np.std(y, ddof=1))]
    if sds == [0.0, 0.0] and diff != 0.0:  # every run of each the same score: an infinite t, a zero-width interval
        return Comparison("", n, diff, Interval.none(), math.nan, math.nan, math.nan,
                          note="no spread in either method's scores: no test")
    result = stats.ttest_ind(x, y, equal_var=False)
    se, df = _standard_error(sds, n, (len(x), len(y)))
    mdd, needed = power_analysis(diff, sds, n, alpha, unequal=(len(x), len(y)))
    comparison = Comparison(WELCH, n, diff, Interval.none(), float(result.pvalue) if np.isfinite(result.pvalue)
                            else 1.0, mdd, needed, note="seed sets differ", se=se, df=df, sds=tuple(sds),
                            runs=(len(x), len(y)))
    return replace(comparison, ci=comparison.interval(level))


def with_power_at(comparison: Comparison, alpha: float) -> Comparison:
    """`comparison` with its detectable difference and seeds needed at `alpha` (the Holm-adjusted level its
    verdict used: power at the unadjusted level promised a detectable difference the verdict could not see)."""
    if comparison.test not in (PAIRED_T, WELCH) or not comparison.sds:
        return comparison
    mdd, needed = power_analysis(comparison.diff, comparison.sds, comparison.n, alpha, unequal=comparison.runs)
    return replace(comparison, mdd=mdd, seeds_needed=needed)


def sign_flip_disagrees(comparison: Comparison, alpha: float) -> str:
    """The note a paired row gets when the sign-flip check and the t-test fall on different sides of `alpha` (the
    verdict's Holm-adjusted level); "" when they agree or there is no check."""
    if comparison.test != PAIRED_T or not math.isfinite(comparison.check_p):
        return ""
    if (comparison.p_value < alpha) == (comparison.check_p < alpha):
        return ""
    floor = (f"; its smallest possible p with {comparison.n} seeds is {comparison.check_min_p:.3g}"
             if comparison.check_min_p >= alpha else "")
    return f"the sign-flip check disagrees at the verdict's level ({alpha:.3g}): p = {comparison.check_p:.3g}{floor}"


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
    # Welch-Satterthwaite; where one sample has no spread this is the other's n - 1 (scipy's ttest_ind agrees).
    df = (v1 + v2) ** 2 / (v1**2 / (n1 - 1) + v2**2 / (n2 - 1))
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
