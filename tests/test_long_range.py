"""Long-range tasks without Ray: each generator against an evaluator written another way (ListOps values by a
stack machine and the statistics module; MQAR answers by replaying the bindings; bits per byte by scoring the
file directly), determinism from the seed, split sizes, the errors of bad task blocks, and one training step
of every attention kind on the generated tasks."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from models import ModelConfig
from models.attention import ATTENTION_KINDS
from orchestrator.launch.local_run import latest_checkpoint, train_locally
from orchestrator.spec import SpecError, validate_spec
from orchestrator.training.export import load_model
from orchestrator.training.scoring import evaluate_checkpoint
from tasks import WorkerContext, build_task, check_compatible
from tasks import listops, mqar
from tasks.config import ByteLMTaskConfig, ListOpsTaskConfig, MQARTaskConfig
from tasks.long_range import listops_split, mqar_split
from tests.attention_cases import tiny_knobs

LISTOPS = {"kind": "listops", "seq_len": 48, "min_len": 8, "max_depth": 4, "max_args": 5, "train_examples": 300,
           "eval_examples": 40, "batch_size": 8}
MQAR = {"kind": "mqar", "seq_len": 64, "num_kv_pairs": 6, "vocab_size": 80, "train_examples": 200,
        "eval_examples": 30, "batch_size": 8}


def _model(max_seq_len: int = 64, kind: str = "mha", **knobs) -> ModelConfig:
    return ModelConfig(d_model=16, layers=1, ffn=32, max_seq_len=max_seq_len, dropout=0.0,
                       attention={"kind": kind, "heads": 2, **tiny_knobs(kind), **knobs})


# --- ListOps ---------------------------------------------------------------------------------------------------


def _stack_value(text: str) -> tuple[int, int, int, int]:
    """(value, depth, most arguments, MEDs of an even count) of a prefix expression read token by token with an explicit stack; MED is
    statistics.median rounded down, as LRA's int(np.median(...)): no code shared with tasks/listops.py."""
    ops = {"[MIN": min, "[MAX": max, "[MED": lambda a: math.floor(statistics.median(a)),
           "[SM": lambda a: sum(a) % 10}
    stack: list[list] = []
    result, depth, widest, even_medians = None, 0, 0, 0
    for token in text.split():
        if token in ops:
            stack.append([token])
            depth = max(depth, len(stack))
        elif token == "]":
            op, *args = stack.pop()
            widest = max(widest, len(args))
            even_medians += op == "[MED" and len(args) % 2 == 0
            value = ops[op](args)
            if stack:
                stack[-1].append(value)
            else:
                result = value
        else:
            if stack:
                stack[-1].append(int(token))
            else:
                result = int(token)
    assert not stack, f"unbalanced expression {text!r}"
    return result, depth, widest, even_medians


def test_listops_labels_equal_an_independent_evaluation_and_follow_the_lra_rules(tmp_path):
    cfg = ListOpsTaskConfig(**LISTOPS)
    even_medians = 0
    for split in ("train", "validation", "test"):
        examples, labels = listops_split(cfg, split, tmp_path)
        for ids, label in zip(examples, labels):
            assert ids[0] == listops.CLS
            text = listops.render(ids)
            value, depth, widest, even = _stack_value(text)
            assert label == value, text
            assert cfg.min_len < len(ids) - 1 < cfg.seq_len - 1  # LRA's strict bounds, CLS not counted
            assert depth <= cfg.max_depth - 1 and widest <= cfg.max_args  # the root is depth 1; leaves at max_depth
            even_medians += even
    assert even_medians > 20  # the case an off-by-one in MED gets wrong is well represented
    # the labels use every class of the 10 (a generator stuck on one operator would not)
    assert len(set(np.concatenate([listops_split(cfg, s, tmp_path)[1] for s in ("train", "test")]))) == 10


def test_listops_median_of_an_even_count_rounds_the_mean_of_the_middle_pair_down():
    # LRA: int(np.median([1, 4])) = int(2.5) = 2; the lower middle (1) or upper (4) would be wrong
    assert listops.apply_operator("[MED", [4, 1]) == 2
    assert listops.apply_operator("[MED", [7, 1, 9]) == 7
    assert listops.apply_operator("[SM", [9, 8, 7]) == 4
    tree = ("[MAX", [3, ("[MED", [0, 9, 5, 6]), ("[SM", [5, 5])])
    assert listops.tree_value(tree) == 5
    assert listops.render(np.array([listops.CLS, *listops.tree_tokens(tree)])) == "[MAX 3 [MED 0 9 5 6 ] [SM 5 5 ] ]"


def test_listops_splits_are_deterministic_distinct_and_sized(tmp_path):
    cfg = ListOpsTaskConfig(**LISTOPS)
    first = {s: listops_split(cfg, s, tmp_path / "a") for s in ("train", "validation", "test")}
    again = {s: listops_split(cfg, s, tmp_path / "b") for s in ("train", "validation", "test")}
    assert [len(first[s][0]) for s in first] == [300, 40, 40]
    for s in first:
        assert all(np.array_equal(x, y) for x, y in zip(first[s][0], again[s][0]))
        assert np.array_equal(first[s][1], again[s][1])
    every = [tuple(ids) for s in first for ids in first[s][0]]
    assert len(set(every)) == len(every)  # no expression in two splits (nor twice in one)
    other = listops_split(cfg.model_copy(update={"seed": 7}), "train", tmp_path / "c")
    assert not all(np.array_equal(x, y) for x, y in zip(first["train"][0], other[0]))


# --- MQAR ------------------------------------------------------------------------------------------------------


def _replay_answers(inputs: np.ndarray, targets: np.ndarray, num_kv_pairs: int, vocab_size: int) -> None:
    """Walk each example left to right: a key followed by a value binds them; every position with a target
    holds a key bound earlier, and its target is that key's value."""
    for row_inputs, row_targets in zip(inputs, targets):
        bound: dict[int, tuple[int, int]] = {}
        for t in range(0, 2 * num_kv_pairs, 2):
            key, value = int(row_inputs[t]), int(row_inputs[t + 1])
            assert 1 <= key < vocab_size // 2 <= value < vocab_size and key not in bound
            bound[key] = (value, t)
        answered = set()
        for t in np.flatnonzero(row_targets != mqar.IGNORE):
            key = int(row_inputs[t])
            assert key in bound and bound[key][1] < t
            assert row_targets[t] == bound[key][0]
            answered.add(key)
        assert answered == set(bound)  # each key queried exactly once
        assert (row_targets != mqar.IGNORE).sum() == num_kv_pairs


def test_every_mqar_answer_is_the_value_bound_to_its_key_earlier(tmp_path):
    cfg = MQARTaskConfig(**MQAR)
    for split in ("train", "validation", "test"):
        data = mqar_split(cfg, split, tmp_path)
        _replay_answers(data["inputs"], mqar.targets(data["positions"], data["answers"], cfg.seq_len),
                        cfg.num_kv_pairs, cfg.vocab_size)


def test_mqar_queries_follow_the_power_law_and_fill_the_rest_at_random(tmp_path):
    cfg = MQARTaskConfig(**{**MQAR, "train_examples": 2000})
    data = mqar_split(cfg, "train", tmp_path)
    slots = (data["positions"] - 2 * cfg.num_kv_pairs) // 2
    space = (cfg.seq_len - 2 * cfg.num_kv_pairs) // 2
    assert slots.min() >= 0 and slots.max() < space
    # power_a = 0.01: p(slot g) ~ g^-0.99, so near slots dominate; uniform slots would average (space - 1) / 2
    assert slots.mean() < 0.8 * (space - 1) / 2
    p = mqar.query_slot_probabilities(cfg.seq_len, cfg.num_kv_pairs, cfg.power_a)
    assert p[0] / p[1] == pytest.approx(2 ** 0.99)
    assert (data["inputs"] == 0).mean() < 0.1  # the empty slots hold random tokens (zero only by chance)
    zeros = mqar_split(cfg.model_copy(update={"random_non_queries": False}), "train", tmp_path)["inputs"]
    assert (zeros[:, 2 * cfg.num_kv_pairs:] == 0).mean() > 0.8


def test_mqar_with_zeros_between_queries_takes_a_vocabulary_below_the_length(tmp_path):
    """Zoology's bound vocab_size > seq_len is about random fillers; with zeros a key recurs only as its query,
    so 14 ids (6 keys, 7 values) at n = 64 make valid examples: every nonzero token after the pairs is a query."""
    cfg = MQARTaskConfig(**{**MQAR, "vocab_size": 14, "random_non_queries": False})
    data = mqar_split(cfg, "train", tmp_path)
    targets = mqar.targets(data["positions"], data["answers"], cfg.seq_len)
    _replay_answers(data["inputs"], targets, cfg.num_kv_pairs, cfg.vocab_size)
    after_pairs = data["inputs"][:, 2 * cfg.num_kv_pairs:]
    assert np.array_equal(after_pairs != 0, targets[:, 2 * cfg.num_kv_pairs:] != mqar.IGNORE)


def test_mqar_splits_are_deterministic_and_sized(tmp_path):
    cfg = MQARTaskConfig(**MQAR)
    sizes = {s: len(mqar_split(cfg, s, tmp_path)["inputs"]) for s in ("train", "validation", "test")}
    assert sizes == {"train": 200, "validation": 30, "test": 30}
    for name, value in mqar_split(cfg, "train", tmp_path / "b").items():
        assert np.array_equal(value, mqar_split(cfg, "train", tmp_path)[name])
    assert not np.array_equal(mqar_split(cfg, "validation", tmp_path)["inputs"],
                              mqar_split(cfg, "test", tmp_path)["inputs"])
    other = mqar_split(cfg.model_copy(update={"seed": 99}), "train", tmp_path)
    assert not np.array_equal(other["inputs"], mqar_split(cfg, "train", tmp_path)["inputs"])


def test_mqar_accuracy_counts_answer_positions_only(tmp_path):
    """A model that answers every query right scores 1.0 whatever it says elsewhere; one wrong value per
    example costs exactly 1 / num_kv_pairs."""
    cfg = MQARTaskConfig(**MQAR)
    task = build_task(cfg, _model(), WorkerContext(cache_dir=tmp_path))
    data = mqar_split(cfg, "validation", tmp_path)
    lookup = {tuple(row): i for i, row in enumerate(data["inputs"])}

    class Oracle(torch.nn.Module):
        def __init__(self, wrong: bool):
            super().__init__()
            self.wrong, self.w = wrong, torch.nn.Parameter(torch.zeros(1))

        def forward(self, tokens_BT, padding_mask=None, scored_N=None):
            out = []
            T = tokens_BT.shape[1]
            for row, row_tokens in enumerate(tokens_BT):
                i = lookup[tuple(row_tokens.tolist())]
                answers = mqar.targets(data["positions"][i:i + 1], data["answers"][i:i + 1], cfg.seq_len)[0]
                in_row = scored_N[(scored_N >= row * T) & (scored_N < (row + 1) * T)] - row * T
                wanted = answers[in_row.numpy()]
                if self.wrong:
                    wanted[0] = cfg.vocab_size - 1 - (wanted[0] - cfg.vocab_size // 2)  # another value
                out.append(F.one_hot(torch.as_tensor(wanted), cfg.vocab_size).float() * 20)
            return torch.cat(out) + self.w

    assert task.evaluate(Oracle(wrong=False))["val/acc"] == 1.0
    assert task.evaluate(Oracle(wrong=True))["val/acc"] == pytest.approx(1 - 1 / cfg.num_kv_pairs)


# --- byte-level LM ---------------------------------------------------------------------------------------------


def test_bits_per_byte_is_the_loss_over_ln2_of_every_byte_of_the_file(tmp_path):
    text = "The quick brown fox jumps over the lazy dog. Zwölf Boxkämpfer jagen Viktor.\n" * 2
    raw = text.encode("utf-8")
    (tmp_path / "train.txt").write_bytes(raw * 3)
    (tmp_path / "test.txt").write_bytes(raw)
    files = {"train": str(tmp_path / "train.txt"), "test": str(tmp_path / "test.txt")}
    model_cfg = _model(max_seq_len=256)
    for seq_len in (len(raw) + 1, 16):  # one block, and many blocks overlapping by one byte
        cfg = ByteLMTaskConfig(kind="bytelm", files=files, seq_len=seq_len, batch_size=4, eval_split="test")
        task = build_task(cfg, model_cfg, WorkerContext(cache_dir=tmp_path))
        torch.manual_seed(0)
        model = task.build_model().eval()
        metrics = task.evaluate(model)
        assert metrics["val/bpb"] == pytest.approx(metrics["val/loss"] / math.log(2), rel=1e-12)
        if seq_len > len(raw):  # the whole file in one block: every byte after the first is predicted once
            ids = torch.tensor(list(raw))
            with torch.no_grad():
                logits = model(ids[None, :-1])[0]
            direct = F.cross_entropy(logits.float(), ids[1:]).item()
            assert metrics["val/loss"] == pytest.approx(direct, rel=1e-5)
    assert task.vocab_size == 256


# --- errors and compatibility ----------------------------------------------------------------------------------


@pytest.mark.parametrize("task", [LISTOPS, MQAR], ids=["listops", "mqar"])
def test_a_sequence_longer_than_the_model_is_refused_naming_both_fields(task):
    with pytest.raises(ValueError, match=r"task.seq_len=\d+ exceeds model.max_seq_len=32"):
        check_compatible(ListOpsTaskConfig(**task) if task["kind"] == "listops" else MQARTaskConfig(**task),
                         _model(max_seq_len=32))


def test_bytelm_longer_than_the_model_is_refused(tmp_path):
    (tmp_path / "a.txt").write_text("abc")
    cfg = ByteLMTaskConfig(kind="bytelm", files={"train": str(tmp_path / "a.txt"),
                                                 "validation": str(tmp_path / "a.txt")}, seq_len=128)
    with pytest.raises(ValueError, match="task.seq_len=128 exceeds model.max_seq_len=64"):
        check_compatible(cfg, _model())


def test_pairs_that_do_not_fit_and_a_vocabulary_too_small_are_refused():
    with pytest.raises(ValueError, match=r"num_kv_pairs=17 does not fit task.seq_len=64.*>= 4 x num_kv_pairs = 68"):
        MQARTaskConfig(**{**MQAR, "num_kv_pairs": 17})
    with pytest.raises(ValueError, match=r"vocab_size=5 is too small for task.num_kv_pairs=2.*at least 6"):
        MQARTaskConfig(**{**MQAR, "vocab_size": 5, "seq_len": 8, "num_kv_pairs": 2})
    with pytest.raises(ValueError, match=r"vocab_size=64 must exceed task.seq_len=64 \(Zoology's bound\)"):
        MQARTaskConfig(**{**MQAR, "vocab_size": 64})
    MQARTaskConfig(**{**MQAR, "vocab_size": 65})
    with pytest.raises(ValueError, match=r"or set task.random_non_queries: false"):
        MQARTaskConfig(**{**MQAR, "vocab_size": 64, "random_non_queries": True})
    with pytest.raises(ValueError, match="must be even"):
        MQARTaskConfig(**{**MQAR, "seq_len": 63})
    with pytest.raises(ValueError, match="task.min_len=46 and task.seq_len=48 leave no expression length"):
        ListOpsTaskConfig(**{**LISTOPS, "min_len": 46})


def test_linformer_runs_the_encoder_tasks_and_is_refused_for_the_causal_ones(tmp_path):
    linformer = _model(kind="linformer")
    check_compatible(ListOpsTaskConfig(**LISTOPS), linformer)
    check_compatible(MQARTaskConfig(**MQAR), linformer)
    with pytest.raises(ValueError, match="cannot run causal attention, which task.kind='mqar' needs"):
        check_compatible(MQARTaskConfig(**MQAR, causal=True), linformer)
    (tmp_path / "a.txt").write_text("abc")
    cfg = ByteLMTaskConfig(kind="bytelm", files={"train": str(tmp_path / "a.txt"),
                                                 "validation": str(tmp_path / "a.txt")}, seq_len=32)
    with pytest.raises(ValueError, match="cannot run causal attention, which task.kind='bytelm' needs"):
        check_compatible(cfg, linformer)


def test_a_spec_with_a_bad_long_range_block_fails_validation_naming_the_field():
    spec = {"name": "lr", "task": {**MQAR, "num_kv_pairs": 100}, "model": {"max_seq_len": 64}}
    with pytest.raises(SpecError, match="task.num_kv_pairs=100 does not fit"):
        validate_spec(spec)
    spec = {"name": "lr", "task": MQAR, "model": {"max_seq_len": 32}, "tune": {"metric": "val/acc"}}
    with pytest.raises(SpecError, match="exceeds model.max_seq_len=32"):
        validate_spec(spec)


# --- every attention kind trains on them -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_every_attention_kind_takes_a_training_step_on_the_generated_tasks(kind, tmp_path):
    for task_block in (LISTOPS, {**MQAR, "causal": kind != "linformer"}):
        cfg = (ListOpsTaskConfig if task_block["kind"] == "listops" else MQARTaskConfig)(**task_block)
        task = build_task(cfg, _model(kind=kind), WorkerContext(cache_dir=tmp_path))
        torch.manual_seed(0)
        model = task.build_model()
        batch, _ = next(task.train_batches())
        loss = task.loss(model, batch)
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        assert 0.0 <= task.evaluate(model)["val/acc"] <= 1.0


# --- through the training core, a checkpoint, the final scoring and the export -----------------------------------


@pytest.mark.parametrize("task_block", [LISTOPS, {**MQAR, "causal": True}, "bytes"], ids=["listops", "mqar", "bytelm"])
def test_a_trained_long_range_run_scores_its_checkpoint_and_exports_a_model_that_predicts_the_same(task_block,
                                                                                                   tmp_path):
    if task_block == "bytes":
        (tmp_path / "a.txt").write_bytes(b"abcabcabd, long range?\n" * 20)
        task_block = {"kind": "bytelm", "files": {"train": str(tmp_path / "a.txt"), "test": str(tmp_path / "a.txt")},
                      "eval_split": "test", "seq_len": 32, "batch_size": 4}
    spec = validate_spec({"name": "lr", "task": task_block, "model": _model().model_dump(),
                          "optim": {"max_steps": 4, "warmup_steps": 1},
                          "run": {"eval_every": 2, "checkpoint_every": 4, "storage_path": str(tmp_path / "runs")},
                          "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"}})
    trainer, hooks = train_locally(spec, cache_dir=tmp_path / "cache", folder=tmp_path / "ckpt")
    assert [step for step, m in hooks.history if spec.tune.metric in m] == [2, 4]
    split = "test"
    scored = evaluate_checkpoint(latest_checkpoint(tmp_path / "ckpt"), split, cache_dir=tmp_path / "cache",
                                 out_dir=tmp_path / "out", device=torch.device("cpu"), export=True)
    metric = spec.tune.metric.replace("val/", f"{split}/")
    assert np.isfinite(scored.metrics[metric])
    exported = load_model(scored.files["model"])
    model = trainer.model.eval()
    batch, _ = next(trainer.task.train_batches())
    t = batch.tensors
    with torch.no_grad():
        assert torch.equal(exported(t["tokens"], t.get("padding_mask")), model(t["tokens"], t.get("padding_mask")))
