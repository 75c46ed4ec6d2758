"""The length checks of the mechanisms' configs (`_MechanismConfig.check_length`): knobs that make a mechanism
degenerate when they exceed the longest sequence a task feeds it. Each kind's config class takes its function as
its `check_length` (models/attention/linformer.py, lsh.py, hyper.py); the spec check (orchestrator/spec/models.py)
calls it with the task's longest sequence, so `validate` refuses what would silently waste a run.

Only what is certainly degenerate is refused: a knob equal to the longest sequence is allowed."""

from __future__ import annotations

import math
from typing import Any


def _longer(field: str, value: Any, longest: int, source: str, why: str) -> ValueError:
    return ValueError(f"{field}={value} is larger than the longest sequence the task feeds, {source}={longest}: {why}")


def linformer_length(cfg: Any, longest: int, source: str, where: str) -> None:
    """Linformer (Wang et al., 2020) projects the n keys and values of a sequence to k: k > n pads, not compresses.
    E/F have one column per position up to max_seq_len, so a longer sequence has no column: the module refuses it
    at the first forward, inside Ray; refused here instead, before any Ray time."""
    if cfg.max_seq_len is not None and cfg.max_seq_len < longest:
        raise ValueError(f"{where}.max_seq_len={cfg.max_seq_len} is shorter than the longest sequence the task "
                         f"feeds, {source}={longest}: the Linformer projection has one column per position, so the "
                         f"run would stop at its first step; raise {where}.max_seq_len to at least {longest} (unset, "
                         f"it is model.max_seq_len), or lower {source}")
    too_big = [k for k in (cfg.k if isinstance(cfg.k, list) else [cfg.k]) if k > longest]
    if too_big:
        raise _longer(f"{where}.k", too_big[0], longest, source,
                      "Linformer projects the n keys and values of a sequence down to k, so k > n adds slots "
                      f"instead of compressing and costs more than exact attention; choose k <= {longest} (the "
                      f"paper uses k well below n), or raise {source}")


def lsh_length(cfg: Any, longest: int, source: str, where: str) -> None:
    """Reformer's LSH (Kitaev et al., 2020): a chunk longer than the sequence, or more buckets than tokens."""
    if cfg.bucket_size > longest:
        raise _longer(f"{where}.bucket_size", cfg.bucket_size, longest, source,
                      "the whole sequence falls in one chunk padded to bucket_size, which costs more than exact "
                      f"attention; choose bucket_size <= {longest} (Reformer uses 32-64), or raise {source}")
    buckets = math.prod(cfg.n_buckets) if isinstance(cfg.n_buckets, list) else cfg.n_buckets or 0
    if buckets > longest:
        raise ValueError(
            f"{where}.n_buckets={cfg.n_buckets} makes {buckets} buckets per hash round for at most {longest} tokens "
            f"({source}): most tokens would sit alone in their bucket and attend to almost nothing; use at most "
            f"{longest} buckets, or leave {where}.n_buckets unset for 2 * seq_len / bucket_size")


def hyper_length(cfg: Any, longest: int, source: str, where: str) -> None:
    """HyperAttention (Han et al., 2023): inputs shorter than min_seq_len run exact attention, and a block longer
    than the sequence pads it to one block."""
    if cfg.min_seq_len > longest:
        raise _longer(f"{where}.min_seq_len", cfg.min_seq_len, longest, source,
                      "inputs shorter than min_seq_len run exact attention, so HyperAttention would never run "
                      f"(exact attention under another name); lower min_seq_len to at most {longest}, or use "
                      "attention kind mha for exact attention")
    if cfg.block_size > longest:
        raise _longer(f"{where}.block_size", cfg.block_size, longest, source,
                      "every sequence is padded to one block, which costs more than exact attention; choose "
                      f"block_size <= {longest} (the paper uses 256 on sequences of thousands), or raise {source}")


def hyper_model(cfg: Any, model: Any, where: str) -> None:
    """The hyper mechanism's check of the whole model at validate (its module makes the same one at build)."""
    hyper_dropout(model.attention.dropout)


def hyper_dropout(dropout: float) -> None:
    """The hyper mechanism merges its parts through their log-sum-exp: no dropout on the attention weights."""
    if dropout:
        raise ValueError(f"model.attention.dropout={dropout} is not supported by the hyper mechanism (its parts are "
                         "merged through their log-sum-exp); set model.attention.dropout to 0")
