"""Values read back from the device, per call of each path outside the attention kernels that a GPU step runs.

On a GPU every read of a tensor's values on the host (`.item()`, `.tolist()`, `bool(t)`, `.nonzero()`, `.cpu()`,
indexing by a boolean mask, which counts the mask's True values first)
waits until the device has finished everything queued before it, so the host cannot queue the next kernels while
the device works: a path that reads back often is bound by launches and round trips, not by the device. A CPU has
no such wait, but it sees the same calls: this counts them with a TorchFunctionMode, on CPU tensors, per path:

- `beam_search` / `greedy_decode` (tasks/beam_search.py) of a 6-sentence batch, beam 4 (reads and steps);
- a masked-LM training step (the task's loss, forward and backward: tasks/lm.py);
- an adaptive-input language model's forward and backward (models/embeddings.py AdaptiveInput);
- one cached decoding step of a left-padded batch through a Hugging Face Llama patched in every layer
  (models/hf_patching.py), with 2 and with 4 layers: what grows with the layers is read once per layer.

The counts are deterministic (the same calls on every run), so one run per commit; rows go to
`<out>/cpu-<cores>core/host_reads.csv` under `--label`, replacing that label's rows. Run at another commit with
that commit's code first on the path:

    python -m benchmarks.system.host_reads --label after --out benchmarks/results
    git worktree add /tmp/before <commit>
    PYTHONPATH=/tmp/before python benchmarks/system/host_reads.py --label before --out benchmarks/results
"""

from __future__ import annotations

import argparse
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from benchmarks.harness import code_version, read_csv, results_dir, write_csv

READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
         torch.Tensor.__float__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.cpu, torch.masked_select,
         torch.Tensor.masked_select}
"""The calls that bring a tensor's values to the host (`.cpu().numpy()` counts once, as its `.cpu()`)."""
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put, torch.Tensor.index_put_}
"""Indexing with a boolean tensor counts its True values on the host first (a nonzero inside the op)."""


def _bool_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    parts = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(part, torch.Tensor) and part.dtype == torch.bool for part in parts)


class HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            self.calls[func.__name__] += 1
        elif func in INDEXING and _bool_index(args):
            self.calls["bool-index"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def count(self) -> int:
        return sum(self.calls.values())


def _decoding() -> list[dict[str, Any]]:
    from models import ModelConfig, Seq2SeqTransformer
    from tasks.beam_search import DecodeSpecials, beam_search, greedy_decode, max_lengths

    specials = DecodeSpecials(bos=2, eos=3, forbidden=(0, 1, 2, 4))
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=40, dropout=0.0,
                      attention={"kind": "mha", "heads": 2})
    model = Seq2SeqTransformer(cfg, 30).eval()
    src = torch.randint(5, 30, (6, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([9, 8, 7, 6, 5, 4])
    mask, limit = torch.arange(9)[None] >= lengths[:, None], max_lengths(lengths, 1.0, 4, cap=39)
    rows = []
    with HostReads() as reads:
        hypotheses, _ = beam_search(model, src, mask, limit, specials, beam_size=4, length_penalty=0.6)
    rows.append({"case": "beam_search, 6 sentences, beam 4", "reads": reads.count,
                 "steps": max(len(h) for h in hypotheses) + 1, "calls": _calls(reads)})
    with HostReads() as reads:
        hypotheses = greedy_decode(model, src, mask, limit, specials)
    rows.append({"case": "greedy_decode, 6 sentences", "reads": reads.count,
                 "steps": max(len(h) for h in hypotheses) + 1, "calls": _calls(reads)})
    return rows


def _masked_lm_step(cache: Path) -> dict[str, Any]:
    from pydantic import TypeAdapter

    from models import ModelConfig
    from tasks import WorkerContext, build_task
    from tasks.config import TaskConfig

    cfg = TypeAdapter(TaskConfig).validate_python({
        "kind": "mlm", "seq_len": 32, "batch_size": 8, "vocab_size": 96,
        "builtin": {"train_sentences": 600, "eval_sentences": 40, "lexicon_size": 12}})
    model_cfg = ModelConfig(d_model=32, layers=2, ffn=64, max_seq_len=32, dropout=0.0,
                            attention={"kind": "mha", "heads": 2})
    task = build_task(cfg, model_cfg, WorkerContext(seed=3, cache_dir=cache))
    batch, _ = next(task.train_batches())
    torch.manual_seed(0)
    model = task.build_model()
    with HostReads() as reads:
        task.loss(model, batch).backward()
    return {"case": "masked-LM training step, 2 layers", "reads": reads.count, "steps": 1, "calls": _calls(reads)}


def _adaptive_input() -> dict[str, Any]:
    from models import LanguageModel, ModelConfig

    torch.manual_seed(0)
    cfg = ModelConfig(d_model=32, layers=1, ffn=64, max_seq_len=32, attention={"kind": "mha", "heads": 2},
                      embedding={"kind": "adaptive", "cutoffs": [20, 60]}, tie_output=False)
    model = LanguageModel(cfg, 100, causal=True)
    tokens = torch.randint(0, 100, (4, 32), generator=torch.Generator().manual_seed(1))
    with HostReads() as reads:
        model(tokens).float().logsumexp(-1).mean().backward()
    return {"case": "adaptive input (3 bands) LM forward and backward", "reads": reads.count, "steps": 1,
            "calls": _calls(reads)}


def _patched_step(layers: int) -> dict[str, Any]:
    import transformers

    from models.dropin import PatchConfig
    from models.hf_patching import patch_hf_model

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")).eval()
    patch_hf_model(model, PatchConfig(layers="all", attention={"kind": "lsh", "bucket_size": 4, "n_hashes": 2,
                                                                "n_buckets": 8}))
    prompt = torch.randint(1, 100, (2, 13), generator=torch.Generator().manual_seed(2))
    prompt[0, :4] = 0
    mask = (torch.arange(13) >= torch.tensor([[4], [0]])).long()
    with torch.no_grad():
        out = model(prompt, attention_mask=mask, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        with HostReads() as reads:
            model(torch.tensor([[5], [6]]), attention_mask=step_mask, past_key_values=cache, use_cache=True)
    return {"case": f"patched Llama, {layers} layers: one cached step of a left-padded batch", "reads": reads.count,
            "steps": 1, "calls": _calls(reads)}


def _calls(reads: HostReads) -> str:
    return " ".join(f"{name}:{n}" for name, n in reads.calls.most_common())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", required=True, help="the rows' label (before, after, ...)")
    parser.add_argument("--out", default="benchmarks/results", help="results root")
    args = parser.parse_args()
    import models

    tree = Path(models.__file__).resolve().parents[1]
    commit = code_version(tree)
    with tempfile.TemporaryDirectory() as cache:
        rows = [*_decoding(), _masked_lm_step(Path(cache)), _adaptive_input(), _patched_step(2), _patched_step(4)]
    for row in rows:
        row.update(label=args.label, version=commit)
        print(f"{args.label:>8} {commit} {row['case']:<64} {row['reads']:>4} reads ({row['calls']})", flush=True)
    path = results_dir(args.out, torch.device("cpu")) / "host_reads.csv"
    kept = [row for row in (read_csv(path) if path.exists() else []) if row["label"] != args.label]
    columns = ("label", "version", "case", "reads", "steps", "calls")
    write_csv([{c: row[c] for c in columns} for row in [*kept, *rows]], path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
