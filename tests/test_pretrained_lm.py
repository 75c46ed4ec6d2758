"""task.kind: pretrained_lm (tasks/pretrained_lm.py): a pretrained causal LM, patched, scored on long documents.

Models are made here: a tiny random-weight Hugging Face Llama saved with a word-level tokenizer (no download),
and a tiny byte-level export of the project's own causal LM. The scores are checked against a perplexity
computed by hand from the model's logits.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from models import LanguageModel, ModelConfig
from orchestrator.spec import ExperimentSpec
from orchestrator.training.export import export_model
from tasks import WorkerContext, build_task, pretrained_lm
from tasks.config import PretrainedLMTaskConfig
from tasks.device_memory import measured_peak, peak_memory_gb
from tests.test_device_memory import CUDA, fake_allocator

WORDS = "the cat sat on a mat while dogs ran far away from home and birds sang in tall green trees".split()
SEQ = 32


@pytest.fixture(scope="module")
def text_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    # Each line runs through the words in order from a random start: the next word is learnable from the last.
    rng = random.Random(0)
    lines = [" ".join(WORDS[(start + j) % len(WORDS)] for j in range(12))
             for start in (rng.randrange(len(WORDS)) for _ in range(200))]
    (folder / "train.txt").write_text("\n".join(lines[:150]))
    (folder / "valid.txt").write_text("\n".join(lines[150:]))
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory, text_files):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("llama")
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=fast.vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


def task_config(pretrained, files, **overrides) -> PretrainedLMTaskConfig:
    block = {"kind": "pretrained_lm", "pretrained": str(pretrained), "seq_len": SEQ, "documents": 5,
             "files": {"train": str(files / "train.txt"), "validation": str(files / "valid.txt")}, **overrides}
    return PretrainedLMTaskConfig.model_validate(block)


def build(cfg, seed=0):
    return build_task(cfg, ModelConfig(), WorkerContext(seed=seed))


HYPER = {"kind": "hyper", "block_size": 4, "sample_size": 4, "min_seq_len": 8, "lsh_bits": 2}


def by_hand(model, docs: np.ndarray) -> float:
    """e^(mean NLL of every next-token prediction of every document), from the model's own logits."""
    model.eval()
    with torch.no_grad():
        tokens = torch.from_numpy(docs)
        logits = model(tokens)
        nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="sum")
    return math.exp(float(nll) / (docs.shape[0] * (docs.shape[1] - 1)))


def test_unpatched_perplexity_equals_the_models_own_by_hand(llama_folder, text_files):
    task = build(task_config(llama_folder, text_files))
    model = task.build_model()
    metrics = task.evaluate(model)
    docs = task.documents(task.eval_stream, 5)
    assert docs.shape == (5, SEQ)
    # consecutive, non-overlapping windows of the split's token stream
    assert np.array_equal(docs.reshape(-1), task.eval_stream[: 5 * SEQ])
    assert metrics["val/ppl"] == pytest.approx(by_hand(model, docs), rel=1e-6)
    assert metrics["val/ppl"] == pytest.approx(math.exp(metrics["val/loss"]), rel=1e-9)
    assert metrics["val/patched_layers"] == 0 and metrics["val/documents"] == 5
    assert metrics["val/ppl_unpatched"] == pytest.approx(metrics["val/ppl"], rel=1e-9)
    assert metrics["val/forward_s"] > 0 and metrics["val/attention_s"] > 0
    assert metrics["val/attention_s"] < metrics["val/forward_s"]
    assert metrics["val/speedup"] == pytest.approx(metrics["val/forward_s_unpatched"] / metrics["val/forward_s"])


def test_patched_last_layers_change_the_score_and_the_unpatched_pass_restores_it(llama_folder, text_files):
    unpatched = build(task_config(llama_folder, text_files))
    reference = unpatched.evaluate(unpatched.build_model())["val/ppl"]
    task = build(task_config(llama_folder, text_files, patch={"layers": 2, "attention": HYPER}))
    model = task.build_model()
    assert task.patched_layers == [1, 2]
    metrics = task.evaluate(model)
    assert metrics["val/patched_layers"] == 2
    assert metrics["val/ppl"] != pytest.approx(reference, rel=1e-6)
    assert metrics["val/ppl_unpatched"] == pytest.approx(reference, rel=1e-6)
    # the patched model's perplexity is the patched model's logits' own, and evaluation repeats
    assert metrics["val/ppl"] == pytest.approx(by_hand(model, task.documents(task.eval_stream, 5)), rel=1e-6)
    assert task.evaluate(model)["val/ppl"] == metrics["val/ppl"]


def test_the_run_seed_draws_the_hashes_afresh(llama_folder, text_files):
    scores = []
    for seed in (0, 1):
        task = build(task_config(llama_folder, text_files, patch={"layers": "all", "attention": HYPER}), seed=seed)
        scores.append(task.evaluate(task.build_model())["val/ppl"])
    assert scores[0] != scores[1]


def test_fine_tuning_batches_resume_and_their_loss_is_the_mean_nll(llama_folder, text_files):
    task = build(task_config(llama_folder, text_files, batch_size=2))
    model = task.build_model()
    stream = task.train_batches()
    first = [next(stream) for _ in range(3)]
    resumed = task.train_batches(first[0][1])
    assert torch.equal(next(resumed)[0].tensors["tokens"], first[1][0].tensors["tokens"])
    batch = first[0][0]
    assert batch.n_tokens == 2 * (SEQ - 1)
    loss = task.loss(model, batch)
    tokens = batch.tensors["tokens"]
    expected = F.cross_entropy(model(tokens)[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    torch.testing.assert_close(loss, expected)


def test_a_byte_level_export_of_the_projects_own_lm_is_scored_and_patched(tmp_path, text_files):
    cfg = ModelConfig(d_model=32, layers=2, ffn=64, max_seq_len=64, dropout=0.0, attention={"kind": "mha", "heads": 2})
    torch.manual_seed(0)
    export_model(LanguageModel(cfg, 256, causal=True), task_kind="bytelm", model_cfg=cfg, vocab_size=256,
                 out_dir=tmp_path / "export")
    task = build(task_config(tmp_path / "export", text_files, patch={"layers": "last:1", "attention": HYPER}))
    model = task.build_model()
    assert task.patched_layers == [1]
    assert np.array_equal(task.eval_stream[:10], np.frombuffer((text_files / "valid.txt").read_bytes()[:10], np.uint8))
    metrics = task.evaluate(model)
    assert metrics["val/ppl"] == pytest.approx(by_hand(model, task.documents(task.eval_stream, 5)), rel=1e-6)
    assert metrics["val/ppl_unpatched"] != pytest.approx(metrics["val/ppl"], rel=1e-6)


# ---- what the speed and memory figures measure

COMPILE_S = 1e6
"""Virtual seconds of a stand-in for a GPU's one-time costs (a Triton compile and autotuning), added to the clock
rather than slept: far above any real time of these tiny passes, so whether it was timed is never in doubt."""
EXACT_EVERYWHERE = {"layers": "all", "attention": {"kind": "exact"}}


@pytest.fixture
def virtual_seconds(monkeypatch):
    """time.perf_counter advanced by what is added to the returned list's one item."""
    real, offset = time.perf_counter, [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: real() + offset[0])
    return offset


@pytest.mark.parametrize("documents, batch_size, timed", [(5, 1, 4), (5, 2, 3), (2, 2, 2), (1, 1, 1)],
                         ids=["five-batches", "ragged-batches", "one-batch-of-two", "one-document"])
def test_the_first_batch_of_each_pass_is_scored_but_not_timed(llama_folder, text_files, virtual_seconds,
                                                               documents, batch_size, timed):
    """The exact patch makes both passes the same computation, so only a one-time cost timed in the patched pass
    (which runs first) would take its speed-up away from 1."""
    task = build(task_config(llama_folder, text_files, documents=documents, batch_size=batch_size,
                             patch=EXACT_EVERYWHERE))
    model = task.build_model()
    calls = []

    def compile_on_first_call(*_):
        if not calls:
            virtual_seconds[0] += COMPILE_S
        calls.append(None)

    model.attention_layers()[0].dropin_mechanism.register_forward_pre_hook(compile_on_first_call)
    metrics = task.evaluate(model)
    assert 0 < metrics["val/forward_s"] < COMPILE_S and 0 < metrics["val/attention_s"] < COMPILE_S
    assert 0 < metrics["val/forward_s_unpatched"] < COMPILE_S
    assert 1e-2 < metrics["val/speedup"] < 1e2 and 1e-2 < metrics["val/attention_speedup"] < 1e2
    assert len(calls) == max(-(-documents // batch_size), 2)  # a lone batch runs again
    assert metrics["val/timed_documents"] == timed and metrics["val/documents"] == documents
    # every document's loss counted once, the warm-up's included
    assert metrics["val/ppl"] == pytest.approx(by_hand(model, task.documents(task.eval_stream, documents)), rel=1e-6)


def test_measuring_each_pass_keeps_the_processs_peak_memory(llama_folder, text_files, monkeypatch):
    """The scored passes' val/peak_gb are theirs alone, and the trainer's memory/peak_gb, read after an evaluation
    of a fine-tuning run, still holds the training peak. The model stays on the CPU; the passes' peak scopes are
    pointed at a fake CUDA counter, which a forward of the model raises by 1 GB and the patched mechanism by 2."""
    fake = fake_allocator(monkeypatch)
    monkeypatch.setattr(pretrained_lm, "measured_peak", lambda device: measured_peak(CUDA))
    task = build(task_config(llama_folder, text_files, documents=2, patch=EXACT_EVERYWHERE))
    model = task.build_model()
    model.register_forward_pre_hook(lambda *_: fake.allocate(int(1e9)))
    model.attention_layers()[0].dropin_mechanism.register_forward_pre_hook(lambda *_: fake.allocate(int(2e9)))
    fake.allocate(int(8e9))  # the training steps before the evaluation
    metrics = task.evaluate(model)
    assert fake.resets == 2
    assert metrics["val/peak_gb"] == pytest.approx(2.0) and metrics["val/peak_gb_unpatched"] == pytest.approx(1.0)
    assert peak_memory_gb(CUDA) == pytest.approx(8.0)


# ---- refusals before any cluster time


def spec(task, **top):
    return {"name": "patched", "task": task, "optim": {"max_steps": 0}, **top}


def test_spec_level_refusals(llama_folder, text_files, tmp_path):
    block = task_config(llama_folder, text_files).model_dump()
    ExperimentSpec.model_validate(spec(block))
    with pytest.raises(ValueError, match="remove the model: block"):
        ExperimentSpec.model_validate(spec(block, model={"d_model": 64}))
    with pytest.raises(ValueError, match="only task.kind: pretrained_lm"):
        ExperimentSpec.model_validate(spec({"kind": "clm"}))
    with pytest.raises(ValueError, match="is not a folder"):
        task_config(tmp_path / "missing", text_files)
    with pytest.raises(ValueError, match="cannot be dropped into a trained model"):
        task_config(llama_folder, text_files, patch={"layers": 1, "attention": {"kind": "linformer"}})


def test_a_seq_len_beyond_the_models_positions_is_refused_before_ray(llama_folder, text_files, tmp_path):
    # the Llama folder's config.json says max_position_embeddings=256; an export says model.max_seq_len
    task_config(llama_folder, text_files, seq_len=256)
    with pytest.raises(ValueError, match=r"task.seq_len=257 .*max_position_embeddings=256.*at most 256"):
        task_config(llama_folder, text_files, seq_len=257)
    cfg = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=16, attention={"kind": "mha", "heads": 2})
    export_model(LanguageModel(cfg, 256, causal=True), task_kind="bytelm", model_cfg=cfg, vocab_size=256,
                 out_dir=tmp_path / "export")
    with pytest.raises(ValueError, match=r"task.seq_len=32 .*model.max_seq_len=16.*at most 16"):
        task_config(tmp_path / "export", text_files)


def test_fine_tuning_a_patch_over_attention_dropout_is_refused_before_ray(llama_folder, text_files, tmp_path):
    # GPT-2's default attn_pdrop=0.1 failed only on the worker (the adapter takes no dropout in training)
    import shutil

    folder = Path(shutil.copytree(llama_folder, tmp_path / "dropout"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    block = task_config(folder, text_files, patch={"layers": 1, "attention": HYPER}).model_dump()
    ExperimentSpec.model_validate(spec(block))  # scoring runs in evaluation mode: no dropout
    ExperimentSpec.model_validate(spec({**block, "patch": {"layers": 0}}, optim={"max_steps": 2}))  # nothing patched
    with pytest.raises(ValueError, match=r"optim.max_steps=2 fine-tunes .* attention_dropout=0.1: .*set "
                                         r"attention_dropout to 0 in \(a copy of\) that config.json"):
        ExperimentSpec.model_validate(spec(block, optim={"max_steps": 2}))
    ExperimentSpec.model_validate(spec(task_config(llama_folder, text_files, patch={"layers": 1, "attention": HYPER})
                                       .model_dump(), optim={"max_steps": 2}))


def test_a_patch_of_layers_the_local_model_lacks_is_refused_before_ray(llama_folder, text_files):
    # the Llama folder's config.json says num_hidden_layers=3: "last:5" failed only in the worker's build_model
    block = task_config(llama_folder, text_files, patch={"layers": "last:5", "attention": HYPER}).model_dump()
    with pytest.raises(ValueError, match=r"task.patch.layers='last:5' asks for 5 layers but the model has 3"):
        ExperimentSpec.model_validate(spec(block))
    with pytest.raises(ValueError, match=r"task.patch.layers='0,3' names layer 3 but the model's layers are 0..2"):
        ExperimentSpec.model_validate(spec({**block, "patch": {"layers": "0,3", "attention": HYPER}}))
    ExperimentSpec.model_validate(spec({**block, "patch": {"layers": "last:3", "attention": HYPER}}))


def test_a_cached_hub_models_config_is_checked_before_ray_as_a_folders_is(text_files, tmp_path, monkeypatch):
    """A hub id whose config.json is in this machine's Hugging Face cache: its positions, depth and attention
    dropout are known without a download, and refused by name as a local folder's are."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "models--someone--tiny-lm"  # the hub cache's layout: a snapshot and the ref naming it
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text(json.dumps(
        {"max_position_embeddings": 64, "num_hidden_layers": 2, "attention_dropout": 0.1}))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    with pytest.raises(ValueError, match=r"task.seq_len=65 .*the cached config.json's max_position_embeddings=64"):
        task_config("someone/tiny-lm", text_files, seq_len=65)
    block = task_config("someone/tiny-lm", text_files, patch={"layers": 2, "attention": HYPER}).model_dump()
    ExperimentSpec.model_validate(spec(block))
    with pytest.raises(ValueError, match=r"asks for 3 layers but the model has 2"):
        ExperimentSpec.model_validate(spec({**block, "patch": {"layers": 3, "attention": HYPER}}))
    with pytest.raises(ValueError, match=r"attention_dropout=0.1: .*hf download .*set attention_dropout to 0"):
        ExperimentSpec.model_validate(spec(block, optim={"max_steps": 2}))


def test_worker_level_refusals(llama_folder, text_files, tmp_path):
    short = tmp_path / "short"  # fewer words than one window of task.seq_len
    short.mkdir()
    (short / "train.txt").write_text("the cat sat\n")
    (short / "valid.txt").write_text("the cat sat\n")
    with pytest.raises(ValueError, match="fewer than one document"):
        build(task_config(llama_folder, short))
    task = build(task_config(llama_folder, text_files, patch={"layers": "last:5", "attention": HYPER}))
    with pytest.raises(ValueError, match="asks for 5 layers but the model has 3"):
        task.build_model()


# ---- end to end: a sweep over l through Ray Tune, Ray Train and MLflow, then the report


@pytest.mark.slow
def test_a_sweep_over_patched_layers_runs_and_reports_prr_against_l0(ray_cluster, llama_folder, text_files,
                                                                       tmp_path):
    from mlflow import MlflowClient

    from orchestrator.launch.sweep import run_sweep
    from orchestrator.report.build import build_report
    from orchestrator.spec import study_from_raw
    from orchestrator.tracking.describe import PARENT_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    block = task_config(llama_folder, text_files, documents=3).model_dump()
    block["patch"] = {"layers": {"grid": [0, "all"]}, "attention": HYPER}
    raw = {"name": "patched-sweep", "task": block, "optim": {"max_steps": 0},
           "run": {"storage_path": str(tmp_path / "runs"), "cpus_per_worker": 1},
           "tune": {"seeds": [0, 1], "scheduler": "fifo"}, "tracking": {"uri": uri}}
    outcome = run_sweep(study_from_raw(raw))
    assert outcome.errors == 0 and len(outcome.trials) == 4

    client = MlflowClient(uri)
    runs = [r for r in client.search_runs([client.get_experiment_by_name("patched-sweep").experiment_id])
            if r.data.tags.get(PARENT_TAG) == outcome.parent_run_id]
    by_layers = {}
    for run in runs:
        assert run.info.status == "FINISHED"
        by_layers.setdefault(run.data.metrics["val/patched_layers"], []).append(run.data.metrics)
    assert sorted(by_layers) == [0.0, 3.0] and all(len(v) == 2 for v in by_layers.values())
    # the unpatched model's score does not depend on the seed, and every patched run measured it too
    unpatched = {m["val/ppl"] for m in by_layers[0.0]} | {m["val/ppl_unpatched"] for m in by_layers[3.0]}
    assert max(unpatched) - min(unpatched) < 1e-6 * max(unpatched)
    assert len({m["val/ppl"] for m in by_layers[3.0]}) == 2  # two hashing seeds, two scores

    report = build_report(uri, "patched-sweep", out_dir=tmp_path / "report")
    assert report.patching is not None
    assert (tmp_path / "report" / "patching.png").is_file()
    table = (tmp_path / "report" / "report.md").read_text()
    assert "PRR" in table and "unpatched (l=0)" in table


def test_fine_tuning_a_patched_model_goes_through_the_training_core_and_its_checkpoint_scores(
        llama_folder, text_files, tmp_path):
    from orchestrator.launch.local_run import latest_checkpoint, train_locally
    from orchestrator.training.scoring import evaluate_checkpoint

    block = task_config(llama_folder, text_files, batch_size=2,
                        patch={"layers": 1, "attention": HYPER}).model_dump()
    spec = ExperimentSpec.model_validate(
        {"name": "finetune-patched", "task": block, "optim": {"max_steps": 6, "lr": 1e-2, "warmup_steps": 0},
         "run": {"checkpoint_every": 3, "eval_every": 3, "log_every": 1}})
    before = build(spec.task)
    start = before.evaluate(before.build_model())["val/loss"]
    trainer, _ = train_locally(spec, cache_dir=tmp_path / "cache", folder=tmp_path / "run")
    trained = trainer.evaluate()["val/loss"]
    assert trained < start - 0.3  # six steps on text whose next word follows from the last lower its loss
    scored = evaluate_checkpoint(latest_checkpoint(tmp_path / "run"), "validation", cache_dir=tmp_path / "cache",
                                 out_dir=tmp_path / "eval", export=True)  # the final evaluation's call
    assert scored.metrics["validation/loss"] == pytest.approx(trained, rel=1e-5)
