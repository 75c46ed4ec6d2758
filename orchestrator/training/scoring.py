"""Scoring a checkpoint on a split, uncapped: the final test evaluation of a run and `orchestrator evaluate`.

Ray-free and MLflow-free: it reads a checkpoint folder (orchestrator/training/checkpoint.py), rebuilds the task with
`eval_split` set to the requested split and the quick-check caps (`eval_batches`, `eval_max_sentences`)
removed, loads the weights and runs the task's own evaluation. Metric names keep the task's, with the split
as prefix (`test/bleu`, `test/ppl`); a causal LM also gets per-word perplexity (`test/word_ppl`: the same
total log-loss spread over words plus one end-of-line per line, as word-level WikiText results count <eos>).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from orchestrator.spec import ExperimentSpec
from orchestrator.training.checkpoint import TOKENIZER_FILE, read_checkpoint
from orchestrator.training.export import ARCHITECTURES, export_model
from orchestrator.training.trainer import set_tf32
from tasks import TaskConfig, WorkerContext, build_task
from tasks.data import lm_texts

SPLITS = ("validation", "test")


@dataclass(frozen=True)
class Evaluation:
    split: str
    step: int
    """The optimizer step of the scored checkpoint."""
    metrics: dict[str, float]
    """`<split>/<name>` metrics, plus `<split>/checkpoint_step`."""
    files: dict[str, Path] = field(default_factory=dict)
    """Outputs worth keeping (translation hypotheses as `<split>.hyp`)."""


def split_task_config(task_cfg: TaskConfig, split: str) -> TaskConfig | None:
    """The task block scoring all of `split`, or None when the spec's data has no such split (local files
    without it; the builtin corpus and hub datasets are asked when loading)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: choose one of {SPLITS}")
    update: dict[str, Any] = {"eval_split": split, "eval_batches": None}
    if task_cfg.kind == "translation":
        update["eval_max_sentences"] = None
    try:
        return type(task_cfg).model_validate({**task_cfg.model_dump(), **update})
    except ValidationError:
        return None  # task.files has no file for the split


def word_level_perplexity(task_cfg: TaskConfig, split: str, loss_per_piece: float, n_pieces: int,
                          cache_dir: Path) -> dict[str, float]:
    lines = lm_texts(task_cfg, (split,), cache_dir)[split]
    n_words = sum(len(line.split()) + 1 for line in lines)
    return {f"{split}/word_ppl": math.exp(min(loss_per_piece * n_pieces / n_words, 50.0)),
            f"{split}/words": float(n_words), f"{split}/pieces": float(n_pieces)}


def evaluate_checkpoint(directory: Path, split: str, *, cache_dir: Path, out_dir: Path,
                        device: torch.device | None = None, export: bool = False,
                        model_update: dict[str, Any] | None = None) -> Evaluation:
    """Score the checkpoint in `directory` on all of `split`; outputs go to `out_dir`, and with `export` the
    scored model too, as `out_dir/model` (orchestrator/training/export.py). `model_update` replaces top-level fields of
    the checkpoint's model config, for options no parameter depends on (e.g. a Transformer-XL memory block
    with another mem_len: benchmarks/methods/memory_swap.py)."""
    state = read_checkpoint(Path(directory))
    spec = ExperimentSpec.model_validate(state.spec)  # every checkpoint holds its resolved spec
    if model_update:
        spec = spec.model_copy(update={"model": spec.model.model_copy(update=model_update)})
    task_cfg = split_task_config(spec.task, split)
    if task_cfg is None:
        raise ValueError(f"the run's data has no {split} split (task.files.{split} is not set); "
                         "score another split with --split, or add the file to the spec")
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # The run's matmul precision, as its validation had: a fresh process (the final evaluation's Ray task, the
    # `evaluate` command) otherwise scores with PyTorch's full-fp32 matmuls, slower and other arithmetic.
    set_tf32(spec.run, device)
    tokenizer = Path(directory) / TOKENIZER_FILE  # the run's own; older checkpoints rebuild it from the data
    task = build_task(task_cfg, spec.model, WorkerContext(seed=spec.optim.seed, device=device,
                                                          cache_dir=Path(cache_dir),
                                                          tokenizer_path=tokenizer if tokenizer.is_file() else None))
    model = task.build_model()
    model.load_state_dict(state.model)
    model.to(device)
    model.eval()
    with torch.no_grad():
        raw = task.evaluate(model)
    metrics = {f"{split}/{name.split('/', 1)[1]}": value for name, value in raw.items()}
    if task_cfg.kind == "clm":
        metrics.update(word_level_perplexity(task_cfg, split, raw["val/loss"], len(task.eval_stream) - 1, cache_dir))
    metrics[f"{split}/checkpoint_step"] = float(state.step)
    files: dict[str, Path] = {}
    # Outputs per example: translations (`<split>.hyp`) or predicted labels (`<split>.pred`), one per line.
    for name, suffix in (("hypotheses", "hyp"), ("predictions", "pred")):
        produced = task.artifacts().get(name)
        if produced is not None and Path(produced).exists():
            Path(out_dir).mkdir(parents=True, exist_ok=True)
            files[name] = Path(shutil.copy(produced, Path(out_dir) / f"{split}.{suffix}"))
    # A fine-tuned pretrained_lm model is a patched Hugging Face model: it has no export architecture of its own.
    if export and task_cfg.kind in ARCHITECTURES:
        files["model"] = export_model(model.cpu(), task_kind=task_cfg.kind, model_cfg=spec.model,
                                      vocab_size=task.vocab_size, out_dir=Path(out_dir) / "model",
                                      tokenizer=task.artifacts().get("tokenizer"),
                                      extra={"run": spec.name, "step": state.step, f"{split}_metrics": metrics,
                                             **_head_config(task_cfg)})
    return Evaluation(split=split, step=state.step, metrics=metrics, files=files)


def _head_config(task_cfg: TaskConfig) -> dict[str, Any]:
    """What an exported model needs besides the model block (export.build_exported): a classifier's head, or
    the architecture of a causal associative-recall model (its kind exports as masked_lm by default)."""
    if task_cfg.kind == "listops":
        from tasks.listops import NUM_CLASSES

        return {"num_classes": NUM_CLASSES, "pooling": task_cfg.pooling, "label_names": None}
    if task_cfg.kind == "mqar" and task_cfg.causal:
        return {"architecture": "causal_lm"}
    if task_cfg.kind != "classify":
        return {}
    return {"num_classes": task_cfg.num_classes, "pooling": task_cfg.pooling,
            "label_names": list(task_cfg.label_names) if task_cfg.label_names else None}
