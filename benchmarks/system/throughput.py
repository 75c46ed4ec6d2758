"""Masked-LM training throughput: our `LanguageModel` (mha) against Hugging Face's `BertForMaskedLM`.

Both models have the same width, depth, heads, feed-forward size, vocabulary and sequence length, no
dropout, and train on the very same batch with the same loss code and AdamW; one step is forward,
cross-entropy over the masked positions, backward and an AdamW update, taken by the training core's
`orchestrator.training.trainer.train_step` for every model (BERT through a `loss_fn` adapter; constant learning rate,
no clipping, fp32). The two are timed in alternation (harness.interleaved_medians) so load from other
processes on a shared machine hits both alike; the ratio of tokens/s is the number that counts. BERT
(Devlin et al., 2019, arXiv 1810.04805) is built from a `BertConfig`, so nothing is downloaded; it needs the
`bench` extra (`pip install -e ".[bench]"`).

Ours and BERT both project every position onto the vocabulary. A third model in the same rounds,
`ours_masked`, is ours trained the way tasks/lm.py trains masked LM: only the masked positions' hidden
states go through the output layer; `ours_masked_over_ours_paired_median` is the step speed-up that buys.

    python -m benchmarks.system.throughput --out benchmarks/results            # full
    python -m benchmarks.system.throughput --quick --out benchmarks/results    # < 1 minute
    python -m benchmarks.system.throughput --profile --out benchmarks/results  # + top ops of one step per model
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from benchmarks.harness import Row, interleaved_medians, peak_memory_bytes, results_dir, write_csv
from models import LanguageModel, ModelConfig
from orchestrator.spec import OptimConfig
from orchestrator.training import LossFn, Optimization, train_step as core_train_step
from tasks import Batch

IGNORE = -100
"""Label of positions that are not predicted (the convention of both F.cross_entropy and transformers)."""
CPU = torch.device("cpu")
"""The comparison is CPU fp32 by design."""
LogitsOf = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(model, inputs_BT, labels_BT) -> (logits_NV, labels_N) of the positions the loss scores."""


@dataclass(frozen=True)
class Size:
    """One model size and batch; the same numbers configure both implementations."""

    name: str
    d_model: int
    layers: int
    heads: int
    ffn: int
    vocab: int
    seq_len: int
    batch: int


FULL_SIZES = (
    Size("small", d_model=256, layers=4, heads=4, ffn=1024, vocab=8000, seq_len=128, batch=16),
    Size("base6", d_model=512, layers=6, heads=8, ffn=2048, vocab=16000, seq_len=512, batch=4),
)
QUICK_SIZES = (Size("quick", d_model=64, layers=2, heads=2, ffn=128, vocab=1000, seq_len=64, batch=4),)


def build_ours(size: Size) -> nn.Module:
    cfg = ModelConfig(
        d_model=size.d_model, layers=size.layers, ffn=size.ffn, dropout=0.0, max_seq_len=size.seq_len,
        attention={"kind": "mha", "heads": size.heads, "dropout": 0.0},
    )
    return LanguageModel(cfg, size.vocab, causal=False)


def build_bert(size: Size) -> nn.Module:
    try:
        from transformers import BertConfig, BertForMaskedLM
    except ImportError as err:
        raise SystemExit("benchmarks.system.throughput needs Hugging Face transformers: "
                         "pip install -e '.[bench]'") from err
    config = BertConfig(
        vocab_size=size.vocab, hidden_size=size.d_model, num_hidden_layers=size.layers,
        num_attention_heads=size.heads, intermediate_size=size.ffn, hidden_act="gelu",
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=size.seq_len,
        type_vocab_size=1,
    )
    # SDPA like ours, so the comparison is about the rest of the model rather than the attention kernel.
    config._attn_implementation = "sdpa"
    return BertForMaskedLM(config)


def mlm_batch(size: Size, mask_prob: float = 0.15, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens with `mask_prob` of positions replaced by a mask id and labelled; the rest ignored."""
    generator = torch.Generator().manual_seed(seed)
    tokens_BT = torch.randint(0, size.vocab - 1, (size.batch, size.seq_len), generator=generator)
    chosen_BT = torch.rand(size.batch, size.seq_len, generator=generator) < mask_prob
    labels_BT = torch.where(chosen_BT, tokens_BT, torch.full_like(tokens_BT, IGNORE))
    inputs_BT = tokens_BT.masked_fill(chosen_BT, size.vocab - 1)  # the last id plays <mask>
    return inputs_BT, labels_BT


def mlm_loss(logits_of: LogitsOf) -> LossFn:
    """The training core's `loss_fn(model, batch)`: cross-entropy of `logits_of`, the same code for every model."""

    def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
        logits_NV, labels_N = logits_of(model, batch.tensors["inputs"], batch.tensors["labels"])
        return F.cross_entropy(logits_NV, labels_N, ignore_index=IGNORE)

    return loss_fn


def step_closure(model: nn.Module, opt: Optimization, loss_fn: LossFn, batch: Batch) -> Callable[[], None]:
    """A closure running one full training step of the core (`train_step`) on the same batch every time."""
    batches = itertools.repeat(batch)

    def step() -> None:
        core_train_step(model, batches, loss_fn, opt, CPU)

    return step


def _ours_logits(model: nn.Module, inputs_BT: torch.Tensor, labels_BT: torch.Tensor):
    return model(inputs_BT).flatten(0, 1), labels_BT.flatten()


def _ours_masked_logits(model: nn.Module, inputs_BT: torch.Tensor, labels_BT: torch.Tensor):
    scored_N = (labels_BT.flatten() != IGNORE).nonzero().squeeze(1)  # tasks/base.py scored_positions, on a tensor
    return model(inputs_BT, None, scored_N), labels_BT.flatten()[scored_N]


def _bert_logits(model: nn.Module, inputs_BT: torch.Tensor, labels_BT: torch.Tensor):
    """The HF adapter: BertForMaskedLM takes `input_ids` and returns a ModelOutput with `.logits`."""
    return model(input_ids=inputs_BT).logits.flatten(0, 1), labels_BT.flatten()


MODELS: Mapping[str, tuple[Callable[[Size], nn.Module], LogitsOf]] = {
    "ours": (build_ours, _ours_logits),
    "bert": (build_bert, _bert_logits),
    "ours_masked": (build_ours, _ours_masked_logits),
}
"""Name -> (builder, logits of the scored positions); every one is timed in the same rounds."""


def optim_config(lr: float = 1e-4) -> OptimConfig:
    """torch.optim.AdamW's default betas and weight decay, constant LR, no clipping: the step is the bare
    forward, loss, backward and AdamW update for every model."""
    return OptimConfig(lr=lr, betas=(0.9, 0.999), weight_decay=0.01, schedule="constant", grad_clip=None)


def steps_for(size: Size, names: Sequence[str] = tuple(MODELS)) -> dict[str, tuple[nn.Module, Callable[[], None]]]:
    """Each named model (same seed), its own `Optimization` and a closure of its core training step."""
    inputs_BT, labels_BT = mlm_batch(size)
    batch = Batch({"inputs": inputs_BT, "labels": labels_BT}, n_tokens=int((labels_BT != IGNORE).sum()))
    optim = optim_config()
    out = {}
    for name in names:
        build, logits_of = MODELS[name]
        torch.manual_seed(0)
        model = build(size).train()
        out[name] = (model, step_closure(model, Optimization.build(model, optim, CPU), mlm_loss(logits_of), batch))
    return out


def run(sizes: Sequence[Size], warmup: int, repeats: int, device: torch.device) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        models = steps_for(size)
        times = interleaved_medians({name: step for name, (_, step) in models.items()}, device,
                                    warmup=warmup, repeats=repeats)
        tokens = size.batch * size.seq_len
        medians = {name: statistics.median(ts) for name, ts in times.items()}
        row: Row = {**asdict(size), "tokens_per_step": tokens, "repeats": repeats, "threads": torch.get_num_threads()}
        for name, (model, step) in models.items():
            row[f"{name}_params"] = sum(p.numel() for p in model.parameters())
            row[f"{name}_step_s"] = medians[name]
            row[f"{name}_tokens_per_s"] = tokens / medians[name]
            row[f"{name}_step_s_min"] = min(times[name])
            row[f"{name}_peak_mb"] = peak_memory_bytes(step, device) / 2**20
        row["ours_over_bert_tokens_per_s"] = row["ours_tokens_per_s"] / row["bert_tokens_per_s"]
        # Paired per round (both models ran back to back): robust to load that shifts during the run.
        row["ours_over_bert_paired_median"] = statistics.median(b / o for o, b in zip(times["ours"], times["bert"]))
        row["ours_masked_over_ours_paired_median"] = statistics.median(
            o / m for m, o in zip(times["ours_masked"], times["ours"]))
        print(f"{size.name}: ours {row['ours_tokens_per_s']:.0f} tok/s, bert {row['bert_tokens_per_s']:.0f} tok/s, "
              f"ratio {row['ours_over_bert_tokens_per_s']:.3f}; masked positions only "
              f"{row['ours_masked_tokens_per_s']:.0f} tok/s, paired {row['ours_masked_over_ours_paired_median']:.3f}x ours",
              flush=True)
        rows.append(row)
    return rows


def profile_steps(size: Size, folder: Path, steps: int = 3, top: int = 25) -> Path:
    """Self-CPU-time tables of a few training steps per model: where each one spends its time."""
    from torch.profiler import ProfilerActivity, profile

    path = folder / f"throughput_profile_{size.name}.txt"
    sections = []
    for name, (_, step) in steps_for(size).items():
        step()  # warm caches and AdamW state outside the profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                step()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)
        sections.append(f"== {name}: {steps} steps of size {size.name} ==\n{table}")
    path.write_text("\n\n".join(sections))
    return path


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--quick", action="store_true", help="one tiny size, 3 repeats (under a minute)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved timed steps per model")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sizes", nargs="*", default=None, help=f"subset of {[s.name for s in FULL_SIZES]}")
    parser.add_argument("--profile", action="store_true", help="also write the top ops of each model's step")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--name", default="throughput", help="file stem of the CSV")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    device = CPU
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = QUICK_SIZES if args.quick else tuple(s for s in FULL_SIZES if args.sizes is None or s.name in args.sizes)
    if not sizes:
        raise SystemExit(f"--sizes {args.sizes} matches none of {[s.name for s in FULL_SIZES]}")
    repeats = 3 if args.quick else args.repeats
    rows = run(sizes, warmup=1 if args.quick else args.warmup, repeats=repeats, device=device)
    folder = results_dir(args.out, device)
    print(f"wrote {write_csv(rows, folder / f'{args.name}.csv')}")
    if args.profile:
        for size in sizes:
            print(f"wrote {profile_steps(size, folder)}")
    return rows


if __name__ == "__main__":
    main()
