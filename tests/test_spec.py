"""Spec loading and validation: defaults made absolute, dotted overrides, and errors that name the field and
the fix, all before Ray. The CLI's fail-fast path runs in a subprocess so that Ray provably never starts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import torch

from orchestrator.cli import main
from orchestrator.launch.preflight import check_data_files
from orchestrator.spec import (
    SpecError,
    apply_overrides,
    apply_resume_overrides,
    check_gpus,
    load_spec,
    load_study,
    merge_base,
    read_yaml,
    study_from_raw,
    validate_spec,
)
from orchestrator.training.checkpoint import capture_rng, cuda_rng_of_rank

REPO = Path(__file__).resolve().parents[1]


def base_raw(**sections) -> dict:
    raw = {
        "name": "unit",
        "task": {"kind": "mlm", "seq_len": 16, "batch_size": 4, "vocab_size": 120},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 32, "attention": {"kind": "mha", "heads": 2}},
        "optim": {"max_steps": 10},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def write(tmp_path: Path, raw: dict, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_defaults_are_resolved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = validate_spec(base_raw())
    assert spec.run.storage_path == str(tmp_path / "runs")
    assert spec.tracking.uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert spec.tracking.experiment == "unit"
    assert (spec.tune.metric, spec.tune.mode) == ("val/ppl", "min")  # the task's defaults, made explicit
    assert spec.model.attention.d_model == 16
    remote = validate_spec(base_raw(run={"storage_path": "s3://bucket/runs"}, tracking={"uri": "http://head:5000"}))
    assert remote.run.storage_path == "s3://bucket/runs" and remote.tracking.uri == "http://head:5000"


def test_translation_defaults_to_bleu():
    raw = base_raw()
    raw["task"] = {"kind": "translation", "max_source_len": 32, "max_tokens": 256}
    spec = validate_spec(raw)
    assert (spec.tune.metric, spec.tune.mode) == ("val/bleu", "max")


def test_yaml_and_dotted_overrides(tmp_path):
    path = write(tmp_path, base_raw())
    spec = load_spec(path, ["model.attention={kind: linformer, heads: 2, k: 8, sharing: kv}", "optim.lr=1e-3",
                            "run.workers=2", "optim.betas=[0.9, 0.95]"])
    assert spec.model.attention.kind == "linformer" and spec.model.attention.k == 8
    assert spec.model.attention.sharing == "kv"
    assert spec.optim.lr == pytest.approx(1e-3) and spec.optim.betas == (0.9, 0.95) and spec.run.workers == 2
    with pytest.raises(SpecError, match="not key.path=value"):
        apply_overrides({}, ["model.attention.k"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.attention.kind=linformr"], ["model.attention: kind='linformr' is not a kind here; did you mean "
                                             "linformer? valid kinds: mha, sha,"]),
        (["model.attention.kind=nystrom"], ["model.attention: kind='nystrom' is not a kind here; valid kinds: mha,"]),
        (["task.kind=clmm"], ["task: kind='clmm' is not a kind here; did you mean clm? valid kinds: mlm, clm,"]),
        (["model.attention={kind: linformer, heads: 2, k: 64}"], ["model.attention", "k=64", "choose k <= max_seq_len"]),
        (["model.attention.head=2"], ["model.attention.head", "unknown field"]),
        (["optim.schedul=cosine"], ["optim.schedul", "unknown field", "did you mean schedule?"]),
        (["model.attention={kind: linformer, heads: 2, k: 8, shareing: kv}"],
         ["model.attention.shareing", "did you mean sharing?"]),
        (["optim.batch_tokens=65536"], ["optim.batch_tokens", "task.batch_size", "task.max_tokens"]),
        (["task.colour=1"], ["task.colour", "valid fields here: batch_size, builtin"]),
        (["tune.metric=val/bleu"], ["tune.metric='val/bleu'", "task.kind=mlm", "val/ppl"]),
        (["task.seq_len=64"], ["task.seq_len=64", "model.max_seq_len=32"]),
        (["optim.warmup_steps=20"], ["optim.warmup_steps=20", "max_steps=10"]),
        (["run.workers=2", "run.gpus_per_worker=0.5"], ["run.gpus_per_worker=0.5", "run.workers=2", "NCCL"]),
        (["run.gpus_per_worker=1.5"], ["run.gpus_per_worker=1.5", "each worker trains on one GPU", "other 1 would be"]),
        (["run.workers=2", "run.gpus_per_worker=2"],
         ["run.gpus_per_worker=2", "idle", "run.gpus_per_worker=1 with run.workers=4"]),
        (["tracking.system_metrics_interval_s=0"], ["tracking.system_metrics_interval_s must be > 0"]),
        (["model.d_model=abc"], ["model.d_model", "integer"]),
        (["name=has space"], ["name"]),
    ],
    ids=["unknown-kind", "unknown-kind-not-close", "unknown-task-kind", "k-over-seq-len", "typo-attention", "typo-optim",
         "typo-union-member", "moved-field",
         "no-close-name", "metric-not-produced", "seq-len",
         "warmup", "fractional-gpu-ddp", "gpu-over-one-not-whole", "gpus-over-one", "system-metrics-interval", "type",
         "name"],
)
def test_errors_name_the_field_and_the_fix(tmp_path, overrides, expected):
    path = write(tmp_path, base_raw())
    with pytest.raises(SpecError) as err:
        load_spec(path, overrides)
    for text in expected:
        assert text in str(err.value)


def test_gpu_request_is_checked_against_what_is_available():
    spec = validate_spec(base_raw(run={"workers": 4, "gpus_per_worker": 1, "precision": "bf16"}))
    check_gpus(spec, 4, "this machine")
    with pytest.raises(SpecError, match=r"asks for 4 GPUs per run but this machine has 2; lower run.workers"):
        check_gpus(spec, 2, "this machine")


def test_train_refuses_a_spec_with_search_domains():
    with pytest.raises(SpecError, match="orchestrator sweep"):
        validate_spec(base_raw(optim={"lr": {"loguniform": [1e-4, 1e-3]}}))


def test_every_grid_combination_is_validated_and_the_bad_trial_is_named():
    raw = base_raw(model={"attention": {"kind": "linformer", "heads": 2, "k": {"grid": [8, 16, 64]}}})
    with pytest.raises(SpecError) as err:
        study_from_raw(raw)
    assert "trial {model.attention.k=64}" in str(err.value) and "max_seq_len" in str(err.value)
    study = study_from_raw(base_raw(model={"attention": {"kind": "linformer", "heads": 2, "k": {"grid": [8, 16]}}}))
    assert [s.model.attention.k for s in (study.spec_for({"model.attention.k": v}) for v in (8, 16))] == [8, 16]


def test_range_edges_are_validated():
    raw = base_raw(model={"attention": {"kind": "linformer", "heads": 2, "k": {"randint": [4, 40]}}})
    with pytest.raises(SpecError, match=r"model.attention.k=39"):
        study_from_raw(raw)


def test_sweep_settings_cannot_be_searched():
    with pytest.raises(SpecError, match="tune cannot be searched"):
        study_from_raw(base_raw(tune={"num_samples": {"grid": [1, 2]}}))


def test_a_pretraining_stages_run_cannot_be_searched():
    """The cluster check sees the base trial's stages only: a trial whose pretrain stage asked for 64 workers would
    wait for them without end on a cluster that has 2 (orchestrator/spec/resources.py)."""
    mlm = {"kind": "mlm", "seq_len": 16}

    def two_stage(**pretrain) -> dict:
        task = {"kind": "classify", "batch_size": 4, "vocab_size": 120, "max_len": 16}
        return {**base_raw(pretrain=pretrain), "task": task}

    study_from_raw(two_stage(task=mlm, run={"workers": 1}, optim={"lr": {"grid": [1e-3, 3e-3]}}))  # the rest can be
    study_from_raw(two_stage(grid=[{"task": {**mlm, "seq_len": 8}}, {"task": mlm}]))
    for stage in ({"task": mlm, "run": {"workers": {"grid": [1, 64]}}},
                  {"task": mlm, "run": {"grid": [{"workers": 1}, {"workers": 64}]}},
                  {"grid": [{"task": mlm}, {"task": mlm, "run": {"workers": 64}}]}):
        with pytest.raises(SpecError, match="pretrain.run cannot be searched"):
            study_from_raw(two_stage(**stage))


def test_validate_prints_resolved_spec_and_trial_grid(tmp_path, capsys):
    raw = base_raw(model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "mhe", "heads": 2}]}},
                   optim={"lr": {"loguniform": [1e-4, 1e-3]}})
    assert main(["validate", str(write(tmp_path, raw)), "tune.num_samples=2"]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out.split("\nsearch:")[0])
    assert printed["model"]["attention"]["kind"] == "mha" and printed["tune"]["metric"] == "val/ppl"
    assert "trials: 4" in out and "grid 1: model.attention={'heads': 2, 'kind': 'mhe'}" in out
    assert "optim.lr ~ loguniform" in out


def test_validate_numbers_grid_points_as_the_sweep_numbers_its_trials(tmp_path, capsys, monkeypatch):
    """`validate`'s `grid i` is the trial whose id ends in `_<i:05d>`. Tune's variant generator sorts the grid paths
    and varies the first fastest; validate's product varied the last, tune.seeds (appended last), so its `grid 1`
    was seed 1 of the first point while the sweep's trial 1 was the next point at seed 0."""
    from ray.tune.search.variant_generator import generate_variants

    from orchestrator.spec.search_space import to_param_space

    monkeypatch.chdir(tmp_path)
    # The spec's order (layers, ffn, seed) is not Tune's sorted one (ffn, layers, seed).
    raw = base_raw(model={"layers": {"grid": [1, 2]}, "ffn": {"grid": [32, 64]}},
                   tune={"seeds": [0, 1], "scheduler": "fifo"})
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert main(["validate", str(path), "tune.num_samples=2"]) == 0
    out = capsys.readouterr().out
    listed = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("  grid ")]
    study = load_study(path)
    grids = [d.path for d in study.domains if d.is_grid]
    assert grids == ["model.layers", "model.ffn", "optim.seed"]
    trials = [", ".join(f"{path}={variant[(path,)]}" for path in grids)
              for variant, _ in generate_variants(to_param_space(study.domains, "grid"))]
    assert len(trials) == 8 and listed == trials, out
    assert "grid i is trials i and i+8" in out  # tune.num_samples=2: the grid again, after the first


def test_study_loads_from_file(tmp_path):
    raw = base_raw(model={"attention": {"kind": "linformer", "heads": 2, "k": {"grid": [8, 16]}}})
    study = load_study(write(tmp_path, raw), ["optim.max_steps=20"])
    assert [d.path for d in study.domains] == ["model.attention.k"] and study.base.optim.max_steps == 20


@pytest.mark.slow
def test_cli_fails_fast_without_starting_ray(tmp_path):
    """`python -m orchestrator sweep` on a bad spec exits 2 with the field named, and Ray never starts (not even
    imported) in that process, nor does a run folder appear: what makes it fast is that nothing but the spec was
    touched, which these say without timing it."""
    bad = write(tmp_path, base_raw(model={"attention": {"kind": "linformer", "heads": 2, "k": {"grid": [8, 64]}}}))
    probe = (
        "import sys; from orchestrator.cli import main; rc = main(sys.argv[1:]); "
        "print('RAY_IMPORTED', 'ray' in sys.modules); sys.exit(rc)"
    )
    done = subprocess.run([sys.executable, "-c", probe, "sweep", str(bad)], check=False, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done.stderr
    assert "trial {model.attention.k=64}" in done.stderr and "max_seq_len" in done.stderr
    assert "RAY_IMPORTED False" in done.stdout
    assert not (tmp_path / "runs").exists()

    help_run = subprocess.run([sys.executable, "-m", "orchestrator", "--help"], check=False, cwd=REPO, capture_output=True,
                              text=True, timeout=120)
    assert help_run.returncode == 0 and all(c in help_run.stdout for c in ("validate", "sweep", "resume", "report"))


def test_report_and_ui_subcommands_delegate(capsys):
    with pytest.raises(SystemExit) as done:
        main(["report", "--help"])
    assert done.value.code == 0 and "orchestrator report" in capsys.readouterr().out
    assert main(["ui", str(REPO / "configs" / "smoke.yaml"), "tracking.uri=http://head:5000"]) == 0
    out = capsys.readouterr().out
    assert "http://head:5000" in out and "ray attach cluster.yaml -p 5000" in out


@pytest.mark.parametrize("command", ["validate", "plan", "prepare", "train", "sweep", "resume", "status", "evaluate",
                                     "ui"])
def test_every_subcommands_help_says_what_it_does(command, capsys):
    """`orchestrator resume -h`, `status -h` and `ui -h` went from the usage straight to the arguments, without the
    line that says what the command does (argparse's description, which the other commands have)."""
    with pytest.raises(SystemExit) as done:
        main([command, "-h"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]  # usage, a blank line, the description, a blank line, the arguments
    assert done.value.code == 0 and not description.startswith(("positional arguments:", "options:")), out


def test_override_inside_a_search_domain_is_refused(tmp_path):
    path = write(tmp_path, base_raw(model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "sha"}]}}))
    with pytest.raises(SpecError, match=r"model.attention is a search domain .*override it whole"):
        load_study(path, ["model.attention.heads=4"])
    assert load_spec(path, ["model.attention={kind: sha, heads: 4}"]).model.attention.heads == 4


def test_named_scale_applies_its_overrides_and_renames_the_study(tmp_path):
    raw = base_raw(model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "sha", "heads": 2}]}})
    raw["scales"] = {"tiny": {"model.d_model": 8, "optim.max_steps": 3, "task.builtin": {"train_sentences": 50}}}
    path = write(tmp_path, raw)
    study = load_study(path, ["optim.max_steps=5"], scale="tiny")  # CLI overrides come after the scale
    assert study.base.name == "unit-tiny" and study.base.model.d_model == 8 and study.base.optim.max_steps == 5
    assert study.base.task.builtin.train_sentences == 50 and "scales" not in study.raw
    assert load_study(path).base.name == "unit" and load_study(path).base.model.d_model == 16  # block dropped
    with pytest.raises(SpecError, match=r"--scale big: .*its scales: tiny"):
        load_study(path, scale="big")
    assert main(["validate", str(path), "--scale", "tiny"]) == 0


def test_overrides_after_an_option_are_applied_and_strays_refused(tmp_path, capsys):
    raw = base_raw()
    raw["scales"] = {"tiny": {"model.d_model": 8, "optim.max_steps": 3}}
    path = write(tmp_path, raw)
    assert main(["validate", str(path), "--scale", "tiny", "optim.max_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out.split("\nno search domains")[0])
    assert printed["optim"]["max_steps"] == 7 and printed["model"]["d_model"] == 8 and printed["name"] == "unit-tiny"
    with pytest.raises(SystemExit):
        main(["validate", str(path), "--scale", "tiny", "--colour"])
    assert "unrecognized arguments: --colour" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["status", "unit", "optim.max_steps=7"])  # a command without overrides takes none
    assert "unrecognized arguments: optim.max_steps=7" in capsys.readouterr().err


def test_resume_overrides_are_limited_to_what_checkpoints_do_not_depend_on():
    raw = base_raw()
    extended = apply_resume_overrides(raw, ["optim.max_steps=20", "tracking.uri=http://127.0.0.1:5000",
                                            "run.max_failures=3"], kind="run")
    spec = validate_spec(extended)
    assert (spec.optim.max_steps, spec.tracking.uri, spec.run.max_failures) == (20, "http://127.0.0.1:5000", 3)
    for item in ("model.d_model=32", "optim.lr=0.1", "task.seq_len=8", "optim.seed=3", "tracking_uri=x"):
        with pytest.raises(SpecError, match=f"{item.partition('=')[0]} cannot change on resume"):
            apply_resume_overrides(raw, [item], kind="run")
    with pytest.raises(SpecError, match="a sweep resumes only its unfinished trials"):
        apply_resume_overrides(raw, ["optim.max_steps=20"], kind="sweep")
    assert apply_resume_overrides(raw, ["run.max_failures=2"], kind="sweep")["run"]["max_failures"] == 2


def test_hub_dataset_that_cannot_be_loaded_is_refused_before_ray(tmp_path, monkeypatch):
    """Offline (HF_HUB_OFFLINE), a hub name is accepted only when it was downloaded before; nothing is fetched."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    path = write(tmp_path, base_raw(task={"dataset": "someone/wikitext-like"}, run={"storage_path": str(tmp_path / "runs")}))
    assert main(["validate", str(path)]) == 2
    (tmp_path / "hub" / "datasets--someone--wikitext-like").mkdir(parents=True)
    assert main(["validate", str(path)]) == 0
    # The project's own datasets cache (next to the runs) counts too.
    other = write(tmp_path, base_raw(task={"dataset": "other/corpus"}, run={"storage_path": str(tmp_path / "runs")}),
                  name="other.yaml")
    with pytest.raises(SpecError, match=r"task.dataset='other/corpus' is not in the local cache .* task.files"):
        check_data_files(load_spec(other))
    (tmp_path / "runs" / ".cache" / "hf_datasets" / "other___corpus").mkdir(parents=True)
    check_data_files(load_spec(other))


def test_cuda_rng_state_of_a_rank_is_one_device_state():
    """A worker restores one generator (its own device's), also from checkpoints that stored a per-device list."""
    state = torch.arange(4, dtype=torch.uint8)
    assert cuda_rng_of_rank(state) is state
    assert cuda_rng_of_rank([state, state + 1]) is state
    assert cuda_rng_of_rank([]) is None and cuda_rng_of_rank(None) is None
    assert capture_rng()["cuda"] is None  # this CPU machine: no CUDA generator to keep


def test_every_study_spec_validates_at_every_scale(tmp_path):
    """Every spec, its inherited scales included; a study with a base keeps its own name and experiment. A study
    that patches the model another study trains (configs/studies/patch_cpu.yaml) names a folder a fresh clone
    does not have yet: validation refuses it by name, and accepts the spec once the folder exists."""
    for path in sorted((REPO / "configs").rglob("*.yaml")):
        written = yaml.safe_load(path.read_text())
        scales = [None, *(read_yaml(path).get("scales") or {})]
        overrides: list[str] = []
        produced = (written.get("task") or {}).get("pretrained", "")
        if produced.startswith("runs/") and not (REPO / produced).is_dir():
            with pytest.raises(SpecError, match=f"task.pretrained={produced} is not a folder"):
                load_study(path)
            (tmp_path / produced).mkdir(parents=True, exist_ok=True)
            (tmp_path / produced / "model.json").write_text("{}")  # what the producing study's export writes
            overrides = [f"task.pretrained={tmp_path / produced}"]
        for scale in scales:
            study = load_study(path, overrides, scale=scale)
            assert study.base.name, (path, scale)
            if "base" in written:
                expected = written["name"] + (f"-{scale}" if scale else "")
                assert study.base.name == study.base.tracking.experiment == expected, (path, scale)


def test_study_files_with_a_base_give_only_what_differs():
    studies = REPO / "configs" / "studies"
    assert yaml.safe_load((studies / "mhe_clm.yaml").read_text())["base"] == "mhe.yaml"
    clm, mlm = load_study(studies / "mhe_clm.yaml"), load_study(studies / "mhe.yaml")
    assert (clm.base.task.kind, clm.base.optim.schedule, mlm.base.optim.schedule) == ("clm", "cosine", "linear")
    assert [d.path for d in clm.domains] == [d.path for d in mlm.domains] == ["model.attention", "optim.seed"]
    define = load_study(studies / "define.yaml", scale="tiny")  # define -> mhe_clm -> mhe
    assert [d.path for d in define.domains] == ["model.embedding"] and len(define.domains[0].values) == 7
    assert define.base.task.kind == "clm" and define.base.model.d_model == 64  # mhe's tiny scale, inherited


def test_merge_rules():
    base = {
        "name": "parent",
        "task": {"kind": "mlm", "seq_len": 16, "batch_size": 4},
        "model": {"d_model": 16, "layers": 2, "attention": {"kind": "linformer", "heads": 2, "k": 8},
                  "embedding": {"grid": [{"kind": "standard"}, {"kind": "define", "width": 64}]}},
        "optim": {"betas": [0.9, 0.98], "seed": {"grid": [0, 1]}, "lr": 1e-3},
        "tracking": {"experiment": "parent", "retries": 5},
        "scales": {"tiny": {"model.d_model": 8, "task.builtin": {"train_sentences": 50}, "name": "p-small"},
                   "small": {"model.d_model": 12}},
    }
    child = {
        "name": "child",
        "task": {"seq_len": 32},                               # same kind: merged key by key
        "model": {"layers": 4,
                  "attention": {"kind": "mha", "heads": 4},    # another kind: replaced whole (no stale k)
                  "embedding": {"kind": "standard"},           # a value over a base domain: replaced whole
                  "dropout": 0.2},                             # new key: after the base's
        "optim": {"betas": [0.8, 0.9],                         # lists replace whole
                  "lr": {"loguniform": [1e-4, 1e-3]},          # a domain over a base value: replaced whole
                  "seed": 3},                                  # a value over a base domain: replaced whole
        "scales": {"tiny": {"task.builtin": {"eval_sentences": 10}}, "big": {"model.d_model": 1024}},
    }
    merged = merge_base(base, child)
    assert merged["name"] == "child"
    assert merged["task"] == {"kind": "mlm", "seq_len": 32, "batch_size": 4}
    assert merged["model"] == {"d_model": 16, "layers": 4, "attention": {"kind": "mha", "heads": 4},
                               "embedding": {"kind": "standard"}, "dropout": 0.2}
    assert list(merged["model"]) == ["d_model", "layers", "attention", "embedding", "dropout"]
    assert merged["optim"] == {"betas": [0.8, 0.9], "seed": 3, "lr": {"loguniform": [1e-4, 1e-3]}}
    assert merged["tracking"] == {"retries": 5}  # the base's experiment is not inherited: it defaults to name
    # Scales merge per scale, then per dotted key (the child's value replaces the base's whole); a scale's
    # name is not inherited either.
    assert merged["scales"] == {"tiny": {"model.d_model": 8, "task.builtin": {"eval_sentences": 10}},
                                "small": {"model.d_model": 12}, "big": {"model.d_model": 1024}}
    # A child block that names a kind where the base's names none replaces it too.
    assert merge_base({"model": {"attention": {"heads": 2, "groups": 2}}},
                      {"model": {"attention": {"kind": "mha"}}})["model"]["attention"] == {"kind": "mha"}
    # A mapping over a base domain replaces the domain, it does not merge into it.
    assert merge_base(base, {"model": {"embedding": {"grid": [{"kind": "standard"}]}}})["model"]["embedding"] == {
        "grid": [{"kind": "standard"}]}


def test_base_chain_resolves_relative_to_each_file(tmp_path):
    (tmp_path / "common").mkdir()
    root = base_raw(model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "sha", "heads": 2}]}})
    root["scales"] = {"tiny": {"model.d_model": 8}}
    write(tmp_path / "common", root, "root.yaml")
    write(tmp_path / "common", {"base": "root.yaml", "name": "middle", "optim": {"lr": 1e-3}}, "middle.yaml")
    leaf = write(tmp_path, {"base": "common/middle.yaml", "name": "leaf", "optim": {"max_steps": 20}}, "leaf.yaml")
    study = load_study(leaf, scale="tiny")
    assert study.base.name == "leaf-tiny" and study.base.tracking.experiment == "leaf-tiny"
    assert (study.base.optim.lr, study.base.optim.max_steps, study.base.model.d_model) == (1e-3, 20, 8)
    assert [d.path for d in study.domains] == ["model.attention"] and "base" not in study.raw
    assert load_spec(leaf, ["model.attention={kind: mha, heads: 2}"]).optim.max_steps == 20


def test_base_cycle_is_refused_naming_the_files(tmp_path):
    write(tmp_path, {"base": "b.yaml", "name": "a"}, "a.yaml")
    write(tmp_path, {"base": "a.yaml", "name": "b"}, "b.yaml")
    write(tmp_path, {"base": "self.yaml", "name": "self"}, "self.yaml")
    with pytest.raises(SpecError, match=r"b.yaml: base: a.yaml makes a cycle of bases \(.*a.yaml -> .*b.yaml -> "
                                        r".*a.yaml\); remove one"):
        read_yaml(tmp_path / "a.yaml")
    with pytest.raises(SpecError, match=r"cycle of bases \(.*self.yaml -> .*self.yaml\)"):
        load_study(tmp_path / "self.yaml")


def test_missing_base_and_missing_name_are_clear_errors(tmp_path, capsys):
    path = write(tmp_path, {**base_raw(), "base": "nowhere/parent.yaml"})
    with pytest.raises(SpecError, match=r"base: nowhere/parent.yaml not found \(looked for "
                                        + str(tmp_path / "nowhere" / "parent.yaml") + r"; .*relative to the file"):
        load_study(path)
    assert main(["validate", str(path)]) == 2 and "base: nowhere/parent.yaml not found" in capsys.readouterr().err
    write(tmp_path, base_raw(), "parent.yaml")
    nameless = write(tmp_path, {"base": "parent.yaml", "optim": {"max_steps": 5}}, "my_child.yaml")
    with pytest.raises(SpecError, match=r"my_child.yaml: name is required in a spec with base: parent.yaml .*"
                                        r"add e.g. name: my-child"):
        load_study(nameless)
    with pytest.raises(SpecError, match=r"base must be the path of another spec file"):
        load_study(write(tmp_path, {"base": ["parent.yaml"], "name": "x"}, "list.yaml"))


def test_train_and_sweep_refuse_to_overwrite_an_existing_run(tmp_path):
    """A name already used in the storage path is refused before Ray starts, with the resume command."""
    import ray

    from orchestrator.launch.preflight import LaunchError
    from orchestrator.launch.run import run_training
    from orchestrator.launch.sweep import run_sweep
    from orchestrator.storage.layout import RunLayout

    ray_was_running = ray.is_initialized()  # another module's session fixture may have started it
    storage = tmp_path / "runs"
    raw = base_raw(run={"storage_path": str(storage)})
    RunLayout(str(storage), "unit").write_meta({"kind": "run"})
    (storage / "unit" / "checkpoint_000000002").mkdir()  # it got as far as a checkpoint: the name is taken
    with pytest.raises(LaunchError, match=r"a run named 'unit' already exists .*`orchestrator resume unit"):
        run_training(load_spec(write(tmp_path, raw)))
    with pytest.raises(LaunchError, match=r"already exists"):
        run_sweep(load_study(write(tmp_path, raw)))
    assert ray.is_initialized() == ray_was_running


def test_tune_seeds_run_every_grid_point_once_per_seed():
    from orchestrator.spec import expected_trials
    from orchestrator.spec.search_space import grid_points

    raw = base_raw(model={"attention": {"grid": [{"kind": "mha", "heads": 2}, {"kind": "sha", "heads": 2}]}},
                   tune={"seeds": [3, 4, 5], "scheduler": "fifo"})
    study = study_from_raw(raw)
    assert expected_trials(study) == 6
    assert sorted(point["optim.seed"] for point in grid_points(study.domains)) == [3, 3, 4, 4, 5, 5]
    assert study.spec_for(grid_points(study.domains)[-1]).optim.seed == 5
    with pytest.raises(SpecError, match="state the seeds once, in tune.seeds"):
        study_from_raw({**raw, "optim": {"max_steps": 10, "seed": {"grid": [0, 1]}}})
    with pytest.raises(SpecError, match="tune.seeds with search: optuna.*search: grid"):
        study_from_raw(base_raw(tune={"seeds": [0, 1], "search": "optuna"}))
    with pytest.raises(SpecError, match="distinct seeds"):
        validate_spec(base_raw(tune={"seeds": [0, 0]}))


def test_several_objectives_name_what_is_wrong():
    good = validate_spec(base_raw(tune={"metric": ["val/ppl", "params.attention"], "mode": ["min", "min"],
                                        "scheduler": "fifo"}))
    assert good.objectives == [("val/ppl", "min"), ("params.attention", "min")] and good.metric == "val/ppl"
    cases = [
        ({"metric": ["val/ppl", "params.attention"], "mode": ["min", "min"]}, "tune.scheduler: asha stops trials"),
        ({"metric": ["val/ppl", "val/flops"], "mode": ["min", "min"], "scheduler": "fifo"},
         "objective 'val/flops' is reported by no run"),
        ({"metric": ["params.attention", "val/ppl"], "mode": ["min", "min"], "scheduler": "fifo"},
         "the first objective ranks checkpoints"),
        ({"metric": ["val/ppl", "params.attention"], "mode": "min", "scheduler": "fifo"},
         "give tune.mode as a list"),
    ]
    for tune, message in cases:
        with pytest.raises(SpecError, match=message):
            validate_spec(base_raw(tune=tune))
