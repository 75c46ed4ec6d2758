"""`orchestrator plan` (orchestrator/spec/plan.py, counting.py): FLOPs and memory counted on fake tensors against
real CPU runs, depth probes against whole models, the table, and the refusal of a trial that cannot fit its GPU."""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import pytest
import torch
import yaml

from benchmarks.gpu.training import matmul_parameters, step_flops
from benchmarks.harness import peak_memory_bytes
from models.attention import ATTENTION_KINDS
from orchestrator.cli import main
from orchestrator.spec import gpu_kind, validate_spec, workload
from orchestrator.spec.counting import StepCount, Workload, count_step
from orchestrator.spec.models import ExperimentSpec
from orchestrator.spec.plan import GIB

ANALYTIC_MARGIN = 0.05
"""6 N + 12 L d n leaves out the norms, softmax and loss (elementwise, uncounted by FlopCounterMode too) and counts
attention over the full n x n; the counter's total may differ by the bias-free remainder only."""
MEMORY_MARGIN = 0.20


def _spec(kind: str, d_model: int = 32, seq_len: int = 32, batch: int = 2, checkpointing: bool = False,
          layers: int = 1):
    # Knobs that fit sequences of seq_len (the spec check refuses larger ones): Linformer's k and LSH's chunk at most
    # seq_len; hyper with min_seq_len = seq_len, at which a causal LM still runs exact attention (what is counted).
    knobs = {"linformer": {"k": seq_len // 2}, "lsh": {"bucket_size": min(64, seq_len)},
             "hyper": {"min_seq_len": seq_len, "block_size": seq_len}}.get(kind, {})
    attention = {"kind": kind, "heads": 4, **knobs}
    # linformer mixes future positions: a masked LM, as its paper trains it.
    task_kind = "mlm" if kind == "linformer" else "clm"
    return validate_spec({
        "name": "plan-test",
        "task": {"kind": task_kind, "dataset": "builtin", "vocab_size": 256, "seq_len": seq_len, "batch_size": batch},
        "model": {"d_model": d_model, "layers": layers, "ffn": 2 * d_model, "max_seq_len": seq_len, "dropout": 0.0,
                  "attention": attention},
        "run": {"activation_checkpointing": checkpointing},
    })


class _FakeCounts:
    """`count_step` on fake tensors, once per (spec, checkpointing) in this module. The fake-vs-real, memory and
    depth tests count the same small models: the depth probes of `_spec(kind, layers=4)` are `_spec(kind, layers=1)`
    and `_spec(kind, layers=2)`, which the fake-vs-real test and the d_model = 32 memory cases count too. A fake count
    is a function of the spec alone (seeded, no values read), and the spec's JSON is everything `workload` builds
    from. Counts on real CPU tensors, the other side of each comparison, are never shared."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, bool], StepCount] = {}
        self._made: dict[int, tuple[Workload, ExperimentSpec]] = {}

    def step(self, spec: ExperimentSpec, checkpointing: bool = False) -> StepCount:
        key = (spec.model_dump_json(), checkpointing)
        if key not in self._counts:
            self._counts[key] = count_step(workload(spec), checkpointing=checkpointing)
        return self._counts[key]

    def workload(self, spec: ExperimentSpec) -> Workload:
        """`workload(spec)`, remembering the spec it was built from: count_by_depth builds its probes' workloads
        itself, and `spec_of` finds their specs, so their counts are shared too."""
        work = workload(spec)
        self._made[id(work)] = (work, spec)  # the workload is kept, so its id is not reused
        return work

    def spec_of(self, work: Workload) -> ExperimentSpec:
        return self._made[id(work)][1]


@pytest.fixture(scope="module")
def fake_counts():
    return _FakeCounts()


@pytest.mark.parametrize("kind", ATTENTION_KINDS)
def test_fake_tensor_flops_equal_a_real_cpu_run(kind, fake_counts):
    spec = _spec(kind)
    fake, real = fake_counts.step(spec), count_step(workload(spec), fake=False)
    assert fake.flops == real.flops > 0
    assert fake.params_total == real.params_total


def _txl_spec(mem_len: int) -> ExperimentSpec:
    return validate_spec({
        "name": "plan-txl", "task": {"kind": "clm", "dataset": "builtin", "vocab_size": 256, "seq_len": 32,
                                     "batch_size": 2},
        "model": {"d_model": 32, "layers": 2, "ffn": 64, "max_seq_len": 32, "dropout": 0.0, "positional": "relative",
                  "attention": {"kind": "mha", "heads": 4}, "memory": {"mem_len": mem_len}},
    })


def test_a_transformer_xl_step_is_counted_with_its_cache_of_mem_len_states():
    """model.memory: the counted step is a steady-state segment, attending to mem_len cached states per layer (a
    plan that ignored the cache said 'fits, 0.16 GB' for mem_len 10,000,000 as for 64)."""
    none, cached = count_step(workload(_txl_spec(0))), count_step(workload(_txl_spec(32)))
    assert cached.flops == count_step(workload(_txl_spec(32)), fake=False).flops  # fake tensors count a real run
    # Each layer's scores and weighted values over the 32 extra keys, forward and backward (x3): a lower bound,
    # since the cache also goes through the key and value projections and the relative-position terms.
    B, T, M, D, L = 2, 32, 32, 32, 2
    assert cached.flops - none.flops >= 3 * 4 * B * T * M * D * L
    assert cached.peak_bytes - none.peak_bytes >= L * B * M * D * 4  # the cache itself, fp32


def test_a_cache_too_large_for_the_gpu_is_said_with_the_mem_len_that_fits_a_segment():
    from orchestrator.spec.plan import plan_spec

    huge = plan_spec(_txl_spec(10_000_000), gpu_kind("H100"))
    assert not huge.fits  # 75 GiB at these tiny sizes (d_model 32, batch 2): the cache and its scores
    assert "model.memory.mem_len=32 (each layer's cache and the attention over it grow with mem_len=10000000)" in \
        huge.fixes


def test_mha_flops_match_six_n_plus_attention(fake_counts):
    # d_model = seq_len = 32, the memory and depth tests' size, whose count they share (attention is 10% of it).
    spec = _spec("mha", d_model=32, seq_len=32, batch=2, layers=2)
    work = workload(spec)
    counted = fake_counts.step(spec).flops
    analytic = step_flops(matmul_parameters(work.build()), 2, 32, 32, work.tokens)
    assert abs(counted - analytic) / analytic < ANALYTIC_MARGIN, (counted, analytic)


# In the slow tier: d_model = seq_len = 64, the same path at a larger size (weights 4x, attention logits 4x, logits
# 2x), and hyper, which up to its min_seq_len (seq_len in _spec) is exact attention: mha's ops and peak plus a buffer
# of hyperplanes. The fast tier keeps mha, linformer and lsh with and without checkpointing at 32, the depth probes'
# size, so their counts are shared with the depth test (_FakeCounts).
MEMORY_CASES = [pytest.param(kind, size, ac, id=f"{kind}-d{size}-{'ac' if ac else 'noac'}",
                             marks=pytest.mark.slow if size == 64 or kind == "hyper" else ())
                for kind in ("mha", "linformer", "lsh", "hyper") for size in (32, 64) for ac in (False, True)]


@pytest.mark.parametrize("kind,size,checkpointing", MEMORY_CASES)
def test_memory_estimate_within_20_percent_of_the_cpu_peak(kind, size, checkpointing, fake_counts):
    from models import checkpoint_activations

    spec = _spec(kind, d_model=size, seq_len=size, batch=2, checkpointing=checkpointing, layers=2)
    work = workload(spec)
    estimate = fake_counts.step(spec, checkpointing).peak_bytes
    torch.manual_seed(0)
    model = work.build().train()
    if checkpointing:
        checkpoint_activations(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    held = sum(p.numel() * p.element_size() for p in model.parameters())

    def two_steps() -> None:
        for _ in range(2):
            work.loss(model, work.inputs(work.batch)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    layout = contextlib.nullcontext()
    if kind == "lsh":
        # Planned at its longest layout (models/attention/lsh.py bounded_layout), so the estimate is compared with
        # that layout's measured peak, and must not fall below the peak of the layout these hashes make.
        from models.attention.lsh import bounded_layout

        sized = held + peak_memory_bytes(two_steps, torch.device("cpu"))
        assert estimate >= sized, (estimate, sized)
        layout = bounded_layout()
    with layout:
        measured = held + peak_memory_bytes(two_steps, torch.device("cpu"))
    assert abs(estimate - measured) / measured <= MEMORY_MARGIN, (estimate, measured)


# In the slow tier: hyper, which up to its min_seq_len (seq_len in _spec) is exact attention, so at these lengths its
# layers run mha's ops (plus a buffer of hyperplanes) and mha-noac proves what it would; and mha-ac, whose checkpointed
# probes linformer-ac runs too (mha's projections with Linformer's mechanism; the case nearest the 10% margin).
SLOW_DEPTH_CASES = (("mha", True), ("hyper", False))
DEPTH_CASES = [pytest.param(kind, ac, id=f"{kind}-{'ac' if ac else 'noac'}",
                            marks=pytest.mark.slow if (kind, ac) in SLOW_DEPTH_CASES else ())
               for kind, ac in (("mha", False), ("mha", True), ("mhe", False), ("linformer", True), ("lsh", False),
                                ("hyper", False))]
DEPTH_AC_MARGIN = 0.10
"""With activation checkpointing the peak is the layers' saved inputs plus one layer's recomputation, reached at a
different point of the step at depth 1 than deeper down: probes at depths 1 and 2 came within 6% of the whole
model at depth 4 or 5 for every kind (mha 0.97, linformer 0.94)."""


@pytest.mark.parametrize("kind,checkpointing", DEPTH_CASES)
def test_depth_probes_count_what_the_whole_model_counts(kind, checkpointing, fake_counts, monkeypatch):
    """A 4-layer model counted through its depth probes (orchestrator.spec.counting.depth_probes) against the whole
    model: FLOPs from 0 and 1 layers and from 1 and 2 layers exactly, parameters exactly, the memory peak exactly
    without checkpointing (LSH's per-layer hashes vary its temporaries a little) and within 10% with it."""
    from orchestrator.spec import counting
    from orchestrator.spec.counting import count_by_depth, count_flops

    spec = _spec(kind, layers=4, checkpointing=checkpointing)
    whole = fake_counts.step(spec, checkpointing)
    with monkeypatch.context() as patched:
        # The probes' workloads, as count_by_depth builds them, are counted through the module's shared counts.
        patched.setattr(counting, "workload", fake_counts.workload)
        probed = count_by_depth(spec, lambda work: fake_counts.step(fake_counts.spec_of(work), checkpointing))
    assert probed.flops == whole.flops
    # No recomputation: MFU's FLOPs. Without checkpointing they are the whole step's count above (count_flops runs
    # count_step's counter and step); with it the step recomputes the forward, so the whole model is counted again.
    unrecomputed = count_flops(workload(spec)) if checkpointing else whole.flops
    assert count_by_depth(spec, count_flops, start=0) == unrecomputed
    assert (probed.params_total, probed.params_attention) == (whole.params_total, whole.params_attention)
    margin = DEPTH_AC_MARGIN if checkpointing else (0.01 if kind == "lsh" else 0.0)
    assert abs(probed.peak_bytes - whole.peak_bytes) <= margin * whole.peak_bytes, (probed, whole)


def test_depth_probes_of_a_translation_model_take_each_stack_on_its_own():
    """Encoder and decoder layers differ (cross-attention): 6 encoder and 3 decoder layers from probes (1, 1),
    (2, 1), (1, 2), exactly. Nine layers are the fewest the probes' eight save anything on; the stacks' depths
    differ, so their probes' weights do (a probe given the other stack's weight fails)."""
    from orchestrator.spec.counting import count_by_depth, count_flops, depth_probes

    spec = validate_spec({"name": "plan-test", "task": {"kind": "translation", "dataset": "builtin", "vocab_size": 256,
                                                         "max_source_len": 16, "max_tokens": 64},
                          "model": {"d_model": 32, "layers": 6, "decoder_layers": 3, "ffn": 64, "max_seq_len": 16,
                                    "dropout": 0.0, "attention": {"kind": "mha", "heads": 4}}})
    probes = depth_probes(spec, 1)
    assert [(s.model.layers, s.model.decoder_layers) for s in probes.specs] == [(1, 1), (2, 1), (1, 2)]
    assert probes.weights == (-6, 5, 2)
    whole = count_step(workload(spec))
    assert count_by_depth(spec, count_step) == whole
    assert count_by_depth(spec, count_flops, start=0) == whole.flops


def test_depth_probes_are_skipped_where_they_save_nothing_or_layers_differ():
    from orchestrator.spec.counting import depth_probes

    assert depth_probes(_spec("mha", layers=3), 1) is None  # 1 + 2 layers: the whole model is as cheap
    assert depth_probes(_spec("mha", layers=2), 0) is not None  # 0 + 1 layers
    per_layer = _spec("linformer", layers=4).model_dump(mode="json")
    per_layer["model"]["attention"]["k"] = [8, 8, 16, 16]
    assert depth_probes(validate_spec(per_layer), 1) is None


@pytest.mark.parametrize("kind", ["mha", "lsh"])
def test_reversible_models_are_counted(kind, tmp_path):
    """RevNet blocks recompute their inputs with torch.autograd.grad inside the backward, where the counter's module
    tracker cannot follow (a reversible run's worker failed when it counted its FLOPs): fake and real counts agree,
    and flops_per_token divides that count by the batch's positions."""
    from orchestrator.spec.counting import flops_per_token
    from orchestrator.spec.vocabulary import counted_spec

    # Two layers: the backward rebuilds the second block's inputs and then the first's, and flops_per_token still
    # extrapolates from depth probes (0 and 1 layers, weights -1 and 2).
    raw = _spec(kind, layers=2).model_dump(mode="json")
    raw["model"]["reversible"] = True
    raw["run"]["storage_path"] = str(tmp_path)  # where the builtin corpus's tokenizer is trained
    spec = counted_spec(validate_spec(raw))[0]  # at the run's vocabulary, as flops_per_token counts it
    work = workload(spec)
    fake, real = count_step(work), count_step(work, fake=False)
    assert fake.flops == real.flops > 0
    assert flops_per_token(spec) == fake.flops / work.tokens


def test_counting_leaves_every_random_stream_of_the_process_as_it_was(monkeypatch, tmp_path):
    """A Train worker counts its FLOPs per token after seeding or restoring its run's streams: the count must give
    the host's generator back and reseed no device's (torch.manual_seed reseeds every CUDA generator too, which
    fork_rng(devices=[]) does not restore: rank 0 of a GPU run drew its dropout from seed 0, and a resumed run lost
    its restored CUDA stream). The CPU build's device seeding functions are recorded instead of run."""
    from orchestrator.spec.counting import flops_per_token

    reseeded = []
    for module in (torch.cuda, torch.mps, torch.xpu):
        for name in ("manual_seed", "manual_seed_all"):
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda seed, _at=f"{module.__name__}.{name}": reseeded.append(_at))
    torch.default_generator.manual_seed(1234)
    expected = torch.rand(4)
    torch.default_generator.manual_seed(1234)
    raw = _spec("mha").model_dump(mode="json")
    raw["run"]["storage_path"] = str(tmp_path)  # its builtin corpus's tokenizer is trained there, not in ./runs
    assert flops_per_token(validate_spec(raw)) > 0  # the worker's count
    count_step(workload(_spec("lsh")))  # plan's
    assert reseeded == [], f"the count reseeded {reseeded}"
    assert torch.equal(torch.rand(4), expected), "the count moved the host's generator"


def test_plan_prints_a_row_per_trial_and_the_study_total(tmp_path, capsys):
    # storage in tmp_path: plan trains the builtin corpus's tokenizer into the runs' cache (test_plan_vocabulary.py)
    assert main(["plan", "configs/smoke.yaml", f"run.storage_path={tmp_path}"]) == 0
    out = capsys.readouterr().out
    assert out.count("kind=") == 3 and "study: 3 trials" in out and "GPU-hours on H100" in out


def test_plan_rows_keep_whole_labels_and_aligned_columns(tmp_path, capsys):
    # Labels were cut at 48 characters: trials that differ past that printed as the same trial.
    block = "{kind: mhe, heads: 4, mode: mul, init_std: %s}"
    blocks = f"{{grid: [{block % 0.02}, {block % 0.01}]}}"
    assert main(["plan", "configs/smoke.yaml", f"run.storage_path={tmp_path}", f"model.attention={blocks}"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("trial ", "attention="))]
    assert [row.split()[3] for row in rows[1:]] == ["init_std=0.02", "init_std=0.01"], rows
    assert len({len(row) for row in rows}) == 1, rows  # every column right-aligned under its header


def _too_big(tmp_path, gpus: float) -> str:
    path = tmp_path / "big.yaml"
    path.write_text(yaml.safe_dump({
        "name": "big",
        "task": {"kind": "clm", "dataset": "builtin", "vocab_size": 1000, "seq_len": 16384, "batch_size": 64},
        "model": {"d_model": 8192, "layers": 1, "ffn": 8192, "max_seq_len": 16384, "attention": {"kind": "mha",
                                                                                                "heads": 64}},
        "run": {"gpus_per_worker": gpus, "storage_path": str(tmp_path / "runs")},
    }))
    return str(path)


def test_plan_refuses_a_trial_that_cannot_fit_and_names_the_fixes(tmp_path, capsys):
    assert main(["plan", _too_big(tmp_path, 0), "--gpu", "L4"]) == 2
    err = capsys.readouterr().err
    for fix in ("task.batch_size=32 optim.grad_accum=2", "run.activation_checkpointing=true",
                "model.reversible=true", "run.strategy=fsdp"):
        assert fix in err, err


def test_validate_refuses_a_gpu_trial_that_cannot_fit(tmp_path, capsys):
    assert main(["validate", _too_big(tmp_path, 1), "--gpu", "L4"]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and "L4" in err and "run.activation_checkpointing=true" in err


def test_a_run_that_shares_its_gpu_must_fit_its_share_of_the_memory(capsys):
    """run.gpus_per_worker=0.5 packs two runs onto one GPU side by side: each must fit half its memory. A trial of
    about 17 GB fits an L4 (24 GB) whole and not half of one."""
    from orchestrator.spec.plan import plan_spec, refusals

    def spec(gpus: float):
        return validate_spec({
            "name": "packed", "task": {"kind": "clm", "dataset": "builtin", "vocab_size": 1000, "seq_len": 4096,
                                       "batch_size": 32},
            "model": {"d_model": 2048, "layers": 1, "ffn": 2048, "max_seq_len": 4096,
                      "attention": {"kind": "mha", "heads": 16}},
            "run": {"gpus_per_worker": gpus}})

    whole, half = plan_spec(spec(1), gpu_kind("L4")), plan_spec(spec(0.5), gpu_kind("L4"))
    assert whole.memory_bytes == half.memory_bytes and 12 * GIB < half.memory_bytes < 20 * GIB
    assert whole.fits and not half.fits
    assert half.fixes[0].startswith("run.gpus_per_worker=1 ")
    (message,) = refusals([half])
    assert "its share of L4's 24 GB (run.gpus_per_worker=0.5: 12 GB)" in message, message


def _sharded_spec(layers: int, workers: int, d_model: int = 64, seq_len: int = 16):
    return validate_spec({**_spec("mha", d_model=d_model, seq_len=seq_len, layers=layers).model_dump(mode="json"),
                          "run": {"strategy": "fsdp", "workers": workers}})


def test_a_sharded_plan_holds_a_share_of_the_states_and_rank_0_its_evaluation():
    """An FSDP trial's step is counted sharded (orchestrator/spec/counting.py `fake_process_group`, models/fsdp.py):
    rank 0 holds 1/W of AdamW's two fp32 moments (the dimensions divide by 2 and 4: no padding), whatever FSDP2
    gathers at once besides, so going from 2 to 4 workers frees exactly a quarter of them (the count itself is
    measured against two real ranks in tests/test_fsdp.py). Rank 0 also scores an unsharded fp32 replica on its
    device (`evaluate_replica`) beside its shards of the weights and moments: for 16 layers over 16 workers that, not
    the step, is the plan's memory per GPU; for 3 layers, whose activations and gathered layers weigh more than
    their weights, the step's sharded peak is."""
    from orchestrator.spec.gpus import gpu_kind
    from orchestrator.spec.plan import plan_spec, rank0_evaluation_bytes

    two, four = (plan_spec(_sharded_spec(3, workers), gpu_kind("H100")) for workers in (2, 4))
    moments = 2 * 4 * two.step.params_total  # exp_avg and exp_avg_sq, fp32, of every parameter
    assert two.step.by_kind["Optstate"] - four.step.by_kind["Optstate"] == moments // 2 - moments // 4
    assert four.memory_bytes == four.step.peak_bytes < two.step.peak_bytes == two.memory_bytes
    assert two.memory_bytes > rank0_evaluation_bytes(two.step, 2)
    deep = plan_spec(_sharded_spec(16, 16), gpu_kind("H100"))
    params = deep.step.params_total
    assert deep.memory_bytes == 4 * params + 12 * params // 16 > deep.step.peak_bytes


@pytest.mark.slow  # five sharded counts, 9 s of CPU: smaller models hide the first layers' fill-up under activations
def test_sharded_depth_probes_start_where_each_layer_adds_the_same():
    """What FSDP2 holds unsharded at once fills up over the first layers: an 8-layer sharded step's peak from probes
    at 3 and 4 layers (plan's SHARDED_PROBE_START) is the whole model's exactly; from 2 and 3 it is not."""
    from orchestrator.spec.counting import count_by_depth
    from orchestrator.spec.plan import SHARDED_PROBE_START

    spec = _sharded_spec(8, 2, d_model=32)
    whole = count_step(workload(spec), shards=2)
    count = functools.partial(count_step, shards=2)
    assert count_by_depth(spec, count, start=SHARDED_PROBE_START).peak_bytes == whole.peak_bytes
    assert count_by_depth(spec, count, start=SHARDED_PROBE_START - 1).peak_bytes > whole.peak_bytes


def test_a_sharded_step_is_counted_in_a_process_without_a_process_group():
    """The fake process group is the default one while the count lasts: inside a run's own (a Ray Train worker's)
    the count refuses, naming why, and leaves that group alone."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="needs a process of its own"):
            count_step(workload(_sharded_spec(3, 2)), shards=2)
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()


class _ReadsItsValues(torch.nn.Module):
    """A linear layer applied as many times as a value read back from the input says (a host sync)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def parameter_counts(self) -> dict[str, int]:
        return {"total": sum(p.numel() for p in self.parameters()), "attention": 0}

    def forward(self, x):
        for _ in range(int(x[0, 0].abs().ceil().clamp(1, 3))):
            x = self.linear(x)
        return x


def test_a_model_that_reads_its_values_is_counted_on_one_real_row_and_scaled():
    """Fake tensors cannot answer a size read from the values: count_step falls back to one real row of the batch
    and scales its FLOPs by the rows; the weights and AdamW state are not scaled."""
    from orchestrator.spec.counting import count_flops

    work = Workload(_ReadsItsValues, lambda rows: (torch.full((rows, 8), 2.5),), lambda m, b: m(b[0]).sum(), 4, 1)
    step = count_step(work)
    # Per row, three applications of an 8 x 8 matmul (2 x 64 FLOPs each): three forward, three weight gradients,
    # and two input gradients (the input itself needs none).
    one_row = 2 * 8 * 8 * (3 + 3 + 2)
    assert step.flops == count_flops(work) == 4 * one_row
    assert step.by_kind["Parameter"] == (8 * 8 + 8) * 4


@pytest.mark.parametrize("config", ["configs/multi30k.yaml", "configs/studies/downstream_sst2.yaml"])
def test_a_translation_or_classify_trial_that_does_not_fit_gets_its_fixes_not_a_traceback(config, capsys):
    """The fixes read task.seq_len for Transformer-XL's cache, which only a causal LM has; and a translation
    decoder cannot be reversible, so that fix is not offered there."""
    path = str(Path(__file__).resolve().parents[1] / config)
    assert main(["plan", path, "model.d_model=4096", "model.ffn=16384", "model.layers=12", "--gpu", "L4"]) == 2
    err = capsys.readouterr().err
    assert "do not fit" in err and "run.activation_checkpointing=true" in err and "Traceback" not in err
    assert ("model.reversible=true" in err) == ("multi30k" not in config)


def test_plan_flags_are_checked_when_the_command_line_is_read(capsys):
    for flag, value, says in (("--mfu", "0", "not a utilisation in (0, 1]"), ("--mfu", "2", "not a utilisation"),
                              ("--gpu", "V100", "unknown GPU 'V100'; known: H100")):
        with pytest.raises(SystemExit) as exit_:
            main(["plan", str(Path(__file__).resolve().parents[1] / "configs/smoke.yaml"), flag, value])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
