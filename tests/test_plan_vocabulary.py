"""The vocabulary `orchestrator plan` counts a trial's model at (orchestrator/spec/vocabulary.py): the run's
tokenizer's where plan can know it without reading a corpus, else task.vocab_size, said to be an upper bound."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from orchestrator.cli import main
from orchestrator.spec import load_study, study_from_raw, validate_spec, workload
from orchestrator.spec.counting import flops_per_token
from orchestrator.spec.plan import plan_study
from orchestrator.storage.layout import cache_dir_of
from tasks import WorkerContext, build_task

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs" / "smoke.yaml")


def _run_model_params(spec, storage: Path) -> int:
    """The parameters of the model a run of `spec` trains: its task built as a worker builds it, tokenizer trained
    in the run's cache under `storage`, and the model the task builds from it."""
    ctx = WorkerContext(seed=spec.optim.seed, cache_dir=Path(cache_dir_of(str(storage))))
    model = build_task(spec.task, spec.model, ctx).build_model()
    return sum(p.numel() for p in model.parameters())


def _plan(spec):
    """Plan's count of a one-trial study of `spec` (`plan_study`: what `orchestrator plan` prints)."""
    (plan,) = plan_study(study_from_raw(spec.model_dump(mode="json")))
    return plan


def _table(out: str) -> dict[str, int]:
    """Trial label -> params, from plan's table."""
    rows = re.findall(r"^(attention=\S+ heads=\d+(?: mode=\w+)?)\s+([\d,]+) ", out, flags=re.MULTILINE)
    return {label: int(params.replace(",", "")) for label, params in rows}


def test_plan_of_the_smoke_spec_counts_the_model_its_run_builds(tmp_path, capsys):
    """configs/smoke.yaml asks for 1,000 pieces; sentencepiece makes about 180 of its builtin corpus, and the run's
    model has that many embeddings. Plan (in an empty cache: it trains the tokenizer there) counts each trial's
    parameters exactly as a run built in another empty cache has them, and then reads the same size from the
    tokenizer that run cached."""
    planned = tmp_path / "planned"
    assert main(["plan", SMOKE, f"run.storage_path={planned}"]) == 0
    out = capsys.readouterr().out
    counts = _table(out)
    assert len(counts) == 3, out
    study = load_study(SMOKE, [f"run.storage_path={tmp_path / 'run'}"])
    built = {}
    for point in study.domains[0].values:
        label = "attention=" + " ".join(f"{k}={v}" for k, v in point.items())
        built[label] = _run_model_params(study.spec_for({"model.attention": point}), tmp_path / "run")
    assert counts == built  # at task.vocab_size, plan gave mha 135,656 parameters for the run's 82,291
    (line,) = [line for line in out.splitlines() if line.startswith("vocabulary ")]
    size = int(re.match(r"vocabulary ([\d,]+) \(every trial\): the builtin corpus's tokenizer, trained", line)[1])
    assert 100 < size < 1000 and str(planned / ".cache" / "tokenizers") in line, line  # where the run trains it
    assert not planned.exists()  # plan trained it in a temporary folder: it writes nothing

    for point in study.domains[0].values:
        spec = study.spec_for({"model.attention": point})
        params = built["attention=" + " ".join(f"{k}={v}" for k, v in point.items())]
        plan = _plan(spec)  # now read from the cache the run wrote
        assert plan.step.params_total == params and plan.vocabulary.size == size and plan.vocabulary.exact
        assert plan.vocabulary.trained_s is None
        assert plan.vocabulary.tokenizer.parent == tmp_path / "run" / ".cache" / "tokenizers"
        # What the run's worker logs, at its model's vocabulary (orchestrator/launch/worker.py), and without one.
        assert flops_per_token(spec, size) == flops_per_token(spec) == plan.flops_per_token
        assert flops_per_token(spec, size + 100) > plan.flops_per_token  # a fine-tuned model's larger vocabulary


def _spec(tmp_path: Path, **task):
    return validate_spec({
        "name": "vocab", "task": {"kind": "clm", "vocab_size": 1000, "seq_len": 16, "batch_size": 2, **task},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "attention": {"kind": "mha", "heads": 2}},
        "run": {"storage_path": str(tmp_path / "runs")}})


@pytest.mark.parametrize("case", ["hub", "large builtin", "files"])
def test_a_vocabulary_plan_cannot_read_is_counted_at_task_vocab_size_and_said_to_be_an_upper_bound(case, tmp_path,
                                                                                                  capsys):
    """No tokenizer in the cache, and none plan may train cheaply: a hub corpus never prepared, a builtin corpus too
    large to train on in a second, local files no preparation has hashed. The model is counted at task.vocab_size,
    the printout says it is an upper bound and why, and plan leaves the cache as it was."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text to train on\n" * 50)
    task = {"hub": {"dataset": "wikitext", "config": "wikitext-2-raw-v1"},
            "large builtin": {"builtin": {"train_sentences": 100_000}},
            "files": {"files": {"train": str(corpus), "validation": str(corpus)}}}[case]
    spec = _spec(tmp_path, **task)
    plan = _plan(spec)
    assert plan.vocabulary.size == 1000 and not plan.vocabulary.exact
    assert plan.step.params_total == sum(p.numel() for p in workload(spec).build().parameters())  # at 1,000
    why = {"hub": "the tokenizer of wikitext/wikitext-2-raw-v1 is not trained yet",
           "large builtin": "the builtin corpus's 100,000 training sentences take seconds",
           "files": "task.files.train has not been prepared in this cache"}[case]
    path = tmp_path / "spec.yaml"
    path.write_text(spec.model_dump_json())
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("vocabulary ")]
    assert line.startswith("vocabulary 1,000 (every trial): task.vocab_size, an upper bound"), line
    assert why in line and str(tmp_path / "runs" / ".cache" / "tokenizers") in line, line
    assert not (tmp_path / "runs").exists()  # nothing trained, hashed or remembered


def test_a_prepared_local_corpus_is_counted_at_its_tokenizer_and_found_under_the_runs_key(tmp_path):
    """Local files: the tokenizer's key is a hash of the file, which plan reads only once a preparation remembered
    it. After the run's preparation (tasks/data.py `prepare_lm`) plan finds that run's tokenizer itself."""
    from tasks.data import prepare_lm, tokenizer_file

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"line {i} of a small corpus with few pieces\n" for i in range(200)))
    spec = _spec(tmp_path, files={"train": str(corpus), "validation": str(corpus)})
    cache = Path(cache_dir_of(spec.run.storage_path))
    assert tokenizer_file(spec.task, cache) is None and not cache.exists()
    tokenizer, _, _ = prepare_lm(spec.task, ("train",), cache)
    assert tokenizer_file(spec.task, cache) == tokenizer.model_path
    plan = _plan(spec)
    assert plan.vocabulary.exact and plan.vocabulary.size == tokenizer.vocab_size < 1000
    assert plan.step.params_total == _run_model_params(spec, Path(spec.run.storage_path))


def test_a_bytelm_trial_is_counted_at_its_256_byte_values(tmp_path):
    """bytelm has no tokenizer and no task.vocab_size: its ids are the 256 byte values (tasks/long_range.py)."""
    data = tmp_path / "bytes.txt"
    data.write_bytes(bytes(range(256)) * 4)
    spec = validate_spec({
        "name": "bytes", "task": {"kind": "bytelm", "files": {"train": str(data), "validation": str(data)},
                                  "seq_len": 16, "batch_size": 2},
        "model": {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 16, "attention": {"kind": "mha", "heads": 2}},
        "run": {"storage_path": str(tmp_path / "runs")}})
    plan = _plan(spec)
    assert plan.step.params_total == _run_model_params(spec, tmp_path / "runs")  # plan counted 259 ids before
    assert plan.vocabulary.size == 256 and plan.vocabulary.exact


def test_a_spec_with_a_pretrain_stage_is_counted_at_that_stages_tokenizer(tmp_path):
    """Fine-tuning after a `pretrain:` stage loads the stage's tokenizer (the checkpoint's copy of it), not one of
    its own task: the classifier is counted at the vocabulary the pretraining run's masked LM task has."""
    study = load_study(ROOT / "configs" / "studies" / "downstream_sst2.yaml",
                       ["model.attention={kind: mha, heads: 4}", "optim.seed=0", f"run.storage_path={tmp_path}"],
                       scale="tiny")
    (plan,) = plan_study(study)
    stage = study.base.pretraining_spec()
    ctx = WorkerContext(seed=0, cache_dir=Path(cache_dir_of(stage.run.storage_path)))
    pretrained = build_task(stage.task, stage.model, ctx).vocab_size
    assert plan.vocabulary.size == pretrained < study.base.task.vocab_size and plan.vocabulary.exact
    assert plan.vocabulary.source.startswith("the pretrain: stage's"), plan.vocabulary.source


def test_validate_of_storage_that_cannot_hold_runs_is_refused_by_name_and_writes_nothing(tmp_path, capsys):
    """Plan counts (and trains a builtin tokenizer) before storage is checked: a storage path under a file is
    still refused naming run.storage_path, not with a traceback from a tokenizer written into it, and a storage
    folder that can hold runs is left empty by validate."""
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / "runs"
    assert main(["validate", SMOKE, f"run.storage_path={bad}", "run.gpus_per_worker=1"]) == 2
    assert "run.storage_path" in capsys.readouterr().err
    good = tmp_path / "runs"
    main(["validate", SMOKE, f"run.storage_path={good}", "run.gpus_per_worker=1"])
    assert not (good / ".cache").exists()


def test_adaptive_input_bands_beyond_the_tokenizers_pieces_are_refused_by_name(tmp_path, capsys):
    """Cutoffs below task.vocab_size pass the spec check, but the run's model is built at the tokenizer's ~180
    pieces and would fail there: plan refuses them naming the field, not with a traceback."""
    adaptive = "model.embedding={kind: adaptive, cutoffs: [100, 500]}"
    assert main(["plan", SMOKE, f"run.storage_path={tmp_path}", adaptive]) == 2
    err = capsys.readouterr().err
    assert "model.embedding.cutoffs=[100, 500] must stay below the vocabulary size of the run's tokenizer" in err, err


def test_adaptive_input_bands_beyond_the_tokenizers_pieces_are_refused_by_validate_on_cpu_too(tmp_path, capsys):
    """A CPU spec (no GPU fit check, so no plan) passed validate and sweep's start and failed in the run's model
    build inside Ray ("must stay below the vocabulary size 177"); validate and sweep now check every trial's bands
    against the run's tokenizer, and still write nothing to storage."""
    good = tmp_path / "runs"
    grid = "model.embedding={grid: [{kind: standard}, {kind: adaptive, cutoffs: [100, 500]}]}"
    assert main(["validate", SMOKE, f"run.storage_path={good}", "run.gpus_per_worker=0", grid]) == 2
    err = capsys.readouterr().err
    assert "model.embedding.cutoffs=[100, 500] must stay below the vocabulary size of the run's tokenizer" in err, err
    assert not (good / ".cache").exists()
    assert main(["validate", SMOKE, f"run.storage_path={good}", "run.gpus_per_worker=0",
                 "model.embedding={kind: adaptive, cutoffs: [50, 100]}"]) == 0


def test_train_refuses_adaptive_input_bands_beyond_the_tokenizers_pieces_before_ray(tmp_path, monkeypatch):
    """`orchestrator train`'s preflight checks the bands as validate and sweep do, before any Ray time."""
    import ray

    from orchestrator.launch.run import run_training
    from orchestrator.spec import SpecError

    monkeypatch.chdir(tmp_path)
    raw = load_study(SMOKE, [f"run.storage_path={tmp_path / 'runs'}", f"tracking.uri=sqlite:///{tmp_path}/m.db",
                             "model.attention={kind: mha, heads: 4}",
                             "model.embedding={kind: adaptive, cutoffs: [100, 500]}"]).base
    with pytest.raises(SpecError, match=r"cutoffs=\[100, 500\] must stay below the vocabulary size"):
        run_training(raw)
    assert not ray.is_initialized()
