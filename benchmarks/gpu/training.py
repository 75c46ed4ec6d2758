"""Part (d) of benchmarks.gpu.suite: one training step of an `mha` causal LM at n = 1024 under bf16 autocast and
torch.compile, in tokens/s and model FLOP utilisation (MFU).

The step is the training core's own (`orchestrator.training.train_step`: autocast forward, loss, backward,
clipping, AdamW and its schedule), built with `Optimization.build(..., precision="bf16")`, so the autocast dtype
in the row is the one the core chose for this device. The model is compiled in place as `run.compile` does
(`model.compile`, inductor, which emits Triton kernels on a GPU). Three untimed steps absorb the compilation; the
median of the timed steps (each synchronised) gives tokens/s = batch x n / step time.

FLOPs of a step, as PaLM counts them (Chowdhery et al., 2022, arXiv 2204.02311, appendix B; nanoGPT's
`estimate_mfu`): tokens x (6 N + 12 L d n), with N the parameters of the weight matrices, L layers, d the model
width and n the sequence length. The token table counts in N, as the tied output projection; the learned position
table does not (a lookup), nor do biases and norm scales (elementwise work, a few thousandths of N at these sizes;
PaLM and nanoGPT count them). 6 N is the forward's and backward's 2 + 4 FLOPs per weight and token; 12 L d n is
attention's Q K^T and P V products (2 x 2 n d per token and layer forward, three times that with the backward),
counted over the full n x n even though causal attention needs half, as PaLM does. tests/test_gpu_suite.py checks
the count against torch's FlopCounterMode.
MFU = FLOPs / step time / the device's peak dense bf16 FLOP/s, by the function the trainer's `train/mfu` uses
(orchestrator.spec.gpus.model_flops_utilization, on the one GPU table, with its sources; a GPU not in the table gets
no MFU).

The part times the step in `VARIANTS`, one case each, in the same run, so the MFU before and after a change of the
core sits side by side: `before` steps AdamW with the multi-tensor (`foreach`) update the core used before it took
the fused one on a GPU (orchestrator/training/optimizer_step.py `Optimization.build`); `core` is the core as it is;
`core, batch 32` the core at four times the tokens per step (the optimizer's and the clipping's time per step,
which do not grow with the batch, spread over more tokens). Each variant builds and compiles its own model (static
shapes: no batch size left from another variant turns dynamic), then the variants' timed steps run in turn, so an
order effect (the first H200 run timed them one after the other, and the first variant's median step was 1.6x its
fastest) falls on all alike. A dry run trains a one-layer toy on the CPU with the aot_eager backend (dynamo and
AOTAutograd without inductor's code generation, which tests/test_compile_families.py exercises); its MFU column stays
blank (a CPU has no peak), and it checks the MFU function against an H100's peak instead (`mfu_check`).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.gpu.common import PartResult, SuiteContext
from benchmarks.harness import Row, synchronize, timed_call
from models import LanguageModel, ModelConfig
from orchestrator.spec import OptimConfig, peak_bf16_flops
from orchestrator.spec.gpus import model_flops_utilization
from orchestrator.training import Optimization, train_step
from tasks import Batch

GPU_SIZE = {"d_model": 1024, "layers": 8, "heads": 16, "ffn": 4096, "vocab": 32768, "batch": 8, "n": 1024}
DRY_SIZE = {"d_model": 32, "layers": 1, "heads": 2, "ffn": 64, "vocab": 128, "batch": 2, "n": 64}
WARMUP_STEPS = 3
TIMED_STEPS, DRY_TIMED_STEPS = 20, 2
VARIANTS = ({"variant": "before: foreach AdamW", "batch": 8, "fused": False},
            {"variant": "core", "batch": 8, "fused": None},
            {"variant": "core, batch 32", "batch": 32, "fused": None})
"""The cases of the part (the module docstring says what each is); `fused` None: as the core builds it."""
DRY_VARIANTS = VARIANTS[:2]
"""On a CPU both are foreach AdamW (fused is the GPU's): a dry run runs the two for the part's round-robin, not to
compare them."""
DRY_RUN_DEVICE = "NVIDIA H100 80GB HBM3"
"""The device name a dry run checks the MFU function with (torch.cuda.get_device_name of an H100 SXM)."""
def matmul_parameters(model: LanguageModel) -> int:
    """N of the FLOP count: the weight matrices' parameters, but not the learned position table's (a lookup)."""
    lookups = {id(p) for p in model.embed.positions.parameters()}
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in lookups)


def step_flops(n_params: int, layers: int, d_model: int, n: int, tokens: int) -> float:
    """tokens x (6 N + 12 L d n): the module docstring says where each term comes from."""
    return tokens * (6.0 * n_params + 12.0 * layers * d_model * n)


def next_token_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    logits_BTV = model(batch.tensors["inputs"])
    return F.cross_entropy(logits_BTV.flatten(0, 1), batch.tensors["targets"].flatten())


def variants(ctx: SuiteContext) -> tuple[dict, ...]:
    return DRY_VARIANTS if ctx.dry_run else VARIANTS


def run(ctx: SuiteContext) -> PartResult:
    chosen = ctx.select(variants(ctx))
    prepared = []
    for variant in chosen:
        ctx.case_started(f"compiling the training step, {variant['variant']}")
        prepared.append(Prepared.build(ctx, variant))
    # Timed round-robin, one step of each variant in turn: whatever drifts during the part (clocks, the host's
    # other work) falls on every variant alike, and no variant is timed first.
    ctx.case_started("timing the variants' steps in turn")
    for _ in range(DRY_TIMED_STEPS if ctx.dry_run else TIMED_STEPS):
        for one in prepared:
            one.times.append(timed_call(one.step, ctx.device))
    rows = []
    for one in prepared:
        rows.append(one.row(ctx))
        ctx.record(rows[-1:])
        ctx.case_finished()
    failed = [row["status"] for row in rows if row["status"] != "ok"]
    status = failed[0] if failed else ctx.passed
    notes = sorted({row.pop("note") for row in rows} - {""})
    size = DRY_SIZE if ctx.dry_run else GPU_SIZE
    return PartResult(rows, status, "; ".join(notes), {"compile": rows[0]["compile_backend"] if rows else "",
                                                       "n": size["n"], "layers": size["layers"],
                                                       "d_model": size["d_model"],
                                                       "batch": "/".join(str(row["batch"]) for row in rows)})


@dataclass
class Prepared:
    """One variant's model, compiled and warmed up, its step, and its timed steps' seconds."""

    variant: dict
    size: dict
    backend: str
    n_params: int
    opt: Optimization
    step: Callable[[], None]
    warmup_s: float
    graph_breaks: int
    times: list[float] = field(default_factory=list)

    @classmethod
    def build(cls, ctx: SuiteContext, variant: dict) -> Prepared:
        size = {**(DRY_SIZE if ctx.dry_run else GPU_SIZE),
                "batch": DRY_SIZE["batch"] if ctx.dry_run else variant["batch"]}
        backend = "aot_eager" if ctx.dry_run else "inductor"
        torch.manual_seed(0)
        cfg = ModelConfig(d_model=size["d_model"], layers=size["layers"], ffn=size["ffn"], dropout=0.0,
                          max_seq_len=size["n"], attention={"kind": "mha", "heads": size["heads"]})
        model = LanguageModel(cfg, size["vocab"], causal=True).to(ctx.device).train()
        n_params = matmul_parameters(model)
        # dynamic=False: each variant's batch gets a graph of its own; without it dynamo would compile the second
        # batch size with a dynamic batch dimension (its automatic dynamic shapes), slower than the core's graph.
        model.compile(backend=backend, dynamic=False)
        optim = OptimConfig(lr=1e-4, warmup_steps=0, schedule="constant", max_steps=10**6)
        opt = Optimization.build(model, optim, ctx.device, precision="bf16", fused=variant["fused"])
        tokens_BT = torch.randint(0, size["vocab"], (size["batch"], size["n"] + 1), device=ctx.device)
        batch = Batch({"inputs": tokens_BT[:, :-1], "targets": tokens_BT[:, 1:]}, n_tokens=size["batch"] * size["n"])
        batches = itertools.repeat(batch)

        def step() -> None:
            train_step(model, batches, next_token_loss, opt, ctx.device)

        breaks_before = sum(torch._dynamo.utils.counters["graph_break"].values())
        start = time.perf_counter()
        for _ in range(WARMUP_STEPS):
            step()
        synchronize(ctx.device)
        warmup_s = time.perf_counter() - start
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks_before
        return cls(variant, size, backend, n_params, opt, step, warmup_s, breaks)

    def row(self, ctx: SuiteContext) -> Row:
        size, opt, times = self.size, self.opt, self.times
        step_s = statistics.median(times)
        tokens = size["batch"] * size["n"]
        flops = step_flops(self.n_params, size["layers"], size["d_model"], size["n"], tokens)
        device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else None
        peak = peak_bf16_flops(device_name)
        mfu = model_flops_utilization(tokens / step_s, flops / tokens, device_name)
        row: Row = {"variant": self.variant["variant"], **size,
                    "adamw": "fused" if opt.optimizer.defaults.get("fused") else "foreach",
                    "params_matmul": self.n_params, "compile_backend": self.backend,
                    "autocast": str(opt.autocast_dtype).removeprefix("torch.") if opt.autocast_dtype else "none (fp32)",
                    "graph_breaks": self.graph_breaks, "warmup_s": self.warmup_s, "step_ms": 1e3 * step_s,
                    "step_ms_min": 1e3 * min(times), "timed_steps": len(times), "timing": "round-robin",
                    "tokens_per_s": tokens / step_s, "flops_per_step": flops, "achieved_tflops": flops / step_s / 1e12,
                    "peak_bf16_tflops": peak / 1e12 if peak else "", "mfu": "" if mfu is None else mfu,
                    "status": "ok"}
        note = "" if peak else "MFU blank: no peak bf16 FLOP/s known for this device"
        if ctx.dry_run:
            # The trainer's MFU path without a GPU: the same function, with an H100's name, against the achieved
            # FLOP/s over the H100 row's peak.
            check = model_flops_utilization(tokens / step_s, flops / tokens, DRY_RUN_DEVICE)
            expected = flops / step_s / peak_bf16_flops(DRY_RUN_DEVICE)
            row["mfu_check"] = check if check is not None else ""
            if check is None or abs(check - expected) > 1e-9 * expected:
                row["status"] = f"fail: MFU of {DRY_RUN_DEVICE} gave {check}, expected {expected:.6g}"
        print(f"  train step ({row['variant']}): {row['tokens_per_s']:.4g} tokens/s, "
              f"{row['achieved_tflops']:.4g} TFLOP/s, "
              f"MFU {row['mfu'] if row['mfu'] == '' else format(row['mfu'], '.3f')}, "
              f"autocast {row['autocast']}, {row['graph_breaks']} graph breaks", flush=True)
        if opt.autocast_dtype != torch.bfloat16:
            note = f"{note}; the training core did not autocast to bf16 here".lstrip("; ")
        row["note"] = note
        return row
