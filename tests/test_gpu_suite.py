"""The GPU suite (benchmarks/gpu/suite.py) without a GPU: its dry run, so that the one command meant for a lent
GPU cannot rot before one comes (every part at toy sizes on the CPU, the Triton kernels under the interpreter in
the fast tier; the sweep part on the session's local Ray in the real-process tier); and the suite's own logic: a part that raises or fails is a
row of the summary, the FLOP count of the training step, the peak table, the dry run's choice of parity cases."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Aliased: the tests' own names (`parity`, `sweep`: a part's rows) would shadow the modules.
from benchmarks.gpu import attention_profile as gpu_profile, baselines as gpu_baselines, budget as gpu_budget
from benchmarks.gpu import parity as gpu_parity
from benchmarks.gpu import speed as gpu_speed, suite as gpu_suite, sweep as gpu_sweep, training as gpu_training
from benchmarks.gpu import common as gpu_common
from benchmarks.gpu.common import DRY_RUN, PartResult
from benchmarks.harness import read_csv
from models import LanguageModel, ModelConfig

COLUMNS = {
    "kernel_parity": {"kernel", "dtype", "head_dim", "seq", "block_multiple", "mask", "quantity", "max_abs_err", "bound",
                      "tolerance", "passed", "status"},
    "flash_vs_sdpa": {"impl", "n", "head_dim", "causal", "batch", "heads", "dtype", "status", "fwd_ms", "fwd_bwd_ms",
                      "fwd_tflops", "fwd_bwd_tflops", "max_abs_err_vs_sdpa", "fwd_config", "bwd_dkdv_config",
                      "bwd_dq_config", "fwd_speedup_vs_sdpa", "fwd_bwd_speedup_vs_sdpa"},
    "long_attention": {"impl", "n", "causal", "dtype", "status", "fwd_bwd_ms", "speedup_vs_sdpa", "speedup_vs_mha"},
    "train_step": {"n", "batch", "params_matmul", "compile_backend", "autocast", "graph_breaks", "step_ms",
                   "tokens_per_s", "flops_per_step", "achieved_tflops", "peak_bf16_tflops", "mfu", "mfu_check",
                   "status"},
    "attention_profile": {"impl", "n", "causal", "host_ms", "total_ms", "peak_mib", "device_ms", "device_kernels",
                          "host_reads", "top_kernels", "status"},
    "sweep": {"run", "run_id", "status", "optim.lr", "run.precision", "run.strategy", "run.compile", "val/ppl",
              "flops_per_token", "train/mfu"},
}


def summary_rows(text: str) -> dict[str, dict[str, str]]:
    """The summary's table as {part: {column: cell}}."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[2:]]
    return {row["part"]: row for row in rows}


FAST_PARTS = tuple(part for part in gpu_suite.PARTS if part != "sweep")
"""The parts the fast tier's dry run takes: all but the sweep, whose dry run trains two Ray Tune trials of two
FSDP workers each (most of the dry run's time) and is the real-process tier's
(`test_dry_run_of_the_sweep_part_trains_bf16_fsdp_compiled_trials`); the fast tier's end-to-end sweep is
tests/test_orchestrator_runs.py's."""


def _dry_run(out, parts, *flags: str) -> tuple[int, object]:
    """One dry run of `parts` into `out` (in this process: the sweep joins the session's Ray)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gpu_suite.INTERPRET, "1")  # what main() sets; restored for the tests after this one
        code = gpu_suite.main(["--dry-run", "--out", str(out), "--parts", *parts, *flags])
    folders = [path for path in out.iterdir() if path.is_dir()]
    assert len(folders) == 1, folders  # <out>/<machine label>/
    return code, folders[0]


@pytest.fixture
def fake_parts(monkeypatch):
    """Install fake parts (name -> run function) as the suite's part table. They run no kernel, so the suite's
    loop runs in this process even where it imported triton compiled (a dry run would re-run itself in a fresh
    interpreter, without the fakes: `triton_imported_compiled`), whatever ran before on this worker."""
    monkeypatch.setattr(gpu_suite, "triton_imported_compiled", lambda: False)
    monkeypatch.setenv(gpu_suite.INTERPRET, "1")

    def install(runs: dict) -> None:
        monkeypatch.setattr(gpu_suite, "part_table", lambda: {name: ("what", run) for name, run in runs.items()})

    return install


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run of every part but the sweep into a temporary folder, shared by this module's tests."""
    return _dry_run(tmp_path_factory.mktemp("gpu-suite"), FAST_PARTS)


def test_dry_run_summary_lists_every_part_as_dry_run(dry_run):
    code, folder = dry_run
    summary = summary_rows((folder / gpu_suite.SUMMARY).read_text())
    assert list(summary) == list(gpu_suite.PARTS)
    assert {part: row["status"] for part, row in summary.items()} == {
        **dict.fromkeys(gpu_suite.PARTS, DRY_RUN), "sweep": "not run"}
    assert code == 0
    for part in FAST_PARTS:
        assert summary[part]["file"] == f"gpu_{part}.csv"
        assert int(summary[part]["rows"]) == len(read_csv(folder / summary[part]["file"])), part


def test_dry_run_csvs_have_their_columns_and_rows(dry_run):
    _, folder = dry_run
    tables = {part: read_csv(folder / f"gpu_{part}.csv") for part in FAST_PARTS}
    for part, rows in tables.items():
        assert COLUMNS[part] <= set(rows[0]), (part, COLUMNS[part] - set(rows[0]))

    parity = tables["kernel_parity"]
    chosen = gpu_parity.covering_subset(gpu_parity.case_grid())
    assert len(parity) == len(chosen) * len(gpu_parity.QUANTITIES)
    assert {row["passed"] for row in parity} == {"True"}
    assert {row["dtype"] for row in parity} == {str(d).removeprefix("torch.") for d in gpu_parity.DTYPES}
    assert {int(row["head_dim"]) for row in parity} == set(gpu_parity.HEAD_DIMS)
    assert {row["kernel"] for row in parity} == set(gpu_parity.MASKS)
    assert {int(row["seq"]) for row in parity} == set(gpu_parity.DRY_LENGTHS.values())

    flash = tables["flash_vs_sdpa"]
    impls = ["triton", *gpu_baselines.BASELINES]
    assert [row["impl"] for row in flash] == impls * len(gpu_speed.DRY_FLASH_LENGTHS) * 2  # n x causal x impl
    ran = [row for row in flash if row["impl"] in ("triton", "sdpa-flash")]
    assert {row["status"] for row in ran} == {"ok"} and all(float(row["fwd_bwd_tflops"]) > 0 for row in ran)
    # On the CPU: cuDNN and FA3 unavailable, FlexAttention's forward timed and its backward unavailable, each a row.
    status = {row["impl"]: row["status"] for row in flash}
    assert status["sdpa-cudnn"] == "unavailable: SDPA's cuDNN backend needs CUDA"
    assert status["fa3"] == "unavailable: FlashAttention 3 needs a CUDA GPU (Hopper)"
    assert status["flex"] == "unavailable: FlexAttention has no backward on the CPU (forward timed)"
    flex = [row for row in flash if row["impl"] == "flex"]
    assert all(float(row["fwd_ms"]) > 0 and float(row["max_abs_err_vs_sdpa"]) < 0.05 for row in flex)

    long = tables["long_attention"]
    expected = {(impl, str(causal)) for causal in (False, True) for impl in gpu_speed.long_impls(causal)}
    assert {(row["impl"], row["causal"]) for row in long} == expected
    assert len(long) == len(expected) * len(gpu_speed.DRY_LONG_LENGTHS)
    graphed = {kind + gpu_speed.GRAPHED for kind in gpu_speed.GRAPHED_KINDS}
    assert {row["status"] for row in long if row["impl"] not in {*gpu_speed.LONG_BASELINES, *graphed}} == {"ok"}
    assert all(row["status"].startswith("unavailable: ") for row in long if row["impl"] in gpu_speed.LONG_BASELINES)
    assert {row["status"] for row in long if row["impl"] in graphed} == {"unavailable: CUDA graphs need a CUDA GPU"}

    # The layers read nothing back from the device (each read waits for it: the host can no longer queue ahead)
    # but LSH's causal layout length on PyTorch's path, the CPU's, eager (on the kernels' path, a GPU's, it takes
    # its bound: tests/test_attention_glue.py checks that path on fake tensors; compiled, PyTorch's path takes it
    # too, so the compiled layer has no read and no graph break).
    profiled = tables["attention_profile"]
    assert {(row["impl"], row["causal"]) for row in profiled} == {
        *((kind, str(causal)) for kind in gpu_profile.PROFILE_KINDS for causal in (False, True)),
        *((kind, "True") for kind in gpu_profile.DRY_COMPILED_KINDS)}
    assert {row["status"] for row in profiled} == {"ok"}
    reads = {(row["impl"], row["causal"]): int(row["host_reads"]) for row in profiled}
    assert reads == {**dict.fromkeys(reads, 0), ("lsh", "True"): 1}, reads
    # The compiled layers were compiled: dynamo captured at least one graph of each (a silent eager fallback
    # captures none), and whole.
    compiled = [row for row in profiled if row["impl"] in gpu_profile.DRY_COMPILED_KINDS]
    assert compiled and all(int(row["graphs"]) >= 1 and int(row["graph_breaks"]) == 0 for row in compiled), compiled
    assert all(float(row["total_ms"]) >= float(row["host_ms"]) > 0 and row["top_kernels"] for row in profiled)

    trains = tables["train_step"]
    assert [train["variant"] for train in trains] == [v["variant"] for v in gpu_training.DRY_VARIANTS]
    for train in trains:  # every variant timed in the same round-robin
        assert int(train["n"]) == gpu_training.DRY_SIZE["n"] and float(train["tokens_per_s"]) > 0
        assert int(train["timed_steps"]) == gpu_training.DRY_TIMED_STEPS and train["timing"] == "round-robin"
        assert train["mfu"] == ""  # no peak FLOP/s for a CPU: blank, not a made-up figure
        # the trainer's MFU function, checked with an H100's name: achieved FLOP/s over the H100's peak
        # both columns are written with 6 significant digits, so their ratio is exact to about 1e-5
        assert float(train["mfu_check"]) == pytest.approx(float(train["achieved_tflops"]) / 989.4, rel=2e-5)



@pytest.mark.slow
def test_dry_run_of_the_sweep_part_trains_bf16_fsdp_compiled_trials(ray_cluster, tmp_path):
    """The sweep part's dry run: a parent and two FINISHED trials of bf16, FSDP2 over gloo and a compiled model,
    their learning rates, FLOPs per token and no MFU (a CPU), every row counted in the summary."""
    code, folder = _dry_run(tmp_path, ["sweep"])
    assert code == 0
    summary = summary_rows((folder / gpu_suite.SUMMARY).read_text())
    assert summary["sweep"]["status"] == DRY_RUN
    sweep = read_csv(folder / "gpu_sweep.csv")
    assert COLUMNS["sweep"] <= set(sweep[0]) and int(summary["sweep"]["rows"]) == len(sweep)
    assert [row["run"] for row in sweep] == ["parent", "trial", "trial"]
    assert {row["status"] for row in sweep} == {"FINISHED"}
    trials = sweep[1:]
    assert [float(row["optim.lr"]) for row in trials] == list(gpu_sweep.LEARNING_RATES)
    assert {row["run.compile"] for row in trials} == {"True"}
    assert {(row["run.precision"], row["run.strategy"]) for row in trials} == {("bf16", "fsdp")}
    assert all(float(row["flops_per_token"]) > 0 and row["train/mfu"] == "" for row in trials)  # a CPU: no MFU
    assert "ran precision=bf16, strategy=fsdp" in summary["sweep"]["notes"]


def test_a_part_that_raises_or_fails_is_its_summary_row_and_the_suite_goes_on(tmp_path, fake_parts):
    calls = []

    def part(status=None, error=None):
        def run(ctx):
            calls.append(status or error)
            if error:
                raise RuntimeError(error)
            return PartResult([{"x": 1}], status or ctx.passed)
        return run

    fakes = {"kernel_parity": part(error="kernel exploded"), "flash_vs_sdpa": part(status="fail: 2 of 9 over"),
             **{name: part() for name in gpu_suite.PARTS[2:]}}
    fake_parts(fakes)
    assert gpu_suite.main(["--dry-run", "--out", str(tmp_path)]) == 1
    assert len(calls) == len(gpu_suite.PARTS)
    (folder,) = tmp_path.iterdir()
    summary = summary_rows((folder / gpu_suite.SUMMARY).read_text())
    assert summary["kernel_parity"]["status"] == "error: RuntimeError: kernel exploded"
    assert summary["flash_vs_sdpa"]["status"] == "fail: 2 of 9 over"
    assert {summary[name]["status"] for name in gpu_suite.PARTS[2:]} == {DRY_RUN}

    calls.clear()
    assert gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--parts", "sweep"]) == 0
    assert len(calls) == 1
    summary = summary_rows((folder / gpu_suite.SUMMARY).read_text())
    assert summary["sweep"]["status"] == DRY_RUN and summary["kernel_parity"]["status"] == "not run"


def test_without_a_gpu_only_the_dry_run_runs(monkeypatch, capsys):
    monkeypatch.delenv(gpu_suite.INTERPRET, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_suite.main(["--out", "unused"]) == 2
    assert "--dry-run" in capsys.readouterr().out


def test_training_step_flops_match_torchs_flop_counter():
    """tokens x (6 N + 12 L d n) is exactly the matrix products' FLOPs of a forward and backward, as torch's
    FlopCounterMode counts them (SDPA's math backend, whose n x n products it sees; the fused CPU kernel it
    does not count)."""
    from torch.utils.flop_counter import (
        FlopCounterMode,  # imports triton: not at collection (benchmarks/gpu/suite.py's docstring)
    )

    size = {**gpu_training.DRY_SIZE, "layers": 2}
    cfg = ModelConfig(d_model=size["d_model"], layers=size["layers"], ffn=size["ffn"], dropout=0.0,
                      max_seq_len=size["n"], attention={"kind": "mha", "heads": size["heads"]})
    model = LanguageModel(cfg, size["vocab"], causal=True)
    tokens_BT = torch.randint(0, size["vocab"], (size["batch"], size["n"]))
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens_BT).square().mean().backward()
    expected = gpu_training.step_flops(gpu_training.matmul_parameters(model), size["layers"], size["d_model"],
                                       size["n"], tokens_BT.numel())
    assert counter.get_total_flops() == expected


def test_peak_flops_by_gpu_name():
    peak = gpu_training.peak_bf16_flops
    assert peak("NVIDIA H100 80GB HBM3") == peak("NVIDIA H200") > peak("NVIDIA A100-SXM4-80GB") > 0
    assert peak("NVIDIA A100 80GB PCIe") == peak("NVIDIA A100-SXM4-40GB")
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "Tesla V100-SXM2-16GB", None):
        assert peak(other) is None, other  # not in the table: MFU left blank rather than guessed


def test_dry_run_parity_cases_cover_every_axis_value():
    grid = gpu_parity.case_grid()
    chosen = gpu_parity.covering_subset(grid)
    assert len(chosen) < len(grid)
    for axis in grid[0]:
        assert {case[axis] for case in chosen} == {case[axis] for case in grid}, axis


@pytest.mark.slow
def test_a_dry_run_after_triton_was_imported_compiled_reruns_itself_with_the_interpreter(tmp_path):
    """Triton imported without TRITON_INTERPRET (as torch._dynamo imports it) has its own jit helpers compiled,
    which interpreted kernels cannot call: the suite must notice and run the dry run in a fresh process."""
    code = ("import sys, triton\n"
            "from benchmarks.gpu import suite as gpu_suite\n"
            f"sys.exit(gpu_suite.main(['--dry-run', '--parts', 'flash_vs_sdpa', '--out', {str(tmp_path)!r}]))\n")
    env = {key: value for key, value in os.environ.items() if key != gpu_suite.INTERPRET}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=gpu_suite.ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "running the dry run in a fresh process" in result.stdout
    (folder,) = tmp_path.iterdir()
    assert summary_rows((folder / gpu_suite.SUMMARY).read_text())["flash_vs_sdpa"]["status"] == DRY_RUN


# ---- nothing lost to a time limit; --budget ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_dry_run_stopped_by_sigterm_keeps_its_rows_and_says_where_it_stopped(tmp_path):
    """A `timeout` in the middle of a part: the rows of the cases that finished are on disk, and the summary names
    the part and the case the signal interrupted, the parts after it not run. The signal goes once the first row
    (flash_vs_sdpa's first case, triton) is in the CSV (polled): the rest of the part and long attention are still
    to come. A real process (the dry run re-runs itself under the interpreter and passes the signal on to its
    child), so in the slow tier; the fast tier stops the suite's own loop by each signal in process
    (`test_a_signal_stops_the_running_part_and_keeps_its_rows`)."""
    import signal
    import time

    env = {**{key: value for key, value in os.environ.items() if key != gpu_suite.INTERPRET},
           "PYTHONPATH": str(gpu_suite.ROOT)}
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.gpu.suite", "--dry-run", "--out", str(tmp_path),
                              "--parts", "flash_vs_sdpa", "long_attention"], env=env, cwd=gpu_suite.ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240  # generous: the condition is polled, not waited for
        csv_path = None
        while time.monotonic() < deadline and child.poll() is None:
            found = list(tmp_path.glob("*/gpu_flash_vs_sdpa.csv"))
            if found and len(read_csv(found[0])) >= 1:
                csv_path = found[0]
                break
            time.sleep(0.05)
        assert csv_path is not None, "no row before the deadline"
        child.send_signal(signal.SIGTERM)
        output, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 128 + signal.SIGTERM, output[-3000:]
    summary = summary_rows((csv_path.parent / gpu_suite.SUMMARY).read_text())
    stopped = [part for part, row in summary.items() if row["status"] == "stopped"]
    assert len(stopped) == 1, summary
    (part,) = stopped
    assert "stopped by SIGTERM during case '" in summary[part]["run"], summary[part]
    rows = read_csv(csv_path.parent / f"gpu_{part}.csv")
    assert len(rows) >= 1 and int(summary[part]["rows"]) == len(rows)
    if part == "flash_vs_sdpa":  # the signal came in it (else in long attention, which runs after it)
        assert summary[part]["run"].startswith("stopped by SIGTERM during case 'n=32 causal=")
        assert summary["long_attention"]["status"] == "not run"
        assert summary["long_attention"]["run"] == "not run: the suite was stopped by SIGTERM"
    assert "The run was stopped by SIGTERM" in (csv_path.parent / gpu_suite.SUMMARY).read_text()


PARITY_STOP_SCRIPT = """
import sys, threading, time
import torch
from pathlib import Path
from benchmarks.gpu import parity, suite
from benchmarks.gpu.common import SuiteContext

def work(job):  # case 0 finishes at once, its process then waits idle for a job; case 1 runs on
    if job[0] == 1:
        time.sleep(600)
    return job[0], [], 0.0

if __name__ == "__main__":
    ctx = SuiteContext(device=torch.device("cpu"), dry_run=True, folder=Path("."), parity_workers=2)
    try:
        with suite.stop_on_signals(alarm=False):
            for index, _rows, _seconds in parity.parallel_cases([{}, {}], ctx, work=work):
                feeders = sum(thread.name == "QueueFeederThread" for thread in threading.enumerate())
                print("finished", index, "feeder threads", feeders, flush=True)
    except suite.SuiteStopped as stop:
        print("stopped", flush=True)
        sys.exit(stop.exit_code)
"""


@pytest.mark.slow  # a real process and its two spawned parity processes
@pytest.mark.parametrize("to", ["group", "suite"])
def test_a_signal_during_parallel_parity_ends_every_process(tmp_path, to):
    """`timeout` signals the whole process group (`group`), `kill PID` the suite alone (`suite`): either way the
    suite's wait for parity's cases ends at once with its stop, and no parity process is left. The signal comes
    while one process is idle (its case done, nothing left for it) and the other in its case: the H200 window of
    2026-11-28 lost its kernel tests to that state, a `timeout -s TERM` leaving the suite in multiprocessing.Pool's
    `terminate` for ever, on the task queue's lock that the idle worker killed by the signal had held. The stop is
    the last line: no queue feeder thread in the suite, whose end at exit left a semaphore registered and the
    resource tracker's "leaked semaphore" warning after it (CI of 2026-11-29, about 1 run in 15)."""
    import signal
    import time

    script = tmp_path / "stop_parity.py"
    script.write_text(PARITY_STOP_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(gpu_suite.ROOT)}
    child = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    group = child.pid  # its own session: the group is the script and its processes alone

    def group_alive() -> bool:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        return True

    try:
        first = next((line for line in iter(child.stdout.readline, "") if line.startswith("finished")), "")
        assert first.startswith("finished 0"), "the script ended before its first case"
        assert first.endswith("feeder threads 0\n"), first  # the jobs are written by the suite's own thread
        time.sleep(0.5)  # the idle process back in its wait for a job (a shorter wait tests less, never fails)
        if to == "group":
            os.killpg(group, signal.SIGTERM)
        else:
            child.send_signal(signal.SIGTERM)
        output, _ = child.communicate(timeout=60)
        deadline = time.monotonic() + 30
        while group_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not group_alive(), "a parity process outlived the suite"
    finally:
        if group_alive():
            os.killpg(group, signal.SIGKILL)
    assert child.returncode == 128 + signal.SIGTERM, output[-3000:]
    assert output.strip().endswith("stopped"), output[-3000:]


@pytest.mark.parametrize("value", ["0", "-5", "abc", "nan", "inf"])
def test_a_budget_that_is_not_a_positive_number_of_seconds_is_refused_naming_the_flag(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu_suite.parse_args(["--dry-run", "--budget", value])
    assert exit_.value.code == 2
    assert f"argument --budget: {value!r} is not a positive number of seconds" in capsys.readouterr().err
    assert gpu_suite.parse_args(["--budget", "420"]).budget == 420.0


def test_budget_steps_put_correctness_first_and_the_rest_of_parity_last():
    counts = {"kernel_parity": 36, "flash_vs_sdpa": 10, "long_attention": 12, "train_step": 1, "sweep": 1}
    steps = gpu_budget.steps(counts, parity_cover=3)
    assert [(s.part, s.start, s.stop) for s in steps] == [
        ("kernel_parity", 0, 3), ("train_step", 0, 1), ("sweep", 0, 1), ("flash_vs_sdpa", 0, 10),
        ("long_attention", 0, 12), ("kernel_parity", 3, 36)]
    dry = gpu_budget.steps({"kernel_parity": 3, "train_step": 1}, parity_cover=3)  # a dry run: the subset is all
    assert [(s.part, s.start, s.stop) for s in dry] == [("kernel_parity", 0, 3), ("train_step", 0, 1)]


def test_budget_plan_on_the_h100_table_runs_shrinks_and_skips():
    counts = {"kernel_parity": 36, "flash_vs_sdpa": 10, "long_attention": 12, "train_step": 1, "sweep": 1}
    steps = gpu_budget.steps(counts, parity_cover=3)
    estimates = gpu_budget.Estimates(gpu_budget.H100_COSTS)
    # 900 s: everything but the rest of parity (3 x 36.8 + 26.7 + 111.6 + 68.3 + 12 x 9.25 = 427.4 s), which
    # shrinks to the 12 cases of 36.8 s that fit in the 472.6 s left.
    decisions = gpu_budget.plan(steps, estimates.seconds, 900)
    assert [d.action for d in decisions] == ["run"] * 5 + ["shrink"]
    assert decisions[-1].cases == 12 and "472 s left" in decisions[-1].reason
    # 150 s: parity's subset (110.4 s) and the training step (26.7 s); the sweep needs 111.6 s, skipped; flash
    # (68.3 s) does not fit the 12.9 s left, long attention one case (9.25 s) of its 12 does.
    decisions = gpu_budget.plan(steps, estimates.seconds, 150)
    assert [(d.step.part, d.action, d.cases) for d in decisions] == [
        ("kernel_parity", "run", 3), ("train_step", "run", 1), ("sweep", "skip", 0), ("flash_vs_sdpa", "skip", 0),
        ("long_attention", "shrink", 1), ("kernel_parity", "skip", 0)]
    assert decisions[2].reason == "needs ~112 s for one case, 13 s left"
    assert [d.action for d in gpu_budget.plan(steps, estimates.seconds, None)] == ["run"] * 6  # no budget


def test_budget_estimates_follow_the_runs_own_measurements():
    estimates = gpu_budget.Estimates(gpu_budget.H100_COSTS)
    assert estimates.seconds("flash_vs_sdpa", 10) == pytest.approx(68.3)
    estimates.update("kernel_parity", 3, 2 * 3 * 36.8)  # a card half as fast as the H100
    assert estimates.seconds("kernel_parity", 10) == pytest.approx(10 * 2 * 36.8)  # its own measurement
    assert estimates.seconds("flash_vs_sdpa", 10) == pytest.approx(2 * 68.3)  # the table, scaled
    estimates.update("kernel_parity", 3, 0.0)  # a second step of the same part: its mean, not the scale
    assert estimates.seconds("kernel_parity", 6) == pytest.approx(6 * 36.8) and estimates.scale == pytest.approx(2)


def test_a_dry_run_with_a_small_budget_runs_shrinks_and_skips_by_its_estimates(tmp_path, fake_parts):
    """The suite's own loop under a simulated clock on which each part takes its dry-run estimate
    (gpu_budget.DRY_COSTS): 11 s for the sweep (~112 s: skipped before it starts), flash_vs_sdpa (2 cases of
    3.5 s: runs) and long_attention (2 of 3.4 s: one fits the 4 s left, shrunk). The parts are fakes that log a
    row per case of the slice they are given (the dry run's own case counts, `case_counts`)."""
    now = [0.0]

    def simulated(name):
        def run(ctx):
            rows = []
            for case in range(*ctx.cases):
                ctx.case_started(f"case {case}")
                rows.append({"case": case})
                ctx.record(rows[-1:])
                ctx.case_finished()
            now[0] += gpu_budget.DRY_COSTS[name].seconds(ctx.cases[1] - ctx.cases[0])
            return PartResult(rows, ctx.passed)
        return run

    fake_parts({name: simulated(name) for name in gpu_suite.PARTS})
    code = gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--budget", "11",
                           "--parts", "sweep", "long_attention", "flash_vs_sdpa"], clock=lambda: now[0])
    assert code == 0
    (folder,) = tmp_path.iterdir()
    summary = summary_rows((folder / gpu_suite.SUMMARY).read_text())
    assert (summary["sweep"]["status"], summary["sweep"]["run"]) == ("skipped", "skipped: needs ~112 s for one case, 11 s left")
    assert (summary["flash_vs_sdpa"]["status"], summary["flash_vs_sdpa"]["run"]) == (DRY_RUN, "ran")
    assert summary["long_attention"]["status"] == DRY_RUN
    assert summary["long_attention"]["run"] == ("shrunk: 1 of 2 cases ran; cut to 1 of 2 by the budget "
                                                "(~7 s for all 2, 4 s left)")
    assert read_csv(folder / "gpu_long_attention.csv") == [{"case": "0"}]  # the first case only
    assert summary["kernel_parity"]["run"] == "not in --parts"
    assert not (folder / "gpu_sweep.csv").exists()


@pytest.mark.parametrize("signum", ["SIGALRM", "SIGTERM", "SIGINT"])
def test_a_signal_stops_the_running_part_and_keeps_its_rows(tmp_path, fake_parts, signum):
    """A `timeout` (SIGTERM), Ctrl-C (SIGINT) or the real clock's end of the budget (SIGALRM), raised here by the
    part itself between its cases: the finished case's row is on disk and the summary names the case it stopped in."""
    import signal

    signum = signal.Signals[signum]

    def part(ctx):
        ctx.case_started("case one")
        ctx.record([{"x": 1}])
        ctx.case_finished()
        ctx.case_started("case two")
        signal.raise_signal(signum)
        raise AssertionError("not reached")

    fake_parts(dict.fromkeys(gpu_suite.PARTS, part))
    code = gpu_suite.main(["--dry-run", "--out", str(tmp_path), "--budget", "1000", "--parts", "train_step", "sweep"])
    why = "the budget ran out" if signum == signal.SIGALRM else f"by {signum.name}"
    assert code == (1 if signum == signal.SIGALRM else 128 + signum)
    (folder,) = tmp_path.iterdir()
    summary = summary_rows((folder / gpu_suite.SUMMARY).read_text())
    assert summary["train_step"]["status"] == "stopped"
    assert summary["train_step"]["run"] == (f"stopped{':' if signum == signal.SIGALRM else ''} {why} during case "
                                            f"'case two' (1 of {len(gpu_training.DRY_VARIANTS)} cases done)")
    assert read_csv(folder / "gpu_train_step.csv") == [{"x": "1"}]
    assert summary["sweep"]["run"] == f"not run: the suite was stopped{':' if signum == signal.SIGALRM else ''} {why}"


@pytest.mark.slow  # two spawned processes import torch and run the interpreted kernels
def test_parity_cases_in_processes_give_the_rows_of_one_process(tmp_path, capsys):
    """`--parity-workers 2`: the cases run in two spawned processes (the interpreter's switch inherited), each case
    once, and the CSV holds the rows a single process writes, errors equal to the last bit, in the cases' order."""
    tables = {}
    for workers in ("1", "2"):
        code, folder = _dry_run(tmp_path / workers, ["kernel_parity"], "--parity-workers", workers)
        assert code == 0
        tables[workers] = read_csv(folder / "gpu_kernel_parity.csv")
    out = capsys.readouterr().out
    cover = len(gpu_parity.covering_subset(gpu_parity.case_grid()))
    assert len(re.findall(rf"^  parity \d/{cover} ", out, re.M)) == 2 * cover, out
    assert "processes 2" in (folder / "gpu_suite_summary.md").read_text()
    assert tables["2"] == tables["1"]


def test_parity_workers_default_and_bad_values():
    assert gpu_budget.parity_workers(None, dry_run=True) == 1
    assert gpu_budget.parity_workers(None, dry_run=False) == max(1, min(8, os.cpu_count() or 1))
    assert gpu_budget.parity_workers(3, dry_run=True) == 3
    for bad in ("0", "-2", "two", "1.5"):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(["--parity-workers", bad])


def test_long_lengths_are_taken_in_order_and_bad_ones_refused_naming_the_flag(capsys):
    args = gpu_suite.parse_args(["--long-lengths", "262144", "65536"])
    ctx = gpu_common.SuiteContext(device=torch.device("cpu"), dry_run=False, folder=Path("."),
                                  long_lengths=tuple(args.long_lengths))
    # shortest first (what a budget keeps); 256k non-causal only
    assert gpu_speed.long_cases(ctx) == [(65536, False), (65536, True), (262144, False)]
    for bad in ("0", "-4", "4k"):
        with pytest.raises(SystemExit):
            gpu_suite.parse_args(["--long-lengths", bad])
        assert "--long-lengths" in capsys.readouterr().err


def test_parallel_parity_estimate_counts_rounds_of_cases_not_cases():
    table = gpu_budget.with_parity_workers(gpu_budget.H100_COSTS, 8)
    one = gpu_budget.H100_COSTS["kernel_parity"]
    assert table["kernel_parity"].seconds(3) == one.setup + gpu_budget.PARITY_POOL_START_S + one.per_case
    assert table["kernel_parity"].seconds(36) == one.setup + gpu_budget.PARITY_POOL_START_S + 5 * one.per_case
    assert gpu_budget.with_parity_workers(gpu_budget.H100_COSTS, 1) == gpu_budget.H100_COSTS
    # Once measured: 3 cases in one round of 8 processes took 60 s, so the other 33 take 5 rounds.
    estimates = gpu_budget.Estimates(table)
    estimates.update("kernel_parity", 3, 60.0)
    assert estimates.seconds("kernel_parity", 33) == 5 * 60.0
    sequential = gpu_budget.Estimates(gpu_budget.H100_COSTS)
    sequential.update("kernel_parity", 3, 60.0)
    assert sequential.seconds("kernel_parity", 33) == 33 * 20.0
    assert table["train_step"] == gpu_budget.H100_COSTS["train_step"]


@pytest.mark.parametrize("n, bucket_size, factors", [
    (32, 8, [2, 4]), (4096, 64, [8, 16]), (131072, 64, [64, 64]), (262144, 64, [64, 128]), (5000, 64, [6, 26]),
    (192, 64, [6]),  # 6 = 2 x 3: no split into even factors, so the count alone
])
def test_the_factorized_lsh_layer_has_the_default_bucket_count_in_even_factors(n, bucket_size, factors):
    from models.attention.lsh import default_n_buckets

    got = gpu_speed.factorized_buckets(n, bucket_size)
    assert got == factors
    assert math.prod(got) == default_n_buckets(n, bucket_size) and all(f % 2 == 0 for f in got)
    knobs = gpu_speed.layer_knobs("lsh-r4f", n, {"knobs": {"lsh-r4f": {"bucket_size": bucket_size, "n_hashes": 4}}})
    assert knobs == {"bucket_size": bucket_size, "n_hashes": 4, "n_buckets": factors}
