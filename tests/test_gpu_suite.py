"""The GPU suite (benchmarks/gpu_suite.py) without a GPU: its dry run, so that the one command meant for a lent
GPU cannot rot before one comes (every part at toy sizes on the CPU, the Triton kernels under the interpreter in
the fast tier; the sweep part on the session's local Ray in the real-process tier); and the suite's own logic: a part that raises or fails is a
row of the summary, the FLOP count of the training step, the peak table, the dry run's choice of parity cases."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks import gpu_parity, gpu_speed, gpu_suite, gpu_sweep, gpu_training
from benchmarks.gpu_common import DRY_RUN, PartResult
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


def _dry_run(out, parts) -> tuple[int, object]:
    """One dry run of `parts` into `out` (in this process: the sweep joins the session's Ray)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(gpu_suite.INTERPRET, "1")  # what main() sets; restored for the tests after this one
        code = gpu_suite.main(["--dry-run", "--out", str(out), "--parts", *parts])
    folders = [path for path in out.iterdir() if path.is_dir()]
    assert len(folders) == 1, folders  # <out>/<machine label>/
    return code, folders[0]


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
    assert len(flash) == len(gpu_speed.DRY_FLASH_LENGTHS) * 2 * 2  # n x causal x (triton, sdpa-flash)
    assert {row["status"] for row in flash} == {"ok"} and all(float(row["fwd_bwd_tflops"]) > 0 for row in flash)

    long = tables["long_attention"]
    expected = {(impl, str(causal)) for causal in (False, True) for impl in gpu_speed.long_impls(causal)}
    assert {(row["impl"], row["causal"]) for row in long} == expected
    assert len(long) == len(expected) * len(gpu_speed.DRY_LONG_LENGTHS)
    assert {row["status"] for row in long} == {"ok"}

    (train,) = tables["train_step"]
    assert int(train["n"]) == gpu_training.DRY_SIZE["n"] and float(train["tokens_per_s"]) > 0
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


def test_a_part_that_raises_or_fails_is_its_summary_row_and_the_suite_goes_on(tmp_path, monkeypatch):
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
    monkeypatch.setattr(gpu_suite, "part_table", lambda: {name: ("what", fn) for name, fn in fakes.items()})
    monkeypatch.setenv(gpu_suite.INTERPRET, "1")
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
        FlopCounterMode,  # imports triton: not at collection (gpu_suite's docstring)
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


def test_a_dry_run_after_triton_was_imported_compiled_reruns_itself_with_the_interpreter(tmp_path):
    """Triton imported without TRITON_INTERPRET (as torch._dynamo imports it) has its own jit helpers compiled,
    which interpreted kernels cannot call: the suite must notice and run the dry run in a fresh process."""
    code = ("import sys, triton\n"
            "from benchmarks import gpu_suite\n"
            f"sys.exit(gpu_suite.main(['--dry-run', '--parts', 'flash_vs_sdpa', '--out', {str(tmp_path)!r}]))\n")
    env = {key: value for key, value in os.environ.items() if key != gpu_suite.INTERPRET}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                            cwd=gpu_suite.ROOT, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "running the dry run in a fresh process" in result.stdout
    (folder,) = tmp_path.iterdir()
    assert summary_rows((folder / gpu_suite.SUMMARY).read_text())["flash_vs_sdpa"]["status"] == DRY_RUN
