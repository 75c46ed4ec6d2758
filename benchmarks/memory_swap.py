"""Score a Transformer-XL run's checkpoint with another memory length: how much of the gain is the context.

No parameter depends on `model.memory.mem_len` (the memory is layer inputs cached at run time), so the same
weights can be evaluated with more, less or no memory. This reads a checkpoint folder of a run
(`orchestrator.checkpoint.read_checkpoint`), replaces `mem_len` in its spec, builds the evaluation task and
model, loads the weights and runs the task's evaluation over the whole split with memory, plus the word-level
perplexity, as `orchestrator evaluate` does for the run's own spec.

    python -m benchmarks.memory_swap RUNS/wikitext2-txl/checkpoint_000002500 --mem-len 0 128 \\
        --cache-dir RUNS/.cache
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from orchestrator.checkpoint import read_checkpoint
from orchestrator.evaluation import split_task_config, word_level_perplexity
from orchestrator.spec import ExperimentSpec
from tasks import WorkerContext, build_task


def score_with_memory(checkpoint: Path, mem_len: int, split: str, cache_dir: Path) -> dict[str, float]:
    state = read_checkpoint(checkpoint)
    spec = ExperimentSpec.model_validate(state.spec)
    if spec.model.memory is None:
        raise SystemExit(f"{checkpoint}: the run has no model.memory block; nothing to swap")
    model_cfg = spec.model.model_copy(update={"memory": spec.model.memory.model_copy(update={"mem_len": mem_len})})
    task_cfg = split_task_config(spec.task, split)
    task = build_task(task_cfg, model_cfg, WorkerContext(seed=spec.optim.seed, cache_dir=cache_dir))
    model = task.build_model()
    model.load_state_dict(state.model)
    metrics = task.evaluate(model)
    metrics.update(word_level_perplexity(task_cfg, split, metrics["val/loss"], len(task.eval_stream) - 1, cache_dir))
    return metrics


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
        word = m.get(f"{args.split}/word_ppl", float("nan"))
        print(f"{args.checkpoint} mem_len={mem_len}: {args.split} loss {m['val/loss']:.4f} "
              f"ppl/piece {m['val/ppl']:.2f} ppl/word {word:.1f}", flush=True)


if __name__ == "__main__":
    main()
