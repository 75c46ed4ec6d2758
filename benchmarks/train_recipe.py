"""Train a spec's task + model in one process, without Ray: the runner behind the Recipes of RESULTS.md.

It reads the same YAML spec as `orchestrator train` (the optim and run blocks included) and keeps to the
plainest loop that answers "what does this recipe reach on this machine": AdamW with the spec's warmup and
decay, periodic evaluation, a checkpoint that resumes exactly where it stopped (model, optimizer, schedule,
data position, RNG), and at the end one evaluation of the best checkpoint on the final split (test by default,
with no eval_max_sentences / eval_batches caps) written to final.json.

    python -m benchmarks.train_recipe configs/multi30k.yaml --out runs/recipes/multi30k
    python -m benchmarks.train_recipe configs/multi30k.yaml --out runs/recipes/multi30k --time-limit-min 90
    python -m benchmarks.train_recipe configs/wikitext2.yaml --out runs/recipes/wikitext2 optim.max_steps=100

Running the same command again resumes from <out>/checkpoint.pt. Metric lines go to stdout and
<out>/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from orchestrator.schedules import lr_lambda
from orchestrator.spec import ExperimentSpec, load_spec
from tasks import WorkerContext, build_task
from tasks.data import lm_texts


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _better(value: float, best: float | None, mode: str) -> bool:
    return best is None or (value < best if mode == "min" else value > best)


class _Log:
    """JSON lines to stdout and <out>/metrics.jsonl."""

    def __init__(self, path: Path):
        self.handle = open(path, "a", encoding="utf-8")

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        self.handle.write(line + "\n")
        self.handle.flush()


def _word_level(task_cfg: Any, split: str, loss_per_piece: float, n_pieces: int, cache_dir: Path) -> dict[str, float]:
    """Per-word perplexity of an LM split: the same total log-loss spread over words (+ one end-of-line per
    line, as word-level WikiText results count <eos>) instead of sentencepiece pieces."""
    lines = lm_texts(task_cfg, (split,), cache_dir)[split]
    n_words = sum(len(line.split()) + 1 for line in lines)
    return {f"{split}/word_ppl": math.exp(loss_per_piece * n_pieces / n_words), f"{split}/words": n_words,
            f"{split}/pieces": n_pieces}


def train(spec: ExperimentSpec, out: Path, cache_dir: Path, time_limit_s: float | None, final_split: str,
          final_checkpoint: str, command: str) -> dict[str, Any]:
    optim, run = spec.optim, spec.run
    random.seed(optim.seed)
    np.random.seed(optim.seed)
    torch.manual_seed(optim.seed)
    ctx = WorkerContext(seed=optim.seed, cache_dir=cache_dir)
    task = build_task(spec.task, spec.model, ctx)
    model = task.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim))
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(out / "metrics.jsonl")
    ckpt_path, best_path = out / "checkpoint.pt", out / "best.pt"

    step, position, best, train_seconds = 0, None, None, 0.0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, position, best, train_seconds = state["step"], state["position"], state["best"], state["train_seconds"]
        _restore_rng(state["rng"])
        log({"event": "resumed", "step": step, "position": position})
    else:
        log({"event": "start", "command": command, "spec": spec.model_dump(mode="json"),
             "params": model.parameter_counts(), "vocab_size": task.vocab_size})

    def checkpoint() -> None:
        _atomic_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                      "schedule": schedule.state_dict(), "step": step, "position": position, "best": best,
                      "train_seconds": train_seconds, "rng": _rng_state()}, ckpt_path)

    batches = task.train_batches(position)
    model.train()
    window_loss, window_tokens, window_start = 0.0, 0, time.time()
    session_start = time.time()
    while step < optim.max_steps:
        if time_limit_s is not None and time.time() - session_start > time_limit_s:
            log({"event": "time_limit", "step": step})
            break
        tick = time.time()
        optimizer.zero_grad(set_to_none=True)
        for _ in range(optim.grad_accum):
            batch, position = next(batches)
            loss = task.loss(model, batch.to(ctx.device))
            (loss / optim.grad_accum).backward()
            window_loss += float(loss.detach()) * batch.n_tokens
            window_tokens += batch.n_tokens
        if optim.grad_clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), optim.grad_clip)
        optimizer.step()
        schedule.step()
        step += 1
        train_seconds += time.time() - tick
        if step % run.log_every == 0:
            log({"step": step, "train/loss": window_loss / max(window_tokens, 1), "lr": schedule.get_last_lr()[0],
                 "train/tokens_per_s": window_tokens / max(time.time() - window_start, 1e-9),
                 "train_seconds": round(train_seconds, 1), "epoch": position["epoch"]})
            window_loss, window_tokens, window_start = 0.0, 0, time.time()
        if step % run.eval_every == 0 or step == optim.max_steps:
            tick = time.time()
            metrics = task.evaluate(model)
            improved = _better(metrics[spec.metric], best, spec.mode)
            if improved:
                best = metrics[spec.metric]
                _atomic_save({"model": model.state_dict(), "step": step, "metrics": metrics}, best_path)
            log({"step": step, **metrics, "best": best, "eval_seconds": round(time.time() - tick, 1)})
        if step % run.checkpoint_every == 0:
            checkpoint()
    checkpoint()

    # final evaluation: the best checkpoint on the final split, uncapped
    final_task_cfg = spec.task.model_copy(update={"eval_split": final_split, "eval_batches": None,
                                                  **({"eval_max_sentences": None} if spec.task.kind == "translation" else {})})
    final_task = build_task(type(spec.task).model_validate(final_task_cfg.model_dump()), spec.model, ctx)
    use_best = final_checkpoint == "best" and best_path.exists()
    chosen = torch.load(best_path, weights_only=False) if use_best else {"model": model.state_dict(), "step": step}
    model.load_state_dict(chosen["model"])
    tick = time.time()
    final = {f"{final_split}/{k.split('/', 1)[1]}": v for k, v in final_task.evaluate(model).items()}
    if spec.task.kind == "clm":
        final.update(_word_level(final_task.cfg, final_split, final[f"{final_split}/loss"],
                                 len(final_task.eval_stream) - 1, cache_dir))
    result = {"event": "final", "command": command, "checkpoint": final_checkpoint if use_best else "last",
              "checkpoint_step": chosen["step"], "steps": step,
              "train_seconds": round(train_seconds, 1), "eval_seconds": round(time.time() - tick, 1), **final,
              "params": model.parameter_counts(), "torch_threads": torch.get_num_threads()}
    log(result)
    (out / "final.json").write_text(json.dumps(result, indent=2) + "\n")
    artifacts = final_task.artifacts()
    if "hypotheses" in artifacts:
        (out / f"{final_split}.hyp").write_text(artifacts["hypotheses"].read_text())
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", help="YAML spec (task, model, optim, run blocks)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.max_steps=100")
    parser.add_argument("--out", required=True, type=Path, help="checkpoints, metrics.jsonl and final.json")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache"), help="tokenizer and prepared-data cache")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; on a shared small machine 1 avoids threads spinning on each other")
    parser.add_argument("--time-limit-min", type=float, default=None,
                        help="stop training after this many minutes (then checkpoint and run the final evaluation)")
    parser.add_argument("--final-split", choices=("validation", "test"), default="test")
    parser.add_argument("--final-checkpoint", choices=("best", "last"), default="best",
                        help="best: the checkpoint with the best periodic validation metric; last: the final weights "
                             "(use it when no held-out validation split exists, so the test set never selects)")
    args = parser.parse_intermixed_args(argv)
    torch.set_num_threads(args.threads)
    spec = load_spec(args.spec, args.overrides)
    command = "python -m benchmarks.train_recipe " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    train(spec, args.out, args.cache_dir, None if args.time_limit_min is None else args.time_limit_min * 60,
          args.final_split, args.final_checkpoint, command)


if __name__ == "__main__":
    main()
