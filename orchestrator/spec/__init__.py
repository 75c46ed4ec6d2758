"""The experiment spec: pydantic models of every block, YAML loading with dotted overrides, and
validation that names the field to fix, all before Ray is started.

A spec file holds `name`, `task`, `model`, `optim`, `run`, `tune` and `tracking`. Any value may be a
search domain (`{grid: [...]}`, see search_space.py here); such a spec is a *study*, run with
`orchestrator sweep`, and every grid combination is validated as a full spec up front. A spec file may
also start from another with `base: other.yaml` and give only what differs (`read_yaml`, `merge_base`).

Modules: `models` (the pydantic blocks and ExperimentSpec), `loading` (files, `base:` chains, scales,
overrides, validation, studies), `merge` (how a base and a child merge), `messages` (errors that name the
field), `search_space` (the domain syntax and Tune's param space), `names` (what a run may be called),
`resources` (GPUs a spec asks for against what a machine has), `gpus` (memory and bf16 peak of each GPU kind),
`counting` (FLOPs and peak memory of a trial's training step, on fake tensors), `vocabulary` (the vocabulary size
a trial's model is counted at: its run's tokenizer's), `plan` (`orchestrator plan`: every trial's fit, step time
and GPU-hours on a GPU kind). The names below are the package's API.
"""

from orchestrator.spec.counting import workload
from orchestrator.spec.gpus import DEFAULT_GPU, GPUS, GpuKind, gpu_kind, peak_bf16_flops
from orchestrator.spec.loading import (
    RESUME_OVERRIDES,
    Study,
    apply_overrides,
    apply_resume_overrides,
    apply_scale,
    expected_trials,
    load_spec,
    load_study,
    read_yaml,
    study_from_raw,
    validate_spec,
)
from orchestrator.spec.merge import merge_base
from orchestrator.spec.models import (
    ExperimentSpec,
    OptimConfig,
    RunSettings,
    SpecError,
    TrackingSettings,
    TuneSettings,
    spec_to_yaml,
)
from orchestrator.spec.names import MAX_NAME_LENGTH, NAME_PATTERN, name_problem
from orchestrator.spec.plan import (
    format_plan,
    plan_spec,
    plan_study,
    refusals,
)
from orchestrator.spec.resources import check_gpus, local_gpu_count

__all__ = [
    "MAX_NAME_LENGTH", "NAME_PATTERN", "RESUME_OVERRIDES", "ExperimentSpec", "OptimConfig", "RunSettings",
    "SpecError", "Study", "TrackingSettings", "TuneSettings", "apply_overrides", "apply_resume_overrides",
    "apply_scale", "check_gpus", "expected_trials", "load_spec", "load_study", "local_gpu_count", "merge_base",
    "name_problem", "read_yaml", "spec_to_yaml", "study_from_raw", "validate_spec",
    "DEFAULT_GPU", "GPUS", "GpuKind", "gpu_kind", "peak_bf16_flops", "format_plan", "plan_spec", "plan_study",
    "refusals", "workload",
]
