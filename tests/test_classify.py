"""Classification task and fine-tuning from a masked-LM checkpoint, without Ray: data and label checks, the
input format, metrics against hand counts, padding-free pooling, encoder loading, freezing, and the errors of
`model.init_from` and the `pretrain:` stage."""

from __future__ import annotations

import gc
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
import torch

from models import LanguageModel, ModelConfig, SequenceClassifier
from models.classifier import load_encoder
from orchestrator.launch.local_run import train_locally
from orchestrator.launch.pretrained import check_compatible, preflight, resolve
from orchestrator.spec import SpecError, validate_spec
from orchestrator.training.trainer import Trainer
from tasks import WorkerContext, build_task
from tasks.classify import accuracy_and_macro_f1, classification_data, encode_examples
from tasks.config import ClassifyTaskConfig
from tasks.tokenizer import EOS_ID, PAD_ID

MODEL = {"d_model": 16, "layers": 1, "ffn": 32, "max_seq_len": 32, "dropout": 0.0,
         "attention": {"kind": "mha", "heads": 2}}


def _write_tsv(path: Path, rows: list[tuple], header=("sentence", "label")) -> str:
    lines = ["\t".join(header)] + ["\t".join(str(v) for v in row) for row in rows]
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


def _files(tmp_path: Path, rows: list[tuple], **kw) -> dict[str, str]:
    return {"train": _write_tsv(tmp_path / "train.tsv.gz", rows, **kw),
            "validation": _write_tsv(tmp_path / "dev.tsv", rows[:4], **kw)}


ROWS = [(f"a {'good' if i % 2 else 'bad'} film number {i} .", i % 2) for i in range(40)]


# --- data --------------------------------------------------------------------------------------------------


def test_tsv_csv_and_jsonl_give_the_same_examples(tmp_path):
    tsv = ClassifyTaskConfig(files=_files(tmp_path, ROWS))
    csv_path = tmp_path / "train.csv"
    csv_path.write_text("sentence,label\n" + "".join(f'"{s}",{y}\n' for s, y in ROWS))
    jsonl_path = tmp_path / "train.jsonl"
    jsonl_path.write_text("".join(json.dumps({"sentence": s, "label": y}) + "\n" for s, y in ROWS))
    expected = [s for s, _ in ROWS], [y for _, y in ROWS]
    for files in (tsv.files.model_dump(), {"train": str(csv_path), "validation": str(csv_path)},
                  {"train": str(jsonl_path), "validation": str(jsonl_path)}):
        data = classification_data(ClassifyTaskConfig(files=files), ("train",), tmp_path / "cache")["train"]
        assert (list(data.texts[0]), data.labels.tolist()) == (expected[0], expected[1])


def test_missing_label_column_names_the_field(tmp_path):
    cfg = ClassifyTaskConfig(files=_files(tmp_path, ROWS, header=("sentence", "polarity")))
    with pytest.raises(ValueError, match=r"task.label_column \(now 'label'\)"):
        classification_data(cfg, ("train",), tmp_path / "cache")


def test_missing_text_column_names_the_field(tmp_path):
    cfg = ClassifyTaskConfig(files=_files(tmp_path, ROWS), text_columns=("premise", "hypothesis"))
    with pytest.raises(ValueError, match=r"task.text_columns"):
        classification_data(cfg, ("train",), tmp_path / "cache")
    # the field once, with its whole value (it used to read "task.text_columns (now 'hypothesis')")
    cfg = ClassifyTaskConfig(files=_files(tmp_path, ROWS), text_columns=("sentence", "hypothesis"))
    with pytest.raises(ValueError, match=r"not \['hypothesis'\]; set task.text_columns \(now \['sentence', "
                                         r"'hypothesis'\]\) to the file's column names$"):
        classification_data(cfg, ("train",), tmp_path / "cache")


def test_label_outside_the_classes_is_refused(tmp_path):
    rows = ROWS[:10] + [("a third kind of film .", 2)]
    cfg = ClassifyTaskConfig(files=_files(tmp_path, rows))
    with pytest.raises(ValueError, match=r"row 10: label 2 is not an integer in 0..1 \(task.num_classes=2\)"):
        classification_data(cfg, ("train",), tmp_path / "cache")
    # the same data is fine with three classes
    ok = ClassifyTaskConfig(files=_files(tmp_path, rows), num_classes=3)
    assert classification_data(ok, ("train",), tmp_path / "cache")["train"].labels[-1] == 2


def test_named_labels_map_to_ids_in_the_given_order(tmp_path):
    rows = [("fine .", "positive"), ("awful .", "negative"), ("meh .", "neutral")]
    cfg = ClassifyTaskConfig(files=_files(tmp_path, rows), num_classes=3,
                             label_names=("negative", "neutral", "positive"))
    assert classification_data(cfg, ("train",), tmp_path / "cache")["train"].labels.tolist() == [2, 0, 1]
    unknown = ClassifyTaskConfig(files=_files(tmp_path, rows), num_classes=2, label_names=("negative", "positive"))
    with pytest.raises(ValueError, match="label 'neutral' is not one of task.label_names"):
        classification_data(unknown, ("train",), tmp_path / "cache")


def test_bad_labels_in_local_files_fail_before_ray_starts(tmp_path):
    from orchestrator.launch.preflight import check_labelled_data

    files = _files(tmp_path, ROWS[:10] + [("a third kind of film .", 7)])
    spec = validate_spec({"name": "x", "task": {"kind": "classify", "max_len": 32, "files": files}, "model": MODEL})
    with pytest.raises(SpecError, match=r"task.files.train=.* row 10: label 7 is not an integer in 0..1"):
        check_labelled_data(spec, str(tmp_path / "cache"))
    check_labelled_data(validate_spec({**spec.model_dump(), "task": {**spec.task.model_dump(), "num_classes": 8}}),
                        str(tmp_path / "cache"))


def test_unlabelled_split_says_so(tmp_path):
    cfg = ClassifyTaskConfig(files=_files(tmp_path, [("hidden test .", -1)] * 4))
    with pytest.raises(ValueError, match="unlabelled"):
        classification_data(cfg, ("train",), tmp_path / "cache")


def test_spec_checks_of_the_task_block():
    with pytest.raises(ValueError, match="task.label_names lists 2 names for task.num_classes=3"):
        ClassifyTaskConfig(num_classes=3, label_names=("a", "b"))
    with pytest.raises(ValueError, match="one column .* or two"):
        ClassifyTaskConfig(text_columns=("a", "b", "c"))
    with pytest.raises(SpecError, match="task.max_len=64 exceeds model.max_seq_len=32"):
        validate_spec({"name": "x", "task": {"kind": "classify", "max_len": 64}, "model": MODEL})


# --- input format and metrics ------------------------------------------------------------------------------


class _Pieces:
    """A tokenizer stand-in: one piece per character (ids 10 + ord % 50)."""

    def encode(self, texts):
        return [[10 + ord(c) % 50 for c in t] for t in texts]


def test_single_sentences_and_pairs_are_framed_by_eos_and_cut_longest_first():
    single = encode_examples(_Pieces(), (["abc"],), max_len=16)[0]
    assert single.tolist() == [EOS_ID, *_Pieces().encode(["abc"])[0], EOS_ID]
    pair = encode_examples(_Pieces(), (["abcdefgh"], ["xy"]), max_len=9)[0]
    # 3 separators leave 6 pieces: the 8-piece side is cut to 4, the 2-piece side is kept whole
    a, b = _Pieces().encode(["abcdefgh"])[0], _Pieces().encode(["xy"])[0]
    assert pair.tolist() == [EOS_ID, *a[:4], EOS_ID, *b, EOS_ID]
    assert len(pair) == 9


def test_accuracy_and_macro_f1_match_hand_counts():
    labels = np.array([0, 0, 0, 1, 1, 2])
    predictions = np.array([0, 0, 1, 1, 2, 2])
    # class 0: tp 2 fp 0 fn 1 -> 4/5; class 1: tp 1 fp 1 fn 1 -> 1/2; class 2: tp 1 fp 1 fn 0 -> 2/3
    accuracy, f1 = accuracy_and_macro_f1(labels, predictions)
    assert accuracy == pytest.approx(4 / 6)
    assert f1 == pytest.approx((4 / 5 + 1 / 2 + 2 / 3) / 3)
    sklearn = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    y, p = rng.integers(0, 4, 200), rng.integers(0, 3, 200)
    assert accuracy_and_macro_f1(y, p)[1] == pytest.approx(sklearn.f1_score(y, p, average="macro", zero_division=0))


def test_evaluation_scores_every_example_and_writes_predictions_in_split_order(tmp_path):
    cfg = ClassifyTaskConfig(num_classes=3, max_len=32, batch_size=5,
                             builtin={"train_sentences": 60, "eval_sentences": 23, "lexicon_size": 12})
    task = build_task(cfg, ModelConfig(**MODEL), WorkerContext(cache_dir=tmp_path))
    model = task.build_model().eval()
    metrics = task.evaluate(model)
    lines = Path(task.artifacts()["predictions"]).read_text().split()
    assert len(lines) == 23
    # the same predictions, one example at a time, in the split's order
    one_by_one = [int(model(torch.from_numpy(ids)[None]).argmax()) for ids in task.eval_ids]
    assert [int(x) for x in lines] == one_by_one
    assert metrics["val/acc"] == pytest.approx(np.mean(np.array(one_by_one) == task.eval_labels))


def test_the_predictions_folder_is_rewritten_at_each_evaluation_and_goes_with_the_task(tmp_path):
    """The predictions live in a temporary folder of the task's (the worker copies them into the run folder): one
    folder per task, rewritten at each evaluation, removed when the task goes. Before, every task that evaluated
    left a folder in the system's temp dir, one per run, test and scored checkpoint."""
    cfg = ClassifyTaskConfig(num_classes=3, max_len=32, batch_size=5,
                             builtin={"train_sentences": 60, "eval_sentences": 23, "lexicon_size": 12})
    task = build_task(cfg, ModelConfig(**MODEL), WorkerContext(cache_dir=tmp_path))
    model = task.build_model().eval()
    assert "predictions" not in task.artifacts()  # nothing made before the first evaluation
    task.evaluate(model)
    first = Path(task.artifacts()["predictions"])
    first.write_text("stale\n")
    task.evaluate(model)
    assert Path(task.artifacts()["predictions"]) == first and len(first.read_text().split()) == 23
    folder = first.parent
    del task
    gc.collect()
    assert not folder.exists()


# --- the model ----------------------------------------------------------------------------------------------


def test_mean_pooling_ignores_padding():
    torch.manual_seed(0)
    model = SequenceClassifier(ModelConfig(**MODEL), vocab_size=50, num_classes=2).eval()
    short = torch.tensor([[3, 11, 12, 13, 3]])
    padded = torch.cat([short, torch.full((1, 4), PAD_ID)], dim=1)
    batch = torch.cat([padded, torch.tensor([[3, 20, 21, 22, 23, 24, 25, 26, 3]])])
    mask = torch.tensor([[False] * 5 + [True] * 4, [False] * 9])
    torch.testing.assert_close(model(batch, mask)[0], model(short)[0], atol=1e-5, rtol=1e-5)


def _pretrained_lm(seed: int = 0) -> LanguageModel:
    torch.manual_seed(seed)
    return LanguageModel(ModelConfig(**MODEL), vocab_size=50, causal=False)


def test_loaded_encoder_computes_the_pretrained_states():
    lm = _pretrained_lm().eval()
    classifier = SequenceClassifier(ModelConfig(**MODEL), vocab_size=50, num_classes=2).eval()
    load_encoder(classifier, lm.state_dict())
    tokens = torch.randint(5, 50, (2, 9))
    torch.testing.assert_close(classifier.stack(classifier.embed(tokens)), lm.stack(lm.embed(tokens)))


def test_a_differently_shaped_encoder_is_refused_with_the_tensor_named():
    lm = _pretrained_lm()
    wider = SequenceClassifier(ModelConfig(**{**MODEL, "ffn": 48}), vocab_size=50, num_classes=2)
    with pytest.raises(ValueError, match=r"stack.layers.0.ffn.up.weight is \(32, 16\) in the pretrained run"):
        load_encoder(wider, lm.state_dict())


@pytest.mark.parametrize("freeze", ["embeddings", "encoder"])
def test_frozen_parameters_do_not_move_and_the_head_does(freeze, tmp_path):
    spec = validate_spec({"name": "ft", "task": {"kind": "classify", "max_len": 32, "batch_size": 8,
                                                 "builtin": {"train_sentences": 40, "eval_sentences": 8}},
                          "model": {**MODEL, "init_from": "unused", "freeze": freeze},
                          "optim": {"lr": 1e-2, "max_steps": 2, "weight_decay": 0.1}})
    lm = _pretrained_lm()

    def initialize(model):
        load_encoder(model, {k: v for k, v in lm.state_dict().items() if not k.startswith("embed.tokens")}
                     | {k: v for k, v in model.state_dict().items() if k.startswith("embed.tokens")})
        model.freeze(freeze)

    trainer = Trainer.create(spec, WorkerContext(cache_dir=tmp_path), initialize=initialize)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.fit(type("Hooks", (), {"log": lambda *a: None, "report": lambda *a: None,
                                   "after_step": lambda *a: None})())
    after = trainer.model.state_dict()
    frozen = ("embed.tokens.",) if freeze == "embeddings" else ("embed.", "stack.")
    for name, value in after.items():
        moved = not torch.equal(before[name], value)
        assert moved != name.startswith(frozen), name
    assert not torch.equal(before["head.out_proj.weight"], after["head.out_proj.weight"])


# --- init_from and the pretrain stage ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pretrained_run(tmp_path_factory) -> dict[str, str]:
    """A 4-step masked-LM run on the builtin corpus, checkpointed in a folder, and its settings."""
    root = tmp_path_factory.mktemp("pretrained")
    spec = validate_spec({"name": "mlm", "task": {"kind": "mlm", "seq_len": 32, "batch_size": 4, "vocab_size": 150,
                                                  "builtin": {"train_sentences": 200, "eval_sentences": 20}},
                          "model": MODEL, "optim": {"max_steps": 4},
                          "run": {"eval_every": 2, "checkpoint_every": 2, "storage_path": str(root / "runs")}})
    train_locally(spec, cache_dir=root / "cache", folder=root / "runs" / "mlm")
    return {"folder": str(root / "runs" / "mlm"), "storage": str(root / "runs"), "cache": str(root / "cache")}


def _finetune_spec(pretrained_run, init_from: str, model: dict | None = None, **task) -> dict:
    return {"name": "ft", "model": {**MODEL, **(model or {}), "init_from": init_from},
            "task": {"kind": "classify", "max_len": 32, "batch_size": 8, "num_classes": 3,
                     "builtin": {"train_sentences": 80, "eval_sentences": 20}, **task},
            "optim": {"max_steps": 2}, "run": {"eval_every": 2, "checkpoint_every": 2,
                                               "storage_path": pretrained_run["storage"]}}


def test_init_from_a_run_name_takes_its_checkpoint_encoder_and_tokenizer(pretrained_run):
    spec = validate_spec(_finetune_spec(pretrained_run, "mlm"))
    pretrained = preflight(spec)
    assert Path(pretrained.location).parent == Path(pretrained_run["folder"])
    assert pretrained.spec.task.kind == "mlm" and pretrained.vocab_size <= 150
    trainer, _ = train_locally(spec.model_copy(update={"optim": spec.optim.model_copy(update={"max_steps": 1})}),
                               cache_dir=Path(pretrained_run["cache"]))
    # the fine-tuning task reads the pretraining tokenizer, not one trained on its own texts
    assert trainer.task.vocab_size == pretrained.vocab_size
    assert trainer.task.tokenizer.model_path.read_bytes() == (Path(pretrained.location) / "tokenizer.model").read_bytes()


def test_init_from_a_run_that_does_not_exist_names_the_field(pretrained_run):
    spec = validate_spec(_finetune_spec(pretrained_run, "no-such-run"))
    with pytest.raises(SpecError, match="model.init_from='no-such-run' names no checkpoint folder"):
        preflight(spec)


def test_init_from_another_attention_kind_is_refused(pretrained_run):
    spec = validate_spec(_finetune_spec(pretrained_run, pretrained_run["folder"],
                                        model={"attention": {"kind": "mhe", "heads": 2, "mode": "mul"}}))
    with pytest.raises(SpecError, match=r"model.attention is \{kind: mhe.*but \{kind: mha"):
        check_compatible(spec, resolve(spec))


def test_init_from_another_width_names_the_field_and_value(pretrained_run):
    spec = validate_spec(_finetune_spec(pretrained_run, pretrained_run["folder"], model={"ffn": 64}))
    with pytest.raises(SpecError, match="model.ffn is 64 here but 32 in the pretraining run .* set model.ffn=32"):
        preflight(spec)


def test_a_vocabulary_size_other_than_the_pretrained_tokenizer_is_refused(pretrained_run):
    spec = validate_spec(_finetune_spec(pretrained_run, pretrained_run["folder"], vocab_size=4000))
    with pytest.raises(SpecError, match=r"task.vocab_size=4000 but the pretraining run's tokenizer has \d+ pieces"):
        preflight(spec)
    # dropout is free: no parameter depends on it
    preflight(validate_spec(_finetune_spec(pretrained_run, pretrained_run["folder"], model={"dropout": 0.3})))


def test_pretrain_stage_errors_name_the_field():
    base = {"name": "two", "task": {"kind": "classify", "max_len": 32}, "model": MODEL}
    with pytest.raises(SpecError, match="pretrain.model cannot be set"):
        validate_spec({**base, "pretrain": {"task": {"kind": "mlm"}, "model": {"d_model": 8}}})
    with pytest.raises(SpecError, match="pretrain.task.kind must be mlm"):
        validate_spec({**base, "pretrain": {"task": {"kind": "clm", "seq_len": 32}}})
    with pytest.raises(SpecError, match="model.init_from and pretrain: are both set"):
        validate_spec({**base, "model": {**MODEL, "init_from": "x"}, "pretrain": {"task": {"kind": "mlm"}}})
    with pytest.raises(SpecError, match="model.freeze=encoder keeps pretrained weights fixed"):
        validate_spec({**base, "model": {**MODEL, "freeze": "encoder"}})
    with pytest.raises(SpecError, match="model.init_from fine-tunes a pretrained encoder for task.kind: classify"):
        validate_spec({**base, "task": {"kind": "mlm", "seq_len": 32}, "model": {**MODEL, "init_from": "x"}})
    spec = validate_spec({**base, "optim": {"seed": 3, "lr": 1e-4},
                          "pretrain": {"task": {"kind": "mlm", "seq_len": 32}, "optim": {"lr": 1e-3}}})
    stage = spec.pretraining_spec()
    # the stage keeps the model and the seed, takes its own task and learning rate, and compares perplexity
    assert (stage.model, stage.optim.seed, stage.optim.lr, stage.metric) == (spec.model, 3, 1e-3, "val/ppl")
    assert spec.metric == "val/acc"


def test_init_from_another_d_model_names_d_model_not_the_attention_block(pretrained_run):
    """The attention block carries d_model but prints without it: the two blocks read the same."""
    spec = validate_spec(_finetune_spec(pretrained_run, pretrained_run["folder"], model={"d_model": 32}))
    with pytest.raises(SpecError, match=rf"model.d_model is 32 here but {MODEL['d_model']} in the pretraining run "
                                        rf".* set model.d_model={MODEL['d_model']}"):
        preflight(spec)


def test_validate_refuses_the_init_from_train_refuses(pretrained_run, tmp_path, monkeypatch, capsys):
    """A spec that validates is not refused by train before Ray (docs/orchestrator.md)."""
    from orchestrator.cli import main

    monkeypatch.chdir(tmp_path)
    for init_from, says in (("no-such-run", "names no checkpoint folder"), (pretrained_run["folder"], "model.ffn")):
        raw = _finetune_spec(pretrained_run, init_from, model={"ffn": 64})
        raw["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
        (tmp_path / "ft.yaml").write_text(yaml.safe_dump(raw))
        assert main(["validate", str(tmp_path / "ft.yaml")]) == 2
        assert says in capsys.readouterr().err
    raw = _finetune_spec(pretrained_run, pretrained_run["folder"])
    raw["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    (tmp_path / "ft.yaml").write_text(yaml.safe_dump(raw))
    assert main(["validate", str(tmp_path / "ft.yaml")]) == 0, capsys.readouterr().err


def test_a_run_named_by_every_trial_is_read_once_and_checked_against_each_model(pretrained_run, tmp_path,
                                                                                 monkeypatch):
    """A dropout grid over one init_from read the pretraining run (storage, its tokenizer: a download from s3://)
    once per trial; a width grid must still be checked trial by trial against that one read."""
    import orchestrator.launch.pretrained as pretrained
    from orchestrator.launch.validate_checks import check_pretrained_runs
    from orchestrator.spec import study_from_raw

    monkeypatch.chdir(tmp_path)
    reads = []
    resolve = pretrained.resolve
    monkeypatch.setattr(pretrained, "resolve", lambda spec: reads.append(spec.model.init_from) or resolve(spec))
    folder = pretrained_run["folder"]
    raw = _finetune_spec(pretrained_run, folder)
    raw["model"].update({"init_from": folder, "dropout": {"grid": [0.0, 0.1, 0.2]}})
    check_pretrained_runs(study_from_raw(raw))
    assert reads == [folder]
    raw["model"].update({"dropout": 0.0, "ffn": {"grid": [32, 64]}})
    with pytest.raises(SpecError, match="model.ffn is 64 here but 32"):
        check_pretrained_runs(study_from_raw(raw))


def test_validate_checks_the_init_from_of_every_trial(pretrained_run, tmp_path, monkeypatch, capsys):
    """validate checked the first trial's init_from alone, while a sweep checks every trial's before Ray: a grid
    whose second trial names no run, or a width its pretraining run does not have, validated and then failed
    `orchestrator sweep` (orchestrator/launch/validate_checks.py check_pretrained_runs serves both now)."""
    from orchestrator.cli import main

    monkeypatch.chdir(tmp_path)
    folder = pretrained_run["folder"]
    for model, says in (({"init_from": {"grid": [folder, "no-such-run"]}}, "model.init_from='no-such-run' names no"),
                        ({"init_from": folder, "ffn": {"grid": [32, 64]}}, "model.ffn is 64 here but 32")):
        raw = _finetune_spec(pretrained_run, folder)
        raw["model"].update(model)
        raw["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}"}
        (tmp_path / "ft.yaml").write_text(yaml.safe_dump(raw))
        assert main(["validate", str(tmp_path / "ft.yaml")]) == 2
        assert says in capsys.readouterr().err
