"""Translation decoding speed: beam search over a key/value cache against rerunning the decoder over the prefix.

The model of a translation spec (configs/multi30k.yaml by default), with random weights or a trained checkpoint
(`--checkpoint`: a run's checkpoint folder, its exported `evaluation/model` folder, or a file holding
{"model": state_dict}), translates the
first `--sentences` sources of the spec's evaluation split through `TranslationTask.translate` (the task's own
length-sorted batches, beam size and length limits), once with `incremental=False` (full recomputation: every
step reruns the decoder and the output layer over the whole prefix) and once with `incremental=True` (one
position per step over the cache). The two alternate (harness.interleaved_medians), so load from other jobs on
a shared machine hits both alike. Rows also say whether the two gave the same hypotheses and their BLEU.
Both paths drop a sentence from its batch once its beam search is done; `--keep-finished` decodes every sentence
until its whole batch is done (the behaviour before that change, same hypotheses) and writes `*_keep_finished.csv`.

    python -m benchmarks.methods.decoding configs/multi30k.yaml --out benchmarks/results --sentences 200 --threads 1
    python -m benchmarks.methods.decoding configs/multi30k.yaml --out benchmarks/results --sentences 200 --threads 1 \\
        --checkpoint runs/multi30k-de-en/evaluation/model
    python -m benchmarks.methods.decoding configs/multi30k.yaml --out /tmp/bench task.beam_size=5   # dotted overrides
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.harness import Row, interleaved_medians, results_dir, write_csv
from orchestrator.spec import load_spec
from orchestrator.training import read_checkpoint, load_model
from tasks import WorkerContext, build_task
from tasks.translation import corpus_scores

PATHS = {"full_recompute": False, "kv_cache": True}
"""Row name -> beam_search's `incremental`."""


def trained_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """The state dict of an export folder (model.safetensors), a checkpoint folder (state.pt) or a file."""
    path = Path(path)
    if (path / "model.json").is_file():
        return load_model(path).state_dict()
    if path.is_dir():
        return read_checkpoint(path).model
    return torch.load(path, map_location=device, weights_only=False)["model"]


def run(spec_path: str, overrides: list[str], *, sentences: int, repeats: int, checkpoint: Path | None,
        cache_dir: Path, seed: int = 0, drop_finished: bool = True) -> list[Row]:
    spec = load_spec(spec_path, overrides)
    if spec.task.kind != "translation":
        raise SystemExit(f"{spec_path}: task.kind={spec.task.kind}; decoding speed needs a translation spec")
    device = torch.device("cpu")
    task = build_task(spec.task, spec.model, WorkerContext(seed=seed, cache_dir=cache_dir))
    torch.manual_seed(seed)
    model = task.build_model()
    if checkpoint is not None:
        model.load_state_dict(trained_weights(checkpoint, device))
    model.eval()
    sources = task._eval_pairs()[0][:sentences]
    references = task.eval_data.references[: len(sources)]

    outputs: dict[str, list[list[int]]] = {}

    def translate(name: str):
        def call() -> None:
            with torch.no_grad():
                outputs[name] = task.translate(model, sources, device, incremental=PATHS[name],
                                               drop_finished=drop_finished)
        return call

    times = interleaved_medians({name: translate(name) for name in PATHS}, device, warmup=0, repeats=repeats)
    base_s = statistics.median(times["full_recompute"])
    same = sum(a == b for a, b in zip(outputs["full_recompute"], outputs["kv_cache"]))
    rows = []
    for name, seconds in times.items():
        bleu = corpus_scores(task.tokenizer.decode(outputs[name]), references)["val/bleu"]
        rows.append({
            "spec": spec.name, "weights": "checkpoint" if checkpoint else "random", "sentences": len(sources),
            "beam": spec.task.beam_size, "threads": torch.get_num_threads(), "path": name,
            "drop_finished": drop_finished,
            "median_s": statistics.median(seconds), "min_s": min(seconds), "repeats": len(seconds),
            "sentences_per_s": len(sources) / statistics.median(seconds),
            "speedup_vs_full": base_s / statistics.median(seconds),
            "output_pieces": sum(len(h) for h in outputs[name]), "same_hypotheses": same, "bleu": bleu,
        })
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default="configs/multi30k.yaml", help="translation spec (YAML)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. task.beam_size=5")
    parser.add_argument("--out", required=True, type=Path, help="results folder (a machine subfolder is added)")
    parser.add_argument("--sentences", type=int, default=200, help="first N sources of the evaluation split")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds per path")
    parser.add_argument("--checkpoint", type=Path, default=None, help="trained weights; random weights if absent")
    parser.add_argument("--cache-dir", type=Path, default=Path(".cache"), help="tokenizer and prepared-data cache")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--keep-finished", action="store_true",
                        help="decode finished sentences until their batch is done (the reference for dropping them)")
    args = parser.parse_intermixed_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.spec, args.overrides, sentences=args.sentences, repeats=args.repeats,
               checkpoint=args.checkpoint, cache_dir=args.cache_dir, drop_finished=not args.keep_finished)
    weights = "checkpoint" if args.checkpoint else "random"
    suffix = ("" if args.threads == 1 else f"_{args.threads}threads") + ("_keep_finished" if args.keep_finished else "")
    path = write_csv(rows, results_dir(args.out, torch.device("cpu")) / f"decoding_{weights}{suffix}.csv")
    for row in rows:
        print(f"{row['path']:>15}: median {row['median_s']:.1f} s (min {row['min_s']:.1f}, {row['repeats']} rounds), "
              f"{row['sentences_per_s']:.2f} sentences/s, x{row['speedup_vs_full']:.2f}, BLEU {row['bleu']:.1f}, "
              f"{row['output_pieces']} pieces")
    print(f"same hypotheses: {rows[0]['same_hypotheses']}/{rows[0]['sentences']}; wrote {path}")


if __name__ == "__main__":
    main()
