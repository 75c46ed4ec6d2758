"""Transformer-XL: relative attention (models/attention/relative.py) and segment-level recurrence
(model.memory; models/transformer.py, tasks/recurrence.py), checked against the paper's formula, against
full-context attention, and through the training core's checkpoint and resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from models import LanguageModel, ModelConfig
from models.attention.registry import RELATIVE_KINDS
from models.attention.relative import RelativeBiases, RelativeMechanism, relative_sinusoids
from orchestrator.launch.local_run import latest_checkpoint, train_locally
from orchestrator.spec import SpecError, validate_spec
from orchestrator.training.checkpoint import read_checkpoint
from orchestrator.training.scoring import evaluate_checkpoint
from orchestrator.training.trainer import Trainer
from tasks import WorkerContext, build_task
from tasks.recurrence import covering_rows
from tests.local_training import FailAtStep3

VOCAB = 50


def xl_model(kind: str = "mha", mem_len: int | None = 64, layers: int = 2, seed: int = 0,
             **attention) -> LanguageModel:
    """A float64 model without dropout, its u and v made large so that every term weighs in the logits."""
    torch.manual_seed(seed)
    heads = {"attention": {"kind": kind, "heads": 2, **attention}}
    cfg = ModelConfig(d_model=16, layers=layers, ffn=32, dropout=0.0, max_seq_len=64, positional="relative",
                      memory=None if mem_len is None else {"mem_len": mem_len}, **heads)
    model = LanguageModel(cfg, VOCAB, causal=True).double().eval()
    with torch.no_grad():
        for p in model.shared_state.parameters():
            p.normal_()
    return model


def by_segments(model: LanguageModel, tokens_BT: torch.Tensor, seg_len: int) -> torch.Tensor:
    memory = model.empty_memory(tokens_BT.shape[0], tokens_BT.device)
    logits = []
    for start in range(0, tokens_BT.shape[1], seg_len):
        logits_BTV, memory = model(tokens_BT[:, start:start + seg_len], memory=memory)
        logits.append(logits_BTV)
    return torch.cat(logits, dim=1)


# --- relative attention against the paper's formula -------------------------------------------------------


def paper_relative_attention(mech: RelativeMechanism, q_BHTE, k_BHSE, v_BHSE) -> torch.Tensor:
    """Sec. 3.3 written out pair by pair: A_ij = (q_i + u).k_j + (q_i + v).W_R R_{i-j}, query i at stream
    position M + i (M = S - T cached keys first), softmax over j <= M + i, no rel-shift involved."""
    B, H, T, E = q_BHTE.shape
    S = k_BHSE.shape[2]
    M = S - T
    u_HE, v_HE = mech._biases.u_HE, mech._biases.v_HE
    out = torch.zeros_like(q_BHTE)
    for i in range(T):
        keys = range(M + i + 1)
        distances = torch.tensor([float(M + i - j) for j in keys], dtype=q_BHTE.dtype)
        wr_HJE = mech.w_r(relative_sinusoids(distances, mech.d_model)).view(len(keys), H, E).transpose(0, 1)
        content_BHJ = torch.einsum("bhe,bhje->bhj", q_BHTE[:, :, i] + u_HE, k_BHSE[:, :, : M + i + 1])
        position_BHJ = torch.einsum("bhe,hje->bhj", q_BHTE[:, :, i] + v_HE, wr_HJE)
        p_BHJ = torch.softmax((content_BHJ + position_BHJ) / E**0.5, dim=-1)
        out[:, :, i] = torch.einsum("bhj,bhje->bhe", p_BHJ, v_BHSE[:, :, : M + i + 1])
    return out


def relative_mechanism(d_model: int = 12, heads: int = 3, seed: int = 0) -> RelativeMechanism:
    torch.manual_seed(seed)
    biases = RelativeBiases(heads, d_model // heads)
    with torch.no_grad():
        biases.u_HE.normal_()
        biases.v_HE.normal_()
    mech = RelativeMechanism(d_model, heads, d_model // heads, biases).double()
    biases.double()
    return mech


@pytest.mark.parametrize("memory", [0, 5], ids=["no-memory", "memory"])
def test_relative_mechanism_is_the_papers_formula(memory):
    mech = relative_mechanism()
    B, H, T, E = 2, 3, 7, 4
    S = T + memory
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, n, E, generator=g, dtype=torch.float64) for n in (T, S, S))
    torch.testing.assert_close(mech(q, k, v, causal=True), paper_relative_attention(mech, q, k, v),
                               rtol=1e-12, atol=1e-12)


def test_relative_sinusoids_are_sin_then_cos_halves():
    """R_d = [sin(d f_0), ..., sin(d f_{D/2-1}), cos(d f_0), ...] with f_k = 10000^(-2k/D) (the reference's
    PositionalEmbedding), not interleaved."""
    r = relative_sinusoids(torch.tensor([3.0], dtype=torch.float64), 4)[0]
    f = torch.tensor([1.0, 10000 ** -0.5], dtype=torch.float64)
    torch.testing.assert_close(r, torch.cat([(3 * f).sin(), (3 * f).cos()]))


def test_relative_attention_depends_on_distances_only():
    """The same queries and keys placed `shift` positions later (behind masked-out keys) give the same output;
    with absolute positions they would not."""
    mech = relative_mechanism()
    B, H, T, E, shift = 2, 3, 6, 4, 5
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, T, E, generator=g, dtype=torch.float64) for _ in range(3))
    k_far, v_far = (torch.cat([torch.randn(B, H, shift, E, generator=g, dtype=torch.float64), x], dim=2)
                    for x in (k, v))
    hidden_BS = torch.zeros(B, shift + T, dtype=torch.bool)
    hidden_BS[:, :shift] = True
    far = mech(q, k_far, v_far, key_padding_mask_BS=hidden_BS, causal=True)
    torch.testing.assert_close(far, mech(q, k, v, causal=True), rtol=1e-12, atol=1e-12)


# --- recurrence: memory equals full context, carries no gradient, leaks no future -------------------------


@pytest.mark.parametrize("kind", RELATIVE_KINDS)
def test_segments_with_covering_memory_equal_full_context(kind):
    model = xl_model(kind, mem_len=64)
    tokens = torch.randint(0, VOCAB, (3, 24), generator=torch.Generator().manual_seed(3))
    full = model(tokens)
    torch.testing.assert_close(by_segments(model, tokens, 8), full, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(by_segments(model, tokens, 5), full, rtol=1e-10, atol=1e-10)  # a short last one


def test_memory_keeps_the_last_mem_len_states_of_each_layer_input():
    model = xl_model(mem_len=6)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(4))
    _, memory = model(tokens[:, :4], memory=model.empty_memory(2, tokens.device))
    assert [m.shape[1] for m in memory] == [4, 4]
    _, memory = model(tokens[:, 4:], memory=memory)
    assert [m.shape[1] for m in memory] == [6, 6]
    # layer 0's memory is the embedded input of the last 6 tokens, in stream order
    torch.testing.assert_close(memory[0], model.embed(tokens)[:, 2:], rtol=0, atol=0)


def test_no_gradient_flows_into_the_memory():
    model = xl_model(mem_len=8).train()
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
    _, memory = model(tokens[:, :8], memory=model.empty_memory(2, tokens.device))
    assert all(m.grad_fn is None and not m.requires_grad for m in memory)

    def grads(mem):
        model.zero_grad()
        logits, _ = model(tokens[:, 8:], memory=mem)
        logits.square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    carried = grads(memory)
    fresh = grads([m.clone() for m in memory])  # the same values, certainly cut from segment 1's graph
    assert carried.keys() == fresh.keys()
    for name in carried:
        torch.testing.assert_close(carried[name], fresh[name], rtol=0, atol=0, msg=name)


def test_causal_in_value_across_the_memory():
    model = xl_model(mem_len=8)
    g = torch.Generator().manual_seed(6)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=g)
    logits = by_segments(model, tokens, 8)
    for i in (3, 8, 11):  # in the first segment, the first of the second, inside the second
        later = tokens.clone()
        later[:, i + 1:] = torch.randint(0, VOCAB, later[:, i + 1:].shape, generator=g)
        torch.testing.assert_close(by_segments(model, later, 8)[:, : i + 1], logits[:, : i + 1], rtol=0, atol=0)
    earlier = tokens.clone()
    earlier[:, 2] = (earlier[:, 2] + 1) % VOCAB
    assert not torch.allclose(by_segments(model, earlier, 8)[:, 8:], logits[:, 8:])  # the memory is read


# --- the task: ordered rows, training loss with memory, exact resume ---------------------------------------


def tiny_raw(name: str = "txl", mem_len: int = 16, **model) -> dict:
    return {
        "name": name,
        "task": {"kind": "clm", "seq_len": 16, "batch_size": 4, "vocab_size": 120,
                 "builtin": {"train_sentences": 200, "eval_sentences": 20}},
        "model": {"d_model": 16, "layers": 2, "ffn": 32, "max_seq_len": 16, "dropout": 0.1,
                  "positional": "relative", "memory": {"mem_len": mem_len},
                  "attention": {"kind": "mha", "heads": 2}, **model},
        "optim": {"lr": 3e-3, "max_steps": 6, "warmup_steps": 1, "seed": 3},
        "run": {"checkpoint_every": 2, "eval_every": 2, "log_every": 1},
    }


def test_training_segments_continue_each_row_of_the_stream(tmp_path):
    spec = validate_spec(tiny_raw())
    task = build_task(spec.task, spec.model, WorkerContext(seed=0, cache_dir=tmp_path))
    stream, rows = task.train_stream, task.train_rows
    n = len(stream) // 4
    np.testing.assert_array_equal(rows, stream[: 4 * n].reshape(4, n))  # contiguous rows, in stream order
    batches = task.train_batches()
    (b0, _), (b1, after) = next(batches), next(batches)
    assert after == {"epoch": 0, "step": 2}
    # The segment id is host metadata that survives the copy to the device: read as a device tensor, it would
    # sync the host every step.
    assert (b0.segment, b1.segment, b1.to(torch.device("cpu")).segment) == ((0, 0), (0, 1), (0, 1))
    assert set(b1.tensors) == {"tokens", "targets"}
    for row in range(4):
        np.testing.assert_array_equal(b0.tensors["tokens"][row].numpy(), rows[row, 0:16])
        np.testing.assert_array_equal(b1.tensors["tokens"][row].numpy(), rows[row, 16:32])
        np.testing.assert_array_equal(b1.tensors["targets"][row].numpy(), rows[row, 17:33])


def test_task_loss_with_memory_is_the_full_context_loss(tmp_path):
    """Two steps of the task's loss (memory carried between them) score the second segment exactly as the
    model scores it with both segments as one context."""
    spec = validate_spec(tiny_raw(mem_len=16, dropout=0.0, max_seq_len=32))
    task = build_task(spec.task, spec.model, WorkerContext(seed=0, cache_dir=tmp_path))
    torch.manual_seed(0)
    model = task.build_model().double().eval()
    batches = task.train_batches()
    task.loss(model, next(batches)[0])
    second = task.loss(model, next(batches)[0])
    rows = torch.from_numpy(np.asarray(task.train_rows))
    logits = model(rows[:, :32])[:, 16:]
    expected = nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 17:33].flatten())
    torch.testing.assert_close(second.double(), expected, rtol=1e-6, atol=1e-6)  # the task's loss is float32


def test_resume_continues_with_the_same_memory(tmp_path):
    spec = validate_spec(tiny_raw())
    _, reference = train_locally(spec, cache_dir=tmp_path / "cache")

    folder = tmp_path / "ckpt"
    trainer = Trainer.create(spec, WorkerContext(seed=spec.optim.seed, cache_dir=tmp_path / "cache"))
    with pytest.raises(RuntimeError, match="injected"):
        trainer.fit(FailAtStep3(spec, folder))
    state = read_checkpoint(latest_checkpoint(folder))
    assert state.step == 2 and state.stream_states[0]["after"] == [0, 1]
    assert [m.shape for m in state.stream_states[0]["states"]] == [torch.Size([4, 16, 16])] * 2

    _, resumed = train_locally(spec, cache_dir=tmp_path / "cache", folder=folder)
    expected = {step: m for step, m in reference.history if step > 2}
    got = {step: m for step, m in resumed.history}
    assert got.keys() == expected.keys()
    for step in expected:
        for key in ("train/loss", "val/loss"):
            if key in expected[step]:
                assert got[step][key] == expected[step][key], (step, key)


def test_a_memory_that_does_not_precede_the_segment_is_refused(tmp_path):
    spec = validate_spec(tiny_raw())
    task = build_task(spec.task, spec.model, WorkerContext(seed=0, cache_dir=tmp_path))
    model = task.build_model()
    batches = task.train_batches({"epoch": 0, "step": 1})  # resumed without the memory
    with pytest.raises(RuntimeError, match="needs the memory of segment 0"):
        task.loss(model, next(batches)[0])


def test_evaluation_with_memory_scores_every_target_once(tmp_path):
    spec = validate_spec(tiny_raw(dropout=0.0))
    task = build_task(spec.task, spec.model, WorkerContext(seed=0, cache_dir=tmp_path))
    torch.manual_seed(0)
    model = task.build_model()
    scored = []
    original = nn.functional.cross_entropy

    def counting(logits, targets, **kw):
        scored.append(int((targets != -100).sum()))
        return original(logits, targets, **kw)

    nn.functional.cross_entropy = counting
    try:
        metrics = task.evaluate(model)
    finally:
        nn.functional.cross_entropy = original
    assert sum(scored) == len(task.eval_stream) - 1
    assert np.isfinite(metrics["val/ppl"])


def test_evaluation_with_covering_memory_is_each_rows_full_context_loss(tmp_path):
    """Segments of the evaluation rows, memory carried, score each target as the model does with its whole
    row as context; the rows partition the split's targets."""
    spec = validate_spec(tiny_raw(mem_len=256, dropout=0.0, max_seq_len=256))
    task = build_task(spec.task, spec.model, WorkerContext(seed=0, cache_dir=tmp_path))
    torch.manual_seed(0)
    model = task.build_model().double()
    rows, lengths = covering_rows(task.eval_stream, spec.task.batch_size)
    assert rows.shape[1] <= 256 and lengths.sum() - len(lengths) == len(task.eval_stream) - 1
    total = 0.0
    for row, n in zip(rows, lengths):
        tokens = torch.from_numpy(row[:n])[None]
        with torch.no_grad():
            logits = model.eval()(tokens[:, :-1])
        total += float(nn.functional.cross_entropy(logits[0], tokens[0, 1:], reduction="sum"))
    expected = total / (len(task.eval_stream) - 1)
    assert task.evaluate(model)["val/loss"] == pytest.approx(expected, rel=1e-6)


# --- spec errors before anything runs ---------------------------------------------------------------------


@pytest.mark.parametrize("task, model, message", [
    ({"kind": "mlm"}, {"positional": "relative", "memory": {"mem_len": 8}}, "model.memory requires a causal LM task"),
    ({"kind": "mlm"}, {"positional": "relative"}, "model.positional: relative requires a causal LM task"),
    ({"kind": "translation", "max_source_len": 16}, {"positional": "relative"},
     "model.positional: relative requires a causal LM task"),
    ({}, {"positional": "relative", "attention": {"kind": "lsh", "heads": 2}},
     "positional: relative is supported with attention kinds"),
    ({}, {"positional": "relative", "attention": {"kind": "hyper", "heads": 2}}, "got hyper"),
    ({}, {"positional": "relative", "attention": {"kind": "linformer", "heads": 2, "k": 8}}, "got linformer"),
    ({}, {"positional": "relative", "attention": {"kind": "mha", "heads": 2, "mechanism": {"kind": "linformer", "k": 8}}},
     "mechanism.kind=linformer"),
    ({}, {"positional": "sinusoidal", "memory": {"mem_len": 8}}, "requires model.positional: relative"),
    ({}, {"positional": "relative", "reversible": True}, "model.reversible=true is not supported"),
    ({}, {"positional": "relative", "memory": {"mem_len": -1}}, "mem_len must be >= 0"),
], ids=["memory-mlm", "relative-mlm", "relative-translation", "lsh", "hyper", "linformer", "mechanism", "absolute-memory",
        "reversible", "negative"])
def test_unsupported_combinations_fail_at_validation(task, model, message):
    raw = tiny_raw()
    if task.get("kind") == "translation":
        raw["task"] = {"builtin": raw["task"]["builtin"], "max_tokens": 64, **task}
    else:
        raw["task"] = {**raw["task"], **task}
    raw["model"] = {k: v for k, v in raw["model"].items() if k not in ("positional", "memory")} | model
    with pytest.raises(SpecError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate_spec(raw)


def test_mem_len_zero_keeps_the_segment_order_with_absolute_positions():
    spec = validate_spec(tiny_raw(mem_len=0, positional="sinusoidal"))
    assert spec.model.memory.mem_len == 0


def test_a_checkpoint_scores_with_another_mem_len(tmp_path):
    """evaluate_checkpoint's model_update (benchmarks/methods/memory_swap.py) scores the same weights with another
    memory: the result equals the task built with that mem_len, and differs from the run's own memory."""
    spec = validate_spec(tiny_raw())
    folder = tmp_path / "ckpt"
    train_locally(spec, cache_dir=tmp_path / "cache", folder=folder)
    checkpoint = latest_checkpoint(folder)
    no_memory = spec.model.memory.model_copy(update={"mem_len": 0})

    def score(**update) -> float:
        return evaluate_checkpoint(checkpoint, "validation", cache_dir=tmp_path / "cache", out_dir=tmp_path / "out",
                                   device=torch.device("cpu"), model_update=update or None).metrics["validation/loss"]

    swapped = score(memory=no_memory)
    model_cfg = spec.model.model_copy(update={"memory": no_memory})
    task = build_task(spec.task, model_cfg, WorkerContext(seed=spec.optim.seed, cache_dir=tmp_path / "cache"))
    model = task.build_model()
    model.load_state_dict(read_checkpoint(checkpoint).model)
    assert swapped == pytest.approx(task.evaluate(model)["val/loss"], rel=1e-6)
    assert abs(swapped - score()) > 1e-5  # the memory is really swapped, not ignored
