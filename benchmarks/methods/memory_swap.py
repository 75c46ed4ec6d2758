"""Score a Transformer-XL run's checkpoint with another memory length: how much of the gain is the context.

No parameter depends on `model.memory.mem_len` (the memory is layer inputs cached at run time), so the same
weights can be evaluated with more, less or no memory. This scores a checkpoint folder of a run with
`orchestrator.training.scoring.evaluate_checkpoint` (what `orchestrator evaluate` runs) with `mem_len` replaced in
its model config: the whole split with memory, plus the word-level perplexity.

    python -m benchmarks.methods.memory_swap RUNS/wikitext2-txl/checkpoint_000002500 --mem-len 0 128 \\
        --cache-dir RUNS/.cache
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from orchestrator.spec import ExperimentSpec
from orchestrator.training import read_checkpoint, evaluate_checkpoint


def score_with_memory(checkpoint: Path, mem_len: int, split: str, cache_dir: Path) -> dict[str, float]:
    spec = ExperimentSpec.model_validate(read_checkpoint(checkpoint).spec)
    if spec.model.memory is None:
        raise SystemExit(f"{checkpoint}: the run has no model.memory block; nothing to swap")
    memory = spec.model.memory.model_copy(update={"mem_len": mem_len})
    with tempfile.TemporaryDirectory() as out_dir:
        return evaluate_checkpoint(checkpoint, split, cache_dir=cache_dir, out_dir=Path(out_dir),
                                   device=torch.device("cpu"), model_update={"memory": memory}).metrics


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a run's checkpoint folder (checkpoint_<step>)")
    parser.add_argument("--mem-len", type=int, nargs="+", required=True, help="memory lengths to score with")
    parser.add_argument("--split", default="test", choices=["validation", "test"])
    parser.add_argument("--cache-dir", type=Path, required=True,
                        help="the run's tokenizer/data cache (<run.storage_path>/.cache)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    for mem_len in args.mem_len:
        m = score_with_memory(args.checkpoint, mem_len, args.split, args.cache_dir)
        print(f"{args.checkpoint} mem_len={mem_len}: {args.split} loss {m[f'{args.split}/loss']:.4f} "
              f"ppl/piece {m[f'{args.split}/ppl']:.2f} ppl/word {m[f'{args.split}/word_ppl']:.1f}", flush=True)


if __name__ == "__main__":
    main()
