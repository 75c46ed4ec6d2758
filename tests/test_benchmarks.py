"""Smoke runs of every benchmark's code path at minimal sizes: the CSV has the expected rows and columns,
failures and budget stops are recorded rather than dropped, and ratios are positive finite numbers.

The Ray half of benchmarks/system/ray_overhead.py needs a Ray start-up (tens of seconds), so here it is its
plain run (the training core via train_locally) and its reading of metric windows;
`python -m benchmarks.system.ray_overhead --quick` runs the rest. The BERT side of benchmarks/system/throughput.py needs
the bench extra (transformers) and is skipped without it; our two models' core training steps run regardless.
"""

from __future__ import annotations

import math
import sys
import time

import pytest
import torch

import yaml

from benchmarks import harness
from benchmarks.methods import attention_scaling, decoding, patched_decoding
from benchmarks.studies import mqar_curve
from benchmarks.system import corpus_scale, host_reads, ray_overhead, ray_startup, throughput
from models.attention import ATTENTION_KINDS
from orchestrator.spec import load_spec, validate_spec

CPU = torch.device("cpu")


def _floats(rows, column):
    return [float(row[column]) for row in rows]


def test_measure_reports_peak_memory_and_errors():
    def allocate() -> None:
        buffer = torch.ones(1024, 1024)  # 4 MiB held until the call returns
        buffer.add_(1)

    # The first call also starts the profiler (seconds on a loaded machine); a 10 s budget then left room for
    # only one timed repeat.
    ok = harness.measure(allocate, CPU, repeats=2, call_budget_s=60)
    assert ok.status == "ok" and ok.repeats == 2 and ok.median_s > 0
    assert ok.peak_bytes >= 4 * 2**20

    def fail() -> None:
        raise RuntimeError("out of memory, tried to allocate")

    failed = harness.measure(fail, CPU)
    assert failed.status.startswith("error: RuntimeError") and "," not in failed.status
    assert math.isnan(failed.median_s)


def test_attention_scaling_csv_covers_every_kind(tmp_path):
    argv = ["--out", str(tmp_path), "--min-n", "32", "--max-n", "32", "--d-model", "32", "--heads", "4",
            "--linformer-k", "8", "--lsh-bucket", "8", "--repeats", "1", "--timing-budget-s", "0.05"]
    rows = attention_scaling.main(argv)
    folder = tmp_path / harness.machine_label(CPU)
    written = harness.read_csv(folder / "attention_scaling.csv")
    assert (folder / "attention_scaling.png").stat().st_size > 0
    assert len(written) == len(rows)

    settings = attention_scaling.settings_from_args(attention_scaling.parse_args(argv), CPU)
    labels = [v.label for v in attention_scaling.variants(settings)]
    assert {v.kind for v in attention_scaling.variants(settings)} == set(ATTENTION_KINDS)
    assert {(r["variant"], int(r["n"])) for r in written} == {(label, 32) for label in labels}
    for column in ("fwd_median_s", "fwdbwd_median_s", "fwd_peak_mb", "fwdbwd_peak_mb", "fwd_speedup_vs_mha",
                   "fwdbwd_speedup_vs_mha", "fwd_mem_ratio_vs_mha", "fwdbwd_mem_ratio_vs_mha",
                   "fwd_speedup_vs_mha_math"):
        assert column in written[0]
    ok = [r for r in written if r["fwd_status"] == "ok" and r["fwdbwd_status"] == "ok"]
    assert len(ok) == len(written), [r["fwd_status"] for r in written if r not in ok]
    for column in ("fwd_speedup_vs_mha", "fwdbwd_speedup_vs_mha", "fwd_mem_ratio_vs_mha", "fwdbwd_mem_ratio_vs_mha"):
        values = _floats(ok, column)
        assert all(math.isfinite(v) and v > 0 for v in values), column
    assert all(float(r["fwd_speedup_vs_mha"]) == 1.0 for r in ok if r["variant"] == "mha")
    assert "| 32 |" in attention_scaling.paper_comparison(rows, [8], "mha")


def test_attention_scaling_records_budget_stops(tmp_path):
    argv = ["--out", str(tmp_path), "--min-n", "32", "--max-n", "64", "--d-model", "16", "--heads", "2",
            "--kinds", "mha", "--call-budget-s", "0", "--max-materialised-gb", "0"]
    rows = attention_scaling.main(argv)
    by_key = {(r["variant"], r["n"]): r for r in rows}
    assert by_key[("mha", 32)]["fwd_status"] == "over_budget"
    assert by_key[("mha", 64)]["fwd_status"] == "skipped: over_budget at n=32"
    assert by_key[("mha-math", 32)]["fwd_status"].startswith("skipped: about")
    assert math.isnan(by_key[("mha", 64)]["fwd_speedup_vs_mha"])


def test_attention_scaling_pairs_the_two_linformer_orders(tmp_path):
    argv = ["--out", str(tmp_path), "--linformer-paths", "--min-n", "32", "--max-n", "32", "--d-model", "32",
            "--heads", "4", "--linformer-k", "8", "--repeats", "2", "--timing-budget-s", "0.05"]
    rows = attention_scaling.main(argv)
    assert {r["sharing"] for r in rows} == {"headwise", "kv", "layerwise"}
    written = harness.read_csv(tmp_path / harness.machine_label(CPU) / "attention_scaling_paths.csv")
    assert len(written) == 3
    for row in written:
        for column in ("fwd_paired_speedup", "fwdbwd_paired_speedup", "fwd_project_first_s", "fwd_compress_first_s"):
            value = float(row[column])
            assert math.isfinite(value) and value > 0, column


def test_decoding_benchmark_compares_cache_with_recompute(tmp_path):
    spec = {
        "name": "decoding-test",
        "task": {"kind": "translation", "vocab_size": 120, "max_tokens": 400, "max_source_len": 24, "beam_size": 2,
                 "builtin": {"train_sentences": 300, "eval_sentences": 8, "lexicon_size": 8}},
        "model": {"d_model": 16, "layers": 1, "decoder_layers": 1, "ffn": 32, "max_seq_len": 64,
                  "attention": {"kind": "mha", "heads": 2}},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    threads = torch.get_num_threads()
    try:
        decoding.main([str(path), "--out", str(tmp_path), "--sentences", "4", "--repeats", "1",
                       "--cache-dir", str(tmp_path / "cache")])
    finally:
        torch.set_num_threads(threads)
    rows = harness.read_csv(tmp_path / harness.machine_label(CPU) / "decoding_random.csv")
    assert [r["path"] for r in rows] == ["full_recompute", "kv_cache"]
    for row in rows:
        assert int(row["sentences"]) == 4 and int(row["same_hypotheses"]) == 4  # the cache changes nothing
        assert math.isfinite(float(row["speedup_vs_full"])) and float(row["median_s"]) > 0


def test_patched_decoding_times_cached_against_uncached_generation(tmp_path):
    pytest.importorskip("transformers", reason="the bench extra (transformers) is not installed")
    threads = torch.get_num_threads()
    try:
        patched_decoding.main(["--out", str(tmp_path), "--contexts", "24", "--new", "3", "--repeats", "1",
                               "--hidden", "32"])
    finally:
        torch.set_num_threads(threads)
    rows = harness.read_csv(tmp_path / harness.machine_label(CPU) / "patched_decoding.csv")
    assert [(r["patch"], r["path"]) for r in rows] == [(p, path) for p in patched_decoding.PATCHES
                                                       for path in ("uncached", "cached")]
    for row in rows:
        assert row["same_tokens"] == "True"  # the cache changes no token
        assert math.isfinite(float(row["speedup_vs_uncached"])) and float(row["tokens_per_s"]) > 0


def test_throughput_compares_same_size_models(tmp_path):
    pytest.importorskip("transformers", reason="the bench extra (transformers) is not installed")
    size = throughput.Size("test", d_model=32, layers=1, heads=2, ffn=64, vocab=100, seq_len=16, batch=2)
    rows = throughput.run([size], warmup=1, repeats=2, device=CPU)
    path = harness.write_csv(rows, tmp_path / "throughput.csv")
    (row,) = harness.read_csv(path)
    for column in ("ours_tokens_per_s", "bert_tokens_per_s", "ours_over_bert_tokens_per_s", "ours_peak_mb"):
        value = float(row[column])
        assert math.isfinite(value) and value > 0, column
    # Same architecture numbers: parameter counts within a few percent (BERT adds its head transform).
    assert abs(int(row["ours_params"]) / int(row["bert_params"]) - 1) < 0.15


def test_throughput_steps_train_through_the_core():
    """Without transformers: our two models start from the same weights, and their step closures run the
    core's train_step, which updates the weights and frees the gradients at the end of the step."""
    size = throughput.Size("test", d_model=16, layers=1, heads=2, ffn=32, vocab=50, seq_len=8, batch=2)
    steps = throughput.steps_for(size, ("ours", "ours_masked"))
    ours, masked = steps["ours"][0], steps["ours_masked"][0]
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), masked.parameters()))
    for name, (model, step) in steps.items():
        before = [p.detach().clone() for p in model.parameters()]
        step()
        step()
        assert all(p.grad is None for p in model.parameters()), name
        moved = sum(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert moved > len(before) // 2, name


def test_ray_overhead_plain_run_windows(tmp_path):
    scale = ray_overhead.Scale(d_model=16, layers=1, heads=2, ffn=32, seq_len=16, batch_size=4, vocab_size=60,
                               train_sentences=120, max_steps=6, log_every=2, cpus=1)
    spec = validate_spec(ray_overhead.bench_spec("bench-test", scale, tmp_path / "runs", "sqlite:///unused.db"))
    threads = torch.get_num_threads()
    result = ray_overhead.plain_run(spec, tmp_path / "cache")
    assert torch.get_num_threads() == threads  # the run's thread count is not left behind
    assert [step for step, _ in result.windows] == [2, 4, 6]
    assert all(math.isfinite(v) and v > 0 for _, v in result.windows)
    assert math.isfinite(result.first_window_s) and result.first_window_s > 0  # a time: no bound a machine could miss
    assert ray_overhead.steady(result.windows, scale.max_steps) > 0
    assert not (tmp_path / "runs").exists()  # no Ray storage and no checkpoints: the core alone


@pytest.mark.parametrize("title, actor", [
    ("ray::TrainController.__init__", "TrainController"),
    ("ray::_AutoscalingCoordinatorActor.request_resources", "_AutoscalingCoordinatorActor"),
    ("ray::RayTrainWorker", "RayTrainWorker"),
    ("ray::IDLE", "IDLE"),  # measure_cli skips it
    ("ray::execute._set_torch_distributed_env_vars", None),  # a task, not an actor's process
    ("/usr/bin/python -m orchestrator train spec.yaml", None),
], ids=["init", "private-actor", "actor", "idle", "task", "not-ray"])
def test_ray_overhead_names_each_actor_by_its_process_title(title, actor):
    match = ray_startup.RAY_PROCESS.match(title)
    assert (match.group(1) if match else None) == actor


def test_corpus_scale_builds_corpora_by_repetition_and_measures_a_process_tree(tmp_path, monkeypatch):
    (tmp_path / "wiki").mkdir()
    (tmp_path / "wiki" / "valid.txt").write_text("a b c\n\n d e\n" * 3000)
    (tmp_path / "wiki" / "test.txt").write_text("f g\n" * 2000)
    monkeypatch.setattr(corpus_scale, "WIKITEXT", tmp_path / "wiki")
    corpus = corpus_scale.make_corpus(tmp_path, 1).read_text()
    block = (tmp_path / "wiki" / "valid.txt").read_text() + (tmp_path / "wiki" / "test.txt").read_text()
    assert 2**20 - len("d e\n") < len(corpus) <= 2**20 and corpus.endswith("\n")
    whole = len(corpus) // len(block)
    assert corpus.startswith(block * whole) and block.startswith(corpus[len(block) * whole:])
    # a child that holds 80 MB: the tree's peak counts it, the parent alone does not
    child = "import time, subprocess, sys; subprocess.run([sys.executable, '-c', 'x = bytearray(80 << 20); import time; time.sleep(1.5)'])"
    measured = corpus_scale.measured([sys.executable, "-c", child], tmp_path)
    assert measured["peak_rss_mb"] - measured["main_rss_mb"] > 80 and measured["peak_pss_mb"] > 80
    assert measured["seconds"] >= 1.5 and measured["cpu_s"] > 0


def test_mqar_curve_rows_are_the_evaluations_of_the_trained_model(tmp_path):
    """One row per evaluation step, in order, with the validation metrics the trainer computed (the last equals a
    fresh evaluation of the final weights) and the training window's throughput; the CSV holds every row so far
    after each evaluation, so a probe cut off by a time limit keeps its curve."""
    spec = load_spec(mqar_curve.STUDY, [
        "model.attention={kind: mha, heads: 2}", "model.d_model=16", "model.ffn=32", "model.max_seq_len=32",
        "task.seq_len=32", "task.num_kv_pairs=4", "task.train_examples=64", "task.eval_examples=16",
        "task.eval_batches=2", "optim.max_steps=4", "optim.warmup_steps=1", "run.eval_every=2",
        "run.log_every=2", "run.checkpoint_every=4", "run.cpus_per_worker=1"], scale="cpu")
    path = tmp_path / "curve.csv"
    curve, trainer = mqar_curve.run(spec, path, tmp_path / "cache")
    assert [row["step"] for row in curve.rows] == [2, 4]
    assert curve.rows[0]["elapsed_s"] <= curve.rows[1]["elapsed_s"]
    final = trainer.task.evaluate(trainer.model)
    assert curve.rows[-1]["val_acc"] == pytest.approx(final["val/acc"])
    assert curve.rows[-1]["val_loss"] == pytest.approx(final["val/loss"], rel=1e-5)
    assert all(math.isfinite(row["train_loss"]) and row["answers_per_s"] > 0 for row in curve.rows)
    written = harness.read_csv(path)
    assert [int(r["step"]) for r in written] == [2, 4]
    assert _floats(written, "val_loss") == pytest.approx([row["val_loss"] for row in curve.rows], rel=1e-5)

    partial = mqar_curve.Curve(tmp_path / "partial.csv")
    partial({"train/loss": 7.0}, 1)  # a training window without an evaluation makes no row
    partial({"train/loss": 6.5, "train/tokens_per_s": 40.0, "val/loss": 6.0, "val/acc": 0.25}, 2)
    assert [(r["step"], r["train_loss"], r["val_acc"]) for r in harness.read_csv(tmp_path / "partial.csv")] == [
        ("2", "6.5", "0.25")]


def test_mqar_curve_reads_every_trials_curve_from_a_sweep_store_and_finds_each_phase_change(tmp_path):
    """Per finished trial (kind, seed) the logged val/acc by step, the parent run and an unfinished trial left
    out, and the first step at or above the threshold: a seed that jumps at step 200 is not averaged with one
    that never does."""
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    from orchestrator.report.metrics import ReportError
    from orchestrator.tracking.describe import PARENT_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("recall", artifact_location=(tmp_path / "artifacts").as_uri())
    parent = client.create_run(experiment, run_name="sweep").info.run_id  # no attention kind
    client.log_metric(parent, "val/acc", 0.99, step=300)  # a parent may carry its best trial's score
    client.set_terminated(parent, "FINISHED")
    curves = {("mha", 0): [0.25, 0.97, 0.99], ("mha", 1): [0.24, 0.30, 0.9], ("sha", 0): [0.2, 0.26, 0.27]}
    stopped = {("mha", 4): [0.24]}  # a trial stopped after its first evaluation (KILLED)
    for (kind, seed), values in {**curves, **stopped}.items():
        run_id = client.create_run(experiment, tags={PARENT_TAG: parent}).info.run_id
        client.log_batch(run_id, params=[Param("model.attention.kind", kind), Param("optim.seed", str(seed))],
                         metrics=[Metric("val/acc", v, 1000 + step, step) for step, v in zip((100, 200, 300), values)])
        client.set_terminated(run_id, "KILLED" if (kind, seed) in stopped else "FINISHED")
    rows = mqar_curve.store_curves(uri, "recall")
    assert [(r["kind"], r["seed"], r["step"]) for r in rows] == [
        (kind, seed, step) for kind, seed in curves for step in (100, 200, 300)]
    assert [r["val_acc"] for r in rows] == [v for values in curves.values() for v in values]
    assert mqar_curve.first_reached(rows, "val_acc", 0.9) == {("mha", 0): 200, ("mha", 1): 300, ("sha", 0): None}
    with pytest.raises(ReportError, match="experiment 'other' does not exist in this tracking store; existing "
                                          "experiments: 'Default', 'recall'. Check --experiment and --from-store."):
        mqar_curve.store_curves(uri, "other")


def test_launch_cpu_names_each_process_by_its_actor_module_or_script():
    from benchmarks.system.launch_cpu import process_kind

    site = "/usr/lib/python3.11/site-packages/"
    assert process_kind("ray::_QueueActor.get") == "ray::_QueueActor"
    assert process_kind("ray::TrainController") == "ray::TrainController"
    assert process_kind("/usr/bin/python -m orchestrator train spec.yaml") == "-m orchestrator train"
    assert process_kind(f"/usr/bin/python -u {site}ray/dashboard/agent.py --node-id=1") == "ray/dashboard/agent.py"
    assert process_kind(f"{site}ray/core/src/ray/gcs/gcs_server --log_dir=/tmp") == "gcs/gcs_server"
    assert process_kind("") == "(exited)"


def test_launch_cpu_sweeps_its_trials_one_at_a_time_under_fifo(tmp_path):
    """`--trials N`: the sweep whose trials hand their drivers on (docs/orchestrator.md, "Trial drivers")."""
    from benchmarks.system.launch_cpu import tiny_launch
    from orchestrator.spec import expected_trials, load_study

    assert tiny_launch(tmp_path)[-2] == "train"
    command = tiny_launch(tmp_path, trials=3)
    assert command[-2] == "sweep"
    study = load_study(command[-1])
    assert expected_trials(study) == 3 and study.base.tune.max_concurrent == 1
    assert study.base.tune.scheduler == "fifo"


def test_test_tier_units_sums_each_xdist_group_and_reads_the_wall_time():
    from benchmarks.system.test_tier_units import read_log

    log = "\n".join([
        "============================== slowest durations ===============================",
        "120.50s call     tests/test_a.py::test_one@ray_cluster",
        "30.00s setup    tests/test_a.py::test_two@ray_cluster",
        "10.25s call     tests/test_b.py::test_alone[x]",
        "2.00s teardown tests/test_b.py::test_alone[x]",
        "0.01s call     tests/test_b.py::test_alone[y]",
        "=========================== short test summary info ============================",
        "4 passed, 1 warning in 99.50s (0:01:39)",
    ])
    units, wall = read_log(log)
    assert units == {"@ray_cluster": 150.5, "tests/test_b.py::test_alone[x]": 12.25,
                     "tests/test_b.py::test_alone[y]": 0.01}
    assert wall == 99.5


def test_host_reads_counts_what_brings_values_to_the_host_and_nothing_else():
    """What benchmarks/system/host_reads.py counts: a value, a list, a truth value, a boolean-mask gather or write
    (the mask's count is read first), a copy to the host; not an index of integers, nor arithmetic."""
    t, mask, index = torch.arange(6.0), torch.arange(6) % 2 == 0, torch.tensor([0, 2])
    with host_reads.HostReads() as reads:
        _ = t[index] * 2 + t.sum()
        t.index_select(0, index)
    assert reads.count == 0
    with host_reads.HostReads() as reads:
        t.sum().item()
        t.tolist()
        bool(mask.any())
        _ = t[mask]
        t[mask] = 0.0
        t.cpu()
    assert reads.count == 6 and reads.calls["bool-index"] == 2


def test_a_time_from_no_timed_call_is_not_divided_by_a_warm_median():
    """`measure` reports the first, cold call under the memory measurement when not even one timed call fits
    (repeats = 0): a ratio of it to a warm median is left out (a true 2x speed-up read 0.5x), two cold calls
    compare, and memory ratios do not depend on it."""
    from benchmarks.harness import add_ratios

    def row(impl, n, seconds, repeats, mb):
        return {"impl": impl, "n": n, "fwd_median_s": seconds, "fwd_repeats": repeats, "fwd_peak_mb": mb}

    rows = [row("base", 1, 0.10, 5, 8.0), row("fast", 1, 0.20, 0, 4.0),  # warm 0.05 s, cold first call 0.20 s
            row("base", 2, 0.40, 0, 8.0), row("fast", 2, 0.20, 0, 4.0), row("warm", 2, 0.1, 3, 2.0),
            row("base", 3, 0.10, 5, 8.0), row("fast", 3, 0.05, 4, 4.0)]
    add_ratios(rows, key="n", baseline=lambda r: r["impl"] == "base",
               columns={"fwd_median_s": "speedup", "fwd_peak_mb": "mem_ratio"})
    speedup = {(r["impl"], r["n"]): r["speedup"] for r in rows}
    assert math.isnan(speedup["fast", 1]) and math.isnan(speedup["warm", 2])
    assert speedup["fast", 2] == pytest.approx(2.0) and speedup["fast", 3] == pytest.approx(2.0)
    assert [r["mem_ratio"] for r in rows if r["impl"] == "fast"] == [2.0, 2.0, 2.0]


def test_a_first_call_longer_than_the_timing_budget_still_gets_a_warm_timed_call():
    """A CPU run's budget of 10 s timed nothing at n = 16k and reported the cold, profiled first call (13 s for a
    5 s warm call): one warm call is timed whenever the first fits the call budget."""
    from benchmarks.harness import measure

    calls = []

    def slow_first():
        time.sleep(0.3 if not calls else 0.02)
        calls.append(1)

    result = measure(slow_first, torch.device("cpu"), repeats=3, call_budget_s=5.0, timing_budget_s=0.1)
    assert result.status == "ok" and result.repeats == 1 and len(calls) == 2
    assert result.median_s < 0.2 < result.first_call_s


def test_ray_startups_medians_leave_out_a_round_without_a_metric():
    # statistics.median([nan, 14.0, 14.9, 15.0]) is 14.45 and of [14.0, 14.9, 15.0, nan] 14.95: order-dependent
    assert ray_startup.finite_median([math.nan, 14.0, 14.9, 15.0]) == 14.9
    assert ray_startup.finite_median([14.0, 14.9, 15.0, math.nan]) == 14.9
    assert math.isnan(ray_startup.finite_median([math.nan])) and math.isnan(ray_startup.finite_median([]))
