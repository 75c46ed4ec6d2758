"""What validating a spec costs, and what it covers: no attention weights built (a d_model=16384 grid validates
in bounded memory, the modules it asks being meta-device twins of the real ones), every grid combination checked
(the 900-point grid whose one bad combination the old 256-point sample missed), a grid past MAX_TRIALS refused
at once and before Ray, and Ctrl-C during a long validation honoured. Issue 45, "Bad input that gets past
validation"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest
import torch.nn as nn
import yaml

import tasks
from models.attention import ATTENTION_KINDS, build_attention
from models.attention.registry import AttentionRegistry
from orchestrator.spec import SpecError, study_from_raw, validate_spec
from orchestrator.spec.search_space import MAX_TRIALS
from tests.attention_cases import tiny_knobs

REPO = Path(__file__).resolve().parents[1]


def _clm_raw(name: str, tmp_path: Path, **model) -> dict:
    """A small causal-LM spec (causal: validation asks the attention module whether it can mask the future)."""
    return {
        "name": name,
        "task": {"kind": "clm", "dataset": "builtin", "seq_len": 16, "batch_size": 4, "vocab_size": 120},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 32,
                  "attention": {"kind": "mha", "heads": 2}, **model},
        "optim": {"max_steps": 10},
        "run": {"storage_path": str(tmp_path / "runs")},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"},
    }


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_validation_asks_a_meta_device_module_with_the_real_modules_parameters(kind, tmp_path, monkeypatch):
    """What validation builds to ask `supports_causal` holds no values (meta device) and is the same module as a
    real build: the same parameter names, shapes and counts, and the same answer."""
    asked = []
    real_build = AttentionRegistry.build_attention

    def spy(self, *args, **kwargs):
        module = real_build(self, *args, **kwargs)
        asked.append(module)
        return module

    tasks._attention_supports_causal.cache_clear()  # a block asked before would not be built again
    monkeypatch.setattr(AttentionRegistry, "build_attention", spy)
    raw = _clm_raw("meta", tmp_path, d_model=32, attention={"kind": kind, "heads": 4, **tiny_knobs(kind)})
    try:
        spec = validate_spec(raw)
        refused = False
    except SpecError as err:  # a kind that mixes future positions is refused for a causal task
        assert "cannot run causal attention" in str(err)
        refused = True
    monkeypatch.undo()
    assert len(asked) == 1
    (meta,) = asked
    assert {p.device.type for p in meta.parameters()} | {b.device.type for b in meta.buffers()} <= {"meta"}
    cfg = spec.model.attention if not refused else validate_spec(
        {**raw, "task": {**raw["task"], "kind": "mlm"}}).model.attention
    real = build_attention(cfg, 0, nn.ModuleDict())
    assert [(n, p.shape) for n, p in meta.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert meta.attention_parameters() == real.attention_parameters() > 0
    assert refused == (not real.supports_causal)


def test_validating_a_d_model_16384_grid_allocates_no_weights(tmp_path):
    """A real layer 0 of mha at d_model=16384 is 4 x 16384^2 fp32 = 4.3 GB; the grid asks four such blocks. The
    process's peak RSS grows by less than 200 MB over a validation of the same grid at d_model=16."""
    small = _clm_raw("small", tmp_path)
    kinds = [{"kind": kind, "heads": 4, **tiny_knobs(kind)} for kind in ("mha", "mqa", "lsh", "hyper")]
    small["model"]["attention"] = {"grid": kinds}
    big = {**small, "name": "big", "model": {**small["model"], "d_model": 16384, "ffn": 64}}
    for name, raw in (("small", small), ("big", big)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    script = textwrap.dedent("""
        import resource, sys
        from orchestrator.cli import main
        peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
        assert main(["validate", sys.argv[1]]) == 0
        before = peak()
        assert main(["validate", sys.argv[2]]) == 0
        print("GROWTH_MB", peak() - before)
    """)
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "small.yaml"), str(tmp_path / "big.yaml")],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "d_model: 16384" in done.stdout and "trials: 4" in done.stdout
    growth = int(done.stdout.split("GROWTH_MB")[1].split()[0])
    assert growth < 200, f"validating the d_model=16384 grid grew the peak RSS by {growth} MB"


def test_a_900_point_grid_with_one_invalid_combination_is_refused_naming_it(tmp_path):
    """30 warmups x 30 run lengths: only warmup 29 with max_steps 28 breaks warmup_steps <= max_steps. The old
    validation checked a seeded sample of 256 of the 900; with 28 third in the list, that sample never tried it
    and the grid validated. Every combination is checked now."""
    raw = _clm_raw("nine-hundred", tmp_path)
    run_lengths = [29, 30, 28, *range(31, 58)]
    raw["optim"] = {"warmup_steps": {"grid": list(range(30))}, "max_steps": {"grid": run_lengths}}
    with pytest.raises(SpecError, match=r"trial \{optim.warmup_steps=29, optim.max_steps=28\} is invalid") as err:
        study_from_raw(raw)
    assert "optim.warmup_steps=29 must be in [0, optim.max_steps=28]" in str(err.value)
    raw["optim"]["max_steps"] = {"grid": list(range(29, 59))}  # the same grid without its bad corner
    assert len(study_from_raw(raw).domains) == 2


def _million_point_grid(tmp_path: Path) -> Path:
    raw = _clm_raw("million", tmp_path)
    raw["optim"] = {"max_steps": {"grid": list(range(1000, 1100))}, "lr": {"grid": [1e-4 * i for i in range(1, 101)]},
                    "seed": {"grid": list(range(100))}}
    path = tmp_path / "million.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize("command", ["validate", "sweep"])
def test_a_grid_past_max_trials_is_refused_at_once_before_ray(command, tmp_path, monkeypatch, capsys):
    """10^6 trials: refused from the product's size (the fields, their sizes, the product, the fix), after checking
    one trial spec (the first point, which gives tune's settings) and within a few MB, before run_sweep (Ray) is
    reached. The work is counted in trial specs validated, not seconds: a count does not depend on the machine."""
    import orchestrator.launch
    from orchestrator.cli import main
    from orchestrator.spec import loading

    import ray

    launched = []
    monkeypatch.setattr(orchestrator.launch, "run_sweep", lambda *a, **k: launched.append(a) or 1 / 0)
    # Ray may already run in this test session (another test's); what matters is that this command starts none.
    monkeypatch.setattr(ray, "init", lambda *a, **k: launched.append("ray.init") or 1 / 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    validated = []
    monkeypatch.setattr(loading, "validate_spec", lambda *a, **k: validated.append(a) or validate_spec(*a, **k))
    path = _million_point_grid(tmp_path)
    tracemalloc.start()
    try:
        code = main([command, str(path)])
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    err = capsys.readouterr().err
    assert code == 2 and not launched
    for part in ("optim.max_steps (100 values)", "optim.lr (100 values)", "optim.seed (100 values)",
                 "1,000,000 combinations", f"more than the {MAX_TRIALS:,}", "tune.search: random",
                 "tune.num_samples", "fewer values"):
        assert part in err, (part, err)
    assert len(validated) == 1, f"the refusal validated {len(validated)} trial specs"
    assert peak_mb < 20, f"the refusal allocated {peak_mb:.0f} MB"


def test_num_samples_past_max_trials_is_refused(tmp_path):
    raw = _clm_raw("many-draws", tmp_path, dropout={"uniform": [0.0, 0.2]})
    raw["tune"] = {"search": "random", "num_samples": MAX_TRIALS + 1}
    with pytest.raises(SpecError, match=r"tune.num_samples=10,001 asks for more than 10,000 trials; lower"):
        study_from_raw(raw)


@pytest.mark.slow
def test_ctrl_c_during_a_long_validation_stops_it_with_a_line_and_no_ray(tmp_path):
    """SIGINT during the validation of 10,000 combinations ends the command midway with exit 130 and a line saying
    nothing was started (Ray never imported). The progress interval is 0 here (a line per trial spec checked), so
    the first line is a progress line on any machine, and once the pipe's buffer is full, validation waits on its
    next line until the signal comes: the test does not race validation, however fast the machine."""
    raw = _clm_raw("long", tmp_path)
    raw["optim"] = {"warmup_steps": {"grid": list(range(100))}, "max_steps": {"grid": list(range(100, 200))}}
    path = tmp_path / "long.yaml"
    path.write_text(yaml.safe_dump(raw))
    # Ctrl-C as a terminal delivers it, whatever signal state the test's worker process passed on (an ignored or
    # blocked SIGINT is inherited across exec: once, under pytest-xdist, validation ran to its end unstopped).
    script = ("import signal, sys; signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
              "signal.signal(signal.SIGINT, signal.default_int_handler); "
              "from orchestrator.spec import loading; loading.PROGRESS_EVERY_S = 0.0; "
              "from orchestrator.cli import main; code = main(['validate', sys.argv[1]]); "
              "print('RAY_IMPORTED' if 'ray' in sys.modules else 'NO_RAY', flush=True); sys.exit(code)")
    proc = subprocess.Popen([sys.executable, "-c", script, str(path)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        first = proc.stdout.readline()
        assert first.startswith("[long] validating: ") and "of 10,000 trial specs checked" in first, first
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted (Ctrl-C) while validating the spec; nothing was started" in err
    assert "NO_RAY" in out and "first trial of the sweep" not in out
    checked = [int(line.split("validating: ")[1].split(" of ")[0].replace(",", "")) for line in (first + out).splitlines()
               if "validating: " in line]
    # stopped midway (communicate reads the pipe itself, so lines readline had buffered are not in `out`)
    assert checked == sorted(set(checked)) and checked[-1] < 10_000, checked[-5:]


@pytest.mark.parametrize("field", ["run.storage_path", "task.prepared_path", "tracking.uri"])
def test_a_local_path_past_the_file_systems_limits_is_refused_naming_the_field(field, tmp_path, capsys):
    """A 300-byte folder name failed at the first mkdir with a bare ENAMETOOLONG (in a Ray worker for
    task.prepared_path); `validate` (and train/sweep's preflight) names the field now. So does a path that leaves
    no room under PATH_MAX for what runs add beneath it."""
    from orchestrator.cli import main

    raw = _clm_raw("paths", tmp_path)
    long_folder = tmp_path / ("b" * 300)
    value = {"run.storage_path": f"{long_folder}/runs", "task.prepared_path": str(long_folder),
             "tracking.uri": f"sqlite:///{long_folder}/mlflow.db"}[field]
    section, key = field.split(".")
    raw[section] = {**raw[section], key: value}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(raw))
    assert main(["validate", str(tmp_path / "spec.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{field}: the name 'bbbb" in err and "is 300 bytes, more than the 255" in err, err
    deep = "/".join(["c" * 200] * 20)  # every name fits, the whole does not
    raw = _clm_raw("paths", tmp_path)
    raw["run"]["storage_path"] = f"{tmp_path}/{deep}"
    (tmp_path / "deep.yaml").write_text(yaml.safe_dump(raw))
    assert main(["validate", str(tmp_path / "deep.yaml")]) == 2
    assert "run.storage_path is 4" in capsys.readouterr().err
