"""torch.compile of a tiny model of each attention family, with AOTAutograd's eager backend (fast tier: dynamo's
capture and the joint graph, seconds) and with inductor (C++ kernels on the CPU; slow tier, tens of seconds per
family cold): the compiled masked-LM loss and every parameter's gradient equal eager's within a stated tolerance,
the model was compiled for real (dynamo captured graphs and AOTAutograd handed them to the backend; a silent
fallback to eager fails), and its graph breaks are at most those benchmarks/RESULTS.md's compile table reports for
the kind.

Families: `mha` (the exact mechanism; sha, mqa, gqa, skv and el_att differ from it in their projections only),
`mhe` (head embeddings), and the approximate mechanisms `linformer`, `lsh` and `hyper`; `lsh` and `hyper` causal too
(their causal layers have paths of their own: past-only layouts, the recursion's levels). Each model is one layer,
d_model 32, 4 heads, its kind's `tiny_knobs`, on 2 x 32 tokens with about 30% of them scored, as masked LM
scores them: the scored positions come with the batch (tasks/base.py `scored_positions`), so selecting them is
no graph break, where a boolean mask's count (aten.nonzero) was one in every kind. The first inductor compile of a process also warms inductor's caches: about 2-3 minutes for the file
on a cold 2-core machine, well under a minute with inductor's on-disk cache warm.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from models import LanguageModel, ModelConfig
from models.attention import ATTENTION

FAMILIES = ("mha", "mhe", "linformer", "lsh", "hyper")
KERNEL_MODULES = sorted(path.stem for path in (Path(__file__).resolve().parents[1] / "kernels").glob("k_*.py"))
CAUSAL = ("lsh", "hyper")
CAUSAL_BREAKS = 0
"""None: the masked LM's scored positions come with the batch (a boolean mask's `aten.nonzero` was a break in
every kind until 2026-11-30), the causal layers read no value back from the device under torch.compile (causal
LSH's PyTorch path takes its layout's bound there instead of reading the layout's length, a graph break inside the
model's loop over its layers, where dynamo ran the whole frame eagerly), and no setting they read at each call is a
ContextVar (test_call_settings_are_read_inside_a_graph)."""
RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "RESULTS.md"
COMPILE_SECTION = "## torch.compile per attention kind"
LOSS_RTOL = 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-5
"""fp32 on both sides; inductor fuses ops and sums in its own order, which moves results by about 1e-7 relative
(measured: at most 1e-6 of a gradient's largest entry). 100x that still fails a gradient that loses or doubles
a term, which moves it by its own size."""


def graph_breaks_in_results() -> dict[str, int]:
    """The `graph breaks` column of RESULTS.md's compile table, by kind."""
    section = RESULTS.read_text().split(COMPILE_SECTION, 1)[1].split("\n## ", 1)[0]
    lines = section.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = itertools.takewhile(lambda line: line.startswith("|"), lines[start:])  # the section's first table
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in table if not re.match(r"\|[-| ]+\|$", line)]
    header, body = rows[0], rows[1:]
    kind, breaks = header.index("kind"), header.index("graph breaks")
    return {row[kind]: int(row[breaks]) for row in body}


def test_results_table_lists_every_family():
    assert set(FAMILIES) <= set(graph_breaks_in_results())


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and counters emptied, so each kind compiles and counts its own graphs; RNG ops compiled as
    eager's (inductor otherwise draws with its own generator, and lsh and hyper draw rotations and samples)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with torch._dynamo.config.patch(suppress_errors=False), torch._inductor.config.patch(fallback_random=True):
        yield torch._dynamo.utils.counters
    torch._dynamo.reset()


def masked_lm_loss(model: LanguageModel, tokens_BT: torch.Tensor, scored_N: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the scored positions; the same seed before each call, so both sides draw alike."""
    torch.manual_seed(5)
    loss = F.cross_entropy(model(tokens_BT, None, scored_N), tokens_BT.flatten()[scored_N])
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("kind,causal,backend", [
    *[(kind, False, "aot_eager") for kind in FAMILIES],
    *[(kind, True, "aot_eager") for kind in CAUSAL],
    # inductor's C++ code generation and compile: tens of seconds per family on a cold 2-core machine
    *[pytest.param(kind, False, "inductor", marks=pytest.mark.slow) for kind in FAMILIES],
])
def test_compiled_model_matches_eager(kind, causal, backend, fresh_dynamo):
    """`aot_eager` (fast tier): dynamo captures the model with at most RESULTS.md's graph breaks and AOTAutograd's
    joint graph gives eager's loss and gradients; `inductor` (slow tier): the same through inductor's kernels.
    Causal (`aot_eager`: dynamo's capture is what the causal paths add): no break (CAUSAL_BREAKS)."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=1, ffn=64, dropout=0.0, max_seq_len=32,
                      attention={"kind": kind, "heads": 4, **ATTENTION.configs[kind].tiny_knobs})
    eager = LanguageModel(cfg, 64, causal=causal).train()
    compiled = copy.deepcopy(eager)
    compiled.compile(backend=backend)  # inductor as run.compile does (orchestrator/training/trainer.py)
    generator = torch.Generator().manual_seed(1)
    tokens_BT = torch.randint(0, 64, (2, 32), generator=generator)
    scored_N = (torch.rand(2 * 32, generator=generator) < 0.3).nonzero().squeeze(1)

    loss_eager = masked_lm_loss(eager, tokens_BT, scored_N)
    loss_compiled = masked_lm_loss(compiled, tokens_BT, scored_N)

    counters = fresh_dynamo
    assert counters["stats"]["unique_graphs"] >= 1, "dynamo captured no graph: the model ran eagerly"
    assert counters["aot_autograd"]["ok"] >= 1, f"no graph reached {backend}: {dict(counters['aot_autograd'])}"
    breaks = sum(counters["graph_break"].values())
    allowed = CAUSAL_BREAKS if causal else graph_breaks_in_results()[kind]
    assert breaks <= allowed, f"{kind}: {breaks} graph breaks, {allowed} allowed: {list(counters['graph_break'])}"
    assert loss_compiled.item() == pytest.approx(loss_eager.item(), rel=LOSS_RTOL)
    for (name, p_eager), p_compiled in zip(eager.named_parameters(), compiled.parameters()):
        assert (p_eager.grad is None) == (p_compiled.grad is None), name
        if p_eager.grad is not None:
            torch.testing.assert_close(p_compiled.grad, p_eager.grad, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       msg=lambda message, name=name: f"{kind} {name}: {message}")


def test_call_settings_are_read_inside_a_graph():
    """The settings an attention call reads each time (the flash kernels' fixed launch configuration, the blockwise
    path's block limit, LSH's bounded layout) are kernels.block_setting.BlockSetting attributes, which dynamo reads
    under a guard: a ContextVar's `get` is a graph break, at every call of the flash kernel in a compiled model on a
    GPU."""
    from kernels.blockwise import at_most_blocks, exact_attention_blockwise
    from kernels.flash_attention import _current_fixed_config, fixed_launch_config
    from models.attention import lsh

    @torch.compile(backend="eager", fullgraph=True)  # fullgraph: a graph break raises
    def settings(x: torch.Tensor) -> torch.Tensor:
        cfg = _current_fixed_config()
        return x + (cfg["BLOCK_M"] if cfg is not None else 0) + lsh._BOUNDED_LAYOUT.value

    @torch.compile(backend="eager", fullgraph=True)
    def blockwise(q: torch.Tensor) -> torch.Tensor:
        return exact_attention_blockwise(q, q, q, causal=True)[0]

    torch._dynamo.reset()
    with fixed_launch_config(32, 16), lsh.bounded_layout():
        assert settings(torch.zeros(1)).item() == 33
    q = torch.randn(1, 1, 64, 16)
    with at_most_blocks(2):
        torch.testing.assert_close(blockwise(q), exact_attention_blockwise(q, q, q, causal=True)[0])
    torch._dynamo.reset()


@pytest.mark.parametrize("kind", ["lsh", "hyper"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_the_kernels_path_compiles_into_one_graph(kind, causal, fresh_dynamo, monkeypatch):
    """A GPU's path through the lsh and hyper layers under torch.compile, on a CPU: the layer of the GPU suite's
    long_attention (its dry-run size) with the Triton kernels stood in for and not counted (kernels/stand_in.py:
    the launches skipped, every other op as on a GPU), forward and backward through dynamo and AOTAutograd. One
    graph and no break: dynamo had broken the graph at each flash call (a ContextVar's `get`: 5 breaks in causal
    hyper) and at the chunked backward's sum into a strided `out=` (4 in lsh), and inductor cannot fuse across a
    break. What dynamo does with the kernels' launches themselves is the GPU's to show (benchmarks/gpu/
    attention_profile.py's `+inductor` rows)."""
    from benchmarks.gpu.speed import DRY_LONG_MODEL
    from benchmarks.methods.attention_scaling import Settings, Variant, build_layer
    from kernels.dispatch import stand_in_kernels

    # As on a GPU, where the interpreter is off (a kernel test module in this process may have turned it on: under
    # it, the wrappers repair Triton's interpreter first, a call dynamo skips). The kernel modules are imported
    # first, as the process has them: Triton decides at import whether a kernel is interpreted, and the kernel
    # tests that run after this one in the same process need theirs as they were.
    for module in KERNEL_MODULES:
        importlib.import_module(f"kernels.{module}")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    n, d_model = 64, DRY_LONG_MODEL["d_model"]
    torch.manual_seed(0)
    layer, _ = build_layer(Variant(kind, kind, DRY_LONG_MODEL["knobs"][kind]), n,
                           Settings(lengths=(n,), d_model=d_model, heads=DRY_LONG_MODEL["heads"]))
    compiled = torch.compile(layer.train(), backend="aot_eager")
    x_BTD = torch.randn(1, n, d_model, requires_grad=True)
    with stand_in_kernels(counting=False):  # the values are the stand-in's empty buffers: only the capture counts
        compiled(x_BTD, key_padding_mask_BS=None, causal=causal).sum().backward()
    counters = fresh_dynamo
    assert sum(counters["graph_break"].values()) == 0, list(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1 and counters["aot_autograd"]["ok"] == 1, dict(counters["stats"])
    assert x_BTD.grad is not None
