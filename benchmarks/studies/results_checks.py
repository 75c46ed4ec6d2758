"""The intervals and tests benchmarks/RESULTS.md quotes for comparisons whose benchmark printed none (its wording
pass of 2026-12-01), computed from the result files under benchmarks/results/ and, where a benchmark kept no file,
from the per-round values RESULTS.md itself publishes (section 12). Each section prints what one paragraph cites:

    python -m benchmarks.studies.results_checks

Paired per-round ratios are summarised on the log scale (geometric mean, t interval with n - 1 degrees of freedom,
the exact sign-flip test beside the t-test); seed counts are for 80% power of a two-sided t-test (noncentral t).
"""

import math
from pathlib import Path

import numpy as np
import pandas as pd
from scipy import stats

R = str(Path(__file__).resolve().parents[1] / "results") + "/"
C = R + "cpu-2core/"


def floats(cell):
    return np.array([float(v) for v in str(cell).replace(";", " ").split()])


def geo(ratios, goal=None):
    """Geometric mean of paired per-round ratios, 95% t interval on the log scale (df n-1), t p, exact sign-flip p."""
    r = np.log(np.asarray(ratios, float)); n = len(r)
    m, se = r.mean(), r.std(ddof=1) / math.sqrt(n); t = stats.t.ppf(0.975, n - 1)
    flips = stats.permutation_test((r,), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue
    out = dict(n=n, geo=math.exp(m), lo=math.exp(m - t * se), hi=math.exp(m + t * se),
               p=stats.ttest_1samp(r, 0.0).pvalue, signflip=flips)
    if goal is not None:
        out["p_one_sided_vs_goal"] = stats.ttest_1samp(r, math.log(goal), alternative="greater").pvalue
    return r, out


def show(label, d):
    print(label + ": " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items()))


print("== 1. Sign-flip floor: seeds for the exact check to reach alpha 0.05 after Holm over m comparisons")
for m in (1, 2, 3, 4):
    n = next(n for n in range(2, 30) if m * 2 / 2**n < 0.05)
    print(f"   m={m}: {n} seeds (floor m*2/2^n = {m*2/2**n:.4f}; with {n-1}: {m*2/2**(n-1):.4f})")

print("\n== 2. attention_scaling: cells with 0 timed calls (harness.measure reports the cold, profiled first call)")
for f in ("attention_scaling.csv", "attention_scaling_core.csv"):
    d = pd.read_csv(C + f)
    for p in ("fwd", "fwdbwd"):
        s = d[(d[p + "_repeats"] == 0) & (d[p + "_status"] == "ok")]
        for _, r in s.iterrows():
            print(f"   {f} {p} {r['variant']} n={r['n']}: {r[p+'_median_s']:.4g} s, repeats 0")
full = pd.read_csv(C + "attention_scaling.csv")
lin = full[(full.variant.str.startswith("linformer k=")) & (full.variant.str.contains("layerwise")) & (full.n == 8192)]
print("   Table-3 cells from mha-math fwd n=8192 (0 repeats):", lin[["variant", "fwd_speedup_vs_mha_math"]].values.tolist())

print("\n== 3. Ours / paper time saved (Linformer Table 3, layerwise), against the 1.3-1.4x run-to-run noise")
paper = {(512, 128): 1.5, (512, 256): 1.3, (1024, 128): 1.7, (1024, 256): 1.6, (2048, 128): 2.6, (2048, 256): 2.4,
         (4096, 128): 3.4, (4096, 256): 3.2, (8192, 128): 5.5, (8192, 256): 5.0, (16384, 128): 8.6, (16384, 256): 7.8}
for (n, k), ps in paper.items():
    ours = full[(full.variant == f"linformer k={k} layerwise") & (full.n == n)].fwd_speedup_vs_mha.iloc[0]
    print(f"   n={n} k={k}: ours {ours:.3g} / paper {ps} = {ours/ps:.3f}")

print("\n== 4. SST-2: seeds for 80% power at a planning level alpha/m (m = 4), against the row-level alpha*p/p_Holm")


def holm(ps):
    order = np.argsort(ps); m = len(ps); out = np.empty(m); run = 0
    for k, i in enumerate(order):
        run = max(run, min(1, (m - k) * ps[i])); out[i] = run
    return out


def needed(d, sd, alpha):
    for n in range(2, 100000):
        se = sd / math.sqrt(n); c = stats.t.ppf(1 - alpha / 2, n - 1); nc = abs(d) / se
        if stats.nct.sf(c, n - 1, nc) + stats.nct.cdf(-c, n - 1, nc) >= 0.8:
            return n


sds = {}
for study, col in (("sst2-downstream", "dev_acc_last"), ("sst2-downstream", "test_acc"),
                   ("sst2-scratch", "dev_acc_last"), ("sst2-scratch", "test_acc")):
    runs = pd.read_csv(R + study + "/runs.csv"); runs["kind"] = runs["method"].str.split().str[0]
    by = {k: dict(zip(g["seed"], g[col])) for k, g in runs.groupby("kind")}; ref = by.pop("mha")
    rows = []
    for k, s in sorted(by.items()):
        seeds = sorted(set(s) & set(ref)); x = np.array([s[i] for i in seeds]); y = np.array([ref[i] for i in seeds])
        rows.append((k, (x - y).mean(), (x - y).std(ddof=1), stats.ttest_rel(x, y).pvalue, len(seeds)))
    ph = holm(np.array([r[3] for r in rows]))
    for (k, d, sd, p, n), q in zip(rows, ph):
        a_row = 0.05 * p / q
        sds[(study, col, k)] = (d, sd, n)
        print(f"   {study} {col} {k}: p {p:.3g} Holm {q:.3g}; row level {a_row:.4f} -> {needed(d, sd, a_row)} seeds;"
              f" alpha/4 = 0.0125 -> {needed(d, sd, 0.0125)} seeds")

print("\n== 5. '3 and 4 seeds would settle': the same calculation at sigma's upper confidence bounds (1 df from 2 seeds)")
for key in (("sst2-scratch", "test_acc", "linformer"), ("sst2-scratch", "dev_acc_last", "mhe")):
    d, sd, n = sds[key]
    for q in (0.5, 0.2, 0.1):
        s = sd * math.sqrt((n - 1) / stats.chi2.ppf(q, n - 1))
        print(f"   {key}: sigma at its {100*(1-q):.0f}% upper bound ({s/sd:.2f} x observed): {needed(d, s, 0.0125)} seeds"
              f" at alpha/4")
    print(f"   {key}: observed sd: {needed(d, sd, 0.0125)} seeds at alpha/4")

print("\n== 6. Long-range cost intervals (report.csv; raw-scale per-method t intervals, unpaired)")
for e, cols in (("mqar", ("tokens_per_s", "peak_memory_gb")), ("listops", ("tokens_per_s", "peak_memory_gb")),
                ("bytes", ("tokens_per_s", "peak_memory_gb"))):
    d = pd.read_csv(R + f"long-range/{e}/report.csv")
    for c in cols:
        print(f"   {e} {c}: " + "; ".join(f"{r.method} {r[c]:.4g} [{r[c+'_ci_low']:.4g}, {r[c+'_ci_high']:.4g}]"
                                          for _, r in d.iterrows()))
print("   mqar-zoology answers/s from RESULTS.md's table: 363 / 128 = %.2f, 363 / 146 = %.2f" % (363 / 128, 363 / 146))

print("\n== 7. Bytes LSH (bytes/statistics-rereported.csv) and the t-test's seeds at alpha/3")
b = pd.read_csv(R + "long-range/bytes/statistics-rereported.csv"); print(b.to_string())
old = pd.read_csv(R + "long-range/bytes/report.csv"); o = old[old.method.str.startswith("lsh")].iloc[0]
se = (o.diff_ci_high - o.diff_ci_low) / 2 / stats.t.ppf(0.975, 2); sd = se * math.sqrt(3)
print(f"   lsh: diff {o['diff']:.4f}, sd of per-seed differences {sd:.4f}; t-test seeds at alpha/3: {needed(o['diff'], sd, 0.05/3)}")

print("\n== 8. Patching: 1 vs 4 hashes at l = 4 (report.csv unadjusted 95% t intervals, n = 3), speed-up CIs")
p = pd.read_csv(R + "patching/cpu/report.csv").set_index("method")
t2 = stats.t.ppf(0.975, 2)
r1, r4 = p.loc["lsh n_hashes=1 l=4"], p.loc["lsh n_hashes=4 l=4"]
se1 = (r1.diff_ci_high - r1.diff_ci_low) / 2 / t2; se4 = (r4.diff_ci_high - r4.diff_ci_low) / 2 / t2
se = math.hypot(se1, se4); df = se**4 / (se1**4 / 2 + se4**4 / 2); tt = (r1["diff"] - r4["diff"]) / se
print(f"   Welch: diff {r1['diff']-r4['diff']:.3f}, t {tt:.2f}, df {df:.2f}, p {2*stats.t.sf(tt, df):.3g};"
      f" Holm intervals [{r1.diff_ci_holm_low:.2f}, {r1.diff_ci_holm_high:.2f}] and [{r4.diff_ci_holm_low:.2f}, {r4.diff_ci_holm_high:.2f}]")
for m in p.index:
    print(f"   {m}: speed-up {p.loc[m].speedup_mean:.3f} [{p.loc[m].speedup_ci_low:.3f}, {p.loc[m].speedup_ci_high:.3f}]")
print(f"   hyper l=1 divided by the l=0 order bias: {p.loc['hyper l=1'].speedup_mean / p.loc['unpatched (l=0)'].speedup_mean:.3f}")

print("\n== 9. Causal leak (causal_leak.csv): z, p if the 2048 cuts were independent, and under intra-window correlation")
cl = pd.read_csv(C + "causal_leak.csv")
for _, r in cl[cl.scored_routing == "paper"].iterrows():
    m, s = r.loss_gain_from_future, r.loss_gain_stderr
    print(f"   {r.kind}: gain {m:.5f} se {s:.6f} z {m/s:.2f} p {2*stats.norm.sf(m/s):.3f}")
    for icc in (0.05, 0.1, 0.2):
        deff = 1 + 7 * icc; zz = m / (s * math.sqrt(deff))
        print(f"      icc {icc}: design effect {deff:.2f}, z {zz:.2f}, p {2*stats.norm.sf(zz):.3f}")

print("\n== 10. Throughput: paired ours/BERT in the two runs (throughput.csv, throughput_masked_head.csv)")
t1 = pd.read_csv(C + "throughput.csv").set_index("name"); t2_ = pd.read_csv(C + "throughput_masked_head.csv").set_index("name")
for n in ("small", "base6"):
    a, b_ = t1.loc[n].ours_over_bert_paired_median, t2_.loc[n].ours_over_bert_paired_median
    print(f"   {n}: {a:.4f} then {b_:.4f}: change {100*(max(a,b_)/min(a,b_)-1):.1f}%")

print("\n== 11. Ray overhead")
ro = pd.read_csv(C + "ray_overhead.csv").set_index("measurement")
print(f"   first run steady ratio {ro.loc['steady_tokens_per_s'].ray_over_plain:.3f} (one unpaired pair)")
bef = pd.read_csv(C + "ray_overhead_before.csv").set_index("measurement").loc["steady_tokens_per_s"]
aft = pd.read_csv(C + "ray_overhead_after.csv").set_index("measurement").loc["steady_tokens_per_s"]
lb, gb = geo(floats(bef.round_ratios)); show("   before rounds", gb)
la, ga = geo(floats(aft.round_ratios), goal=0.95); show("   after rounds", ga)
w = stats.ttest_ind(la, lb, equal_var=False); print(f"   after vs before, Welch on log ratios: p = {w.pvalue:.3g}")

print("\n== 12. Poll interval (per-round times published only in RESULTS.md's table)")
slow = np.array([54.1, 51.2]); fast = np.array([38.2, 37.6])
r = stats.ttest_rel(slow, fast); ci = r.confidence_interval()
print(f"   paired 2.0 s - 0.2 s: {np.mean(slow-fast):.2f} s [{ci.low:.2f}, {ci.high:.2f}], p {r.pvalue:.4f} (paired t, n = 2)")
_, g = geo(fast / slow); show("   0.2 s / 2.0 s", g)

print("\n== 13. Time to first metric A/B (ray_overhead_cli_ab.csv, 3 alternated rounds)")
ab = pd.read_csv(C + "ray_overhead_cli_ab.csv").set_index("measurement").loc["cli_warm_seconds_to_first_metric"]
this, before = floats(ab.samples), floats(ab.against_samples)
r = stats.ttest_rel(this, before); ci = r.confidence_interval()
print(f"   this - before: {np.mean(this-before):+.3f} s [{ci.low:+.3f}, {ci.high:+.3f}], p {r.pvalue:.3f};"
      f" CI ends / before's median {ci.low/ab.against:+.3f} {ci.high/ab.against:+.3f}")

print("\n== 14. Start-up against bare Ray Train (startup.csv, startup_before.csv)")
su = pd.read_csv(C + "startup.csv").set_index("measurement").loc["startup_seconds_to_first_metric"]
sb = pd.read_csv(C + "startup_before.csv").set_index("measurement").loc["startup_seconds_to_first_metric"]
_, g = geo(floats(su.round_ratios), goal=1.1); show("   per-round ratios", g)
print(f"   ratio of medians {su.ray_over_plain:.4f}; median of round ratios {su.median_round_ratio:.4f}")
gap_a = floats(su.samples) - floats(su.plain_samples); gap_b = floats(sb.samples) - floats(sb.plain_samples)
w = stats.ttest_ind(gap_a, gap_b, equal_var=False); ci = w.confidence_interval()
print(f"   per-round gap: before mean {gap_b.mean():.2f} s (n {len(gap_b)}), after {gap_a.mean():.2f} s (n {len(gap_a)});"
      f" Welch p {w.pvalue:.3g}, after - before [{ci.low:.2f}, {ci.high:.2f}] s;"
      f" differences of medians {sb.ray_minus_plain:.2f} -> {su.ray_minus_plain:.2f} s")

print("\n== 15. Compile (compile_speed.csv: medians only, no per-step samples -> no interval possible)")
cs = pd.read_csv(C + "compile_speed.csv").set_index("kind")
print("   lsh, hyper speed-up:", cs.loc["lsh"].speedup, cs.loc["hyper"].speedup, "columns:", list(cs.columns))

print("\n== 16. Corpus scale (corpus_scale.csv)")
cs = pd.read_csv(C + "corpus_scale.csv").set_index("corpus_mb")
print(f"   200 MB before / after: {cs.loc[200].old_s} / {cs.loc[200].prepare_s} = {cs.loc[200].old_s/cs.loc[200].prepare_s:.4f}")
print(f"   1 GB 2/1 speed-up this run: {cs.loc[1000].speedup_2_over_1:.4f}")

print("\n== 17. Recipes decoding, random weights (decoding_random.csv; 'before' 66.4 s only in RESULTS.md)")
dr = pd.read_csv(C + "decoding_random.csv").set_index("path")
print(f"   full recompute 66.4 / {dr.loc['full_recompute'].median_s:.2f} = {66.4/dr.loc['full_recompute'].median_s:.3f};"
      f" kv cache 7.4 / {dr.loc['kv_cache'].median_s:.2f} = {7.4/dr.loc['kv_cache'].median_s:.3f}; repeats {dr.loc['kv_cache'].repeats}")

print("\n== 18. mqar-zoology PRR (runs.csv, paired on shared seeds): Fieller's interval by hand")
runs = pd.read_csv(R + "long-range/mqar-zoology/runs.csv"); runs["kind"] = runs["method"].str.split().str[0]
by = {k: dict(zip(g["seed"], g["val_acc"])) for k, g in runs.groupby("kind")}; ref = by.pop("mha")
for k, s_ in sorted(by.items()):
    seeds = sorted(set(s_) & set(ref)); x = np.array([s_[i] for i in seeds]); y = np.array([ref[i] for i in seeds])
    n = len(x); t = stats.t.ppf(0.975, n - 1); mx, my = x.mean(), y.mean(); Cv = np.cov(x, y, ddof=1) / n
    a = my**2 - t**2 * Cv[1, 1]; bq = -2 * (mx * my - t**2 * Cv[0, 1]); cq = mx**2 - t**2 * Cv[0, 0]
    ref_t = stats.t.interval(0.95, n - 1, loc=my, scale=stats.sem(y))
    if a <= 0:
        fi = "unbounded (mha's mean interval over these seeds contains 0: %s)" % (tuple(round(v, 3) for v in ref_t),)
    else:
        dq = math.sqrt(bq * bq - 4 * a * cq); fi = "[%.1f%%, %.1f%%]" % (100 * (-bq - dq) / (2 * a), 100 * (-bq + dq) / (2 * a))
    print(f"   {k}: n={n}, seeds {seeds}, R={100*mx/my:.1f}%, Fieller 95% {fi}")
