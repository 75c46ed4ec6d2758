"""What the paper routing's leak is worth: a causal LM scored with the true future against a shuffled one.

`causal_routing: paper` (the Reformer's sort-and-chunk, HyperAttention's joint sort of a block's queries)
lets the output at position i depend on inputs after i through *which keys a query meets*
(docs/long_attention.md, tests/test_causal_routing.py). This benchmark asks whether a model trained that
way learns to use it:

1. Train a causal LM with the training core (`orchestrator.launch.local_run.train_locally`) on the WikiText-2
   recipe (configs/wikitext2.yaml: trains on valid.txt), for each attention kind x routing.
2. On test.txt, cut every scored window at random positions c and score the next-token prediction at
   c - 1 (target x_c) twice: with the window's true inputs at positions >= c, and with those positions taken
   from another window (the shuffled future). The context before c is the same in both, and both run in
   one batch in eval mode, so the routing randomness (eval rotations / samples) is the same too. A
   leak-free model gives the same loss to the last bit; a model that reads the future (x_c is among the
   true future's inputs) scores the true future better.
3. As a control, the paper-trained weights are also scored with `past_only` routing (routing has no
   parameters, so the same state dict loads): the difference there must be exactly 0.

    python -m benchmarks.methods.causal_leak --out benchmarks/results                   # lsh and hyper, both routings
    python -m benchmarks.methods.causal_leak --quick --out /tmp/leak                     # built-in corpus, a minute
    python -m benchmarks.methods.causal_leak --routings paper --steps 400 --set model.d_model=128 model.ffn=512 \
        model.layers=2 model.attention.heads=2 --out benchmarks/results           # what RESULTS.md reports

Writes `<out>/<machine>/causal_leak.csv`: per (kind, trained routing, scored routing) the standard test
perplexity, the perplexity of the cut predictions with the true and the shuffled future, their paired mean
loss difference with its standard error, and the largest change of any logit before a cut.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import Row, results_dir, write_csv
from models import LanguageModel
from models.attention import ATTENTION
from orchestrator.launch import train_locally
from orchestrator.spec import ExperimentSpec, load_spec

RECIPE = "configs/wikitext2.yaml"
# The kinds with a `causal_routing` knob, with the knobs their configs declare for the small benchmarks: small
# buckets and blocks, so that at seq_len 128 routing decides what a query sees (at the defaults a 128-token
# window is one chunk, i.e. exact attention, and nothing can leak).
ROUTED_KINDS = {
    kind: [f"model.attention.{knob}={json.dumps(value)}" for knob, value in config_cls.bench_knobs.items()]
    for kind, config_cls in ATTENTION.configs.items() if "causal_routing" in config_cls.model_fields
}
QUICK = ["task.files=null", "task.eval_split=validation", "task.builtin={train_sentences: 2000, eval_sentences: 200}",
         "task.vocab_size=500", "task.seq_len=64", "model.max_seq_len=64", "model.d_model=64", "model.ffn=128",
         "model.layers=2", "optim.warmup_steps=10", "run.log_every=10"]


def leak_spec(kind: str, routing: str, steps: int, quick: bool, extra: Sequence[str] = ()) -> ExperimentSpec:
    overrides = [f"name=leak-{kind}-{routing}", f"model.attention.kind={kind}",
                 f"model.attention.causal_routing={routing}", *ROUTED_KINDS[kind],
                 f"optim.max_steps={steps}", f"run.eval_every={steps}", f"run.checkpoint_every={steps}"]
    return load_spec(RECIPE, [*(QUICK if quick else []), *overrides, *extra])


def with_routing(model: LanguageModel, spec: ExperimentSpec, routing: str, vocab_size: int) -> LanguageModel:
    """The same weights under another routing (routing has no parameters)."""
    cfg = spec.model.model_copy(update={
        "attention": spec.model.attention.model_copy(update={"causal_routing": routing})})
    other = LanguageModel(cfg, vocab_size, causal=True)
    other.load_state_dict(model.state_dict())
    return other.eval()


@torch.no_grad()
def cut_scores(model: LanguageModel, stream: np.ndarray, seq_len: int, windows: int, cuts: int,
               seed: int) -> dict[str, float]:
    """Loss of the prediction at c - 1 with the true vs a shuffled future, over `windows` x `cuts` cuts."""
    model.eval()
    n_windows = min(windows, len(stream) // seq_len)
    if n_windows < 2:
        raise ValueError(f"the test stream has {len(stream)} tokens: fewer than two windows of {seq_len}")
    rng = np.random.default_rng(seed)
    blocks = stream[: n_windows * seq_len].reshape(n_windows, seq_len)
    donors = (np.arange(n_windows) + rng.integers(1, n_windows, size=n_windows)) % n_windows  # never itself
    true_losses, shuffled_losses, max_past_change = [], [], 0.0
    for w in range(n_windows):
        c_K = rng.choice(np.arange(1, seq_len), size=cuts, replace=False)
        true_KT = np.repeat(blocks[w][None], cuts, axis=0)
        shuffled_KT = true_KT.copy()
        for j, c in enumerate(c_K):
            shuffled_KT[j, c:] = blocks[donors[w], c:]
        tokens = torch.from_numpy(np.concatenate([true_KT, shuffled_KT])).long()
        logits = model(tokens, None).float()
        log_p = torch.log_softmax(logits, dim=-1)
        rows = torch.arange(cuts)
        c = torch.from_numpy(c_K).long()
        target = tokens[rows, c]
        true_losses.append(-log_p[rows, c - 1, target])
        shuffled_losses.append(-log_p[cuts + rows, c - 1, target])
        past = torch.arange(seq_len)[None, :] < c[:, None]  # positions < c see identical inputs up to c - 1
        change = (logits[:cuts] - logits[cuts:]).abs().amax(dim=-1)[past]
        max_past_change = max(max_past_change, float(change.max()))
    true_L, shuffled_L = torch.cat(true_losses).double(), torch.cat(shuffled_losses).double()
    diff = shuffled_L - true_L
    return {
        "cut_ppl_true_future": math.exp(float(true_L.mean())),
        "cut_ppl_shuffled_future": math.exp(float(shuffled_L.mean())),
        "loss_gain_from_future": float(diff.mean()),
        "loss_gain_stderr": float(diff.std() / math.sqrt(len(diff))),
        "max_logit_change_before_cut": max_past_change,
        "scored_cuts": len(diff),
    }


def progress(metrics: Mapping[str, float], step: int) -> None:
    if "train/loss" in metrics:
        print(f"[leak]   step {step}: train/loss {metrics['train/loss']:.3f}", flush=True)


def run(kinds: Sequence[str], routings: Sequence[str], steps: int, windows: int, cuts: int, quick: bool,
        cache_dir: Path, extra: Sequence[str] = ()) -> list[Row]:
    rows: list[Row] = []
    for kind in kinds:
        for routing in routings:
            spec = leak_spec(kind, routing, steps, quick, extra)
            start = time.perf_counter()
            print(f"[leak] training {kind} with causal_routing={routing} for {steps} steps", flush=True)
            trainer, _ = train_locally(spec, cache_dir=cache_dir, on_metrics=progress)
            train_s = time.perf_counter() - start
            task, model = trainer.task, trainer.model
            scored = ["paper", "past_only"] if routing == "paper" else ["past_only"]
            for score_routing in scored:
                scorer = with_routing(model, spec, score_routing, task.vocab_size)
                standard = task.evaluate(scorer)
                leak = cut_scores(scorer, task.eval_stream, spec.task.seq_len, windows, cuts, seed=0)
                row: dict[str, Any] = {"kind": kind, "trained_routing": routing, "scored_routing": score_routing,
                                       "steps": steps, "train_s": round(train_s, 1),
                                       "test_ppl": standard["val/ppl"], **leak}
                print("[leak] " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in row.items()), flush=True)
                rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results", help="results root; files go to <out>/<machine>/")
    parser.add_argument("--kinds", nargs="*", default=list(ROUTED_KINDS), choices=list(ROUTED_KINDS))
    parser.add_argument("--routings", nargs="*", default=["paper", "past_only"], choices=["paper", "past_only"])
    parser.add_argument("--steps", type=int, default=1200, help="training steps per model (the recipe's 1200)")
    parser.add_argument("--windows", type=int, default=256, help="test windows to cut")
    parser.add_argument("--cuts", type=int, default=8, help="random cut positions per window")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="built-in corpus, tiny model (about a minute)")
    parser.add_argument("--cache-dir", default=None, help="tokenizer/data cache (default: a temporary folder)")
    parser.add_argument("--name", default="causal_leak", help="file stem of the CSV")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="spec overrides on top of the recipe, e.g. model.d_model=128 model.layers=2")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    steps = 60 if args.quick and args.steps == 1200 else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tmp)
        rows = run(args.kinds, args.routings, steps, args.windows, args.cuts, args.quick, cache, args.set)
    path = write_csv(rows, results_dir(args.out, torch.device("cpu")) / f"{args.name}.csv")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
