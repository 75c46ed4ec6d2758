"""Data and objectives behind the Task protocol of tasks/base.py: masked LM, causal LM, translation and
classification, and the long-range tasks (ListOps, associative recall, byte-level LM: tasks/long_range.py).

`check_compatible(task_cfg, model_cfg)` is the cheap spec-level check the orchestrator runs before Ray starts;
`build_task(task_cfg, model_cfg, ctx)` builds the task on a worker (tokenizer and token ids come from the cache
under ctx.cache_dir after the first build, so it is cheap to call on every worker).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from models import ModelConfig
from tasks.base import Batch, Task, WorkerContext
from tasks.classify import ClassificationTask
from tasks.config import (
    TASK_KINDS,
    ByteLMTaskConfig,
    CausalLMTaskConfig,
    ClassifyTaskConfig,
    ListOpsTaskConfig,
    MLMTaskConfig,
    MQARTaskConfig,
    PretrainedLMTaskConfig,
    TaskConfig,
    TranslationTaskConfig,
)
from tasks.lm import CausalLMTask, MaskedLMTask
from tasks.long_range import ByteLMTask, ListOpsTask, MQARTask, check_long_range
from tasks.pretrained_lm import PretrainedLMTask
from tasks.translation import TranslationTask


def _supports_causal(model_cfg: ModelConfig) -> bool:
    """Ask the attention module itself (a throwaway layer-0 instance), so new kinds need no table here."""
    try:
        hash(model_cfg.attention)
    except TypeError:  # a block holding a list: asked afresh
        return _attention_supports_causal.__wrapped__(type(model_cfg), model_cfg.attention)
    return _attention_supports_causal(type(model_cfg), model_cfg.attention)


@functools.lru_cache(maxsize=64)
def _attention_supports_causal(config_cls: type[ModelConfig], attention: Any) -> bool:
    """Built on the meta device: the answer is the module's class, not its values, and a real layer 0 of
    d_model=16384 held 4 GB of weights in `orchestrator validate` and in every worker's build_task. Cached per
    block (the config class carries the registry): validation asks once per grid point, and the points of a
    large grid share a few attention blocks; a meta build still costs a millisecond of module set-up."""
    with torch.device("meta"):
        attention_module = config_cls.attention_registry.build_attention(attention, 0, nn.ModuleDict())
    return attention_module.supports_causal


def check_compatible(task_cfg: TaskConfig, model_cfg: ModelConfig) -> None:
    """Raise ValueError naming the spec fields when the task cannot run on this model."""
    if isinstance(task_cfg, PretrainedLMTaskConfig):
        if model_cfg != type(model_cfg)():
            raise ValueError("task.kind: pretrained_lm takes its model from task.pretrained and patches it with "
                             "task.patch; remove the model: block (its fields would be ignored), and sweep "
                             "task.patch.* instead of model.*")
        return
    if isinstance(task_cfg, (MLMTaskConfig, CausalLMTaskConfig)):
        if task_cfg.seq_len > model_cfg.max_seq_len:
            raise ValueError(f"task.seq_len={task_cfg.seq_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; "
                             "lower task.seq_len or raise model.max_seq_len")
    elif isinstance(task_cfg, TranslationTaskConfig):
        if task_cfg.max_source_len > model_cfg.max_seq_len:
            raise ValueError(f"task.max_source_len={task_cfg.max_source_len} exceeds model.max_seq_len="
                             f"{model_cfg.max_seq_len}; lower task.max_source_len or raise model.max_seq_len")
    elif isinstance(task_cfg, ClassifyTaskConfig):
        if task_cfg.max_len > model_cfg.max_seq_len:
            raise ValueError(f"task.max_len={task_cfg.max_len} exceeds model.max_seq_len={model_cfg.max_seq_len}; "
                             "lower task.max_len or raise model.max_seq_len (to the pretraining run's)")
    elif isinstance(task_cfg, (ListOpsTaskConfig, MQARTaskConfig, ByteLMTaskConfig)):
        check_long_range(task_cfg, model_cfg)
    else:
        raise ValueError(f"task.kind must be one of {TASK_KINDS} (got {type(task_cfg).__name__})")
    if model_cfg.init_from is not None and task_cfg.kind != "classify":
        raise ValueError(f"model.init_from fine-tunes a pretrained encoder for task.kind: classify (got "
                         f"{task_cfg.kind}); remove model.init_from, or set task.kind: classify")
    if model_cfg.memory is not None and task_cfg.kind != "clm":
        raise ValueError(f"model.memory requires a causal LM task (task.kind: clm; got {task_cfg.kind}): the "
                         "cached states are the left context of the next segment of one text stream. Remove "
                         "model.memory, or set task.kind: clm")
    if model_cfg.positional == "relative" and task_cfg.kind != "clm":
        raise ValueError(f"model.positional: relative requires a causal LM task (task.kind: clm; got "
                         f"{task_cfg.kind}): Transformer-XL's relative attention is causal self-attention. Use "
                         "model.positional: learned or sinusoidal with this task")
    causal = task_cfg.kind in ("clm", "translation", "bytelm") or (task_cfg.kind == "mqar" and task_cfg.causal)
    if causal and not _supports_causal(model_cfg):
        raise ValueError(
            f"model.attention.kind={model_cfg.attention.kind!r} mixes future positions and cannot run causal "
            f"attention, which task.kind={task_cfg.kind!r} needs (a causal LM, a translation decoder, or "
            "task.causal: true); use it with task.kind: mlm, listops or mqar (task.causal: false), or choose a "
            "causal-capable attention kind"
        )


_TASKS = {MLMTaskConfig: MaskedLMTask, CausalLMTaskConfig: CausalLMTask, ClassifyTaskConfig: ClassificationTask,
          TranslationTaskConfig: TranslationTask, ListOpsTaskConfig: ListOpsTask, MQARTaskConfig: MQARTask,
          ByteLMTaskConfig: ByteLMTask, PretrainedLMTaskConfig: PretrainedLMTask}
"""Each task block's class -> the task it builds."""


def build_task(task_cfg: TaskConfig, model_cfg: ModelConfig, ctx: WorkerContext) -> Task:
    """The task of a spec on one worker: model builder, sharded batches, loss, evaluation."""
    check_compatible(task_cfg, model_cfg)
    return _TASKS[type(task_cfg)](task_cfg, model_cfg, ctx)


__all__ = [
    "Batch",
    "ByteLMTaskConfig",
    "CausalLMTaskConfig",
    "ClassifyTaskConfig",
    "ListOpsTaskConfig",
    "MLMTaskConfig",
    "MQARTaskConfig",
    "PretrainedLMTaskConfig",
    "Task",
    "TaskConfig",
    "TranslationTaskConfig",
    "WorkerContext",
    "build_task",
    "check_compatible",
]
