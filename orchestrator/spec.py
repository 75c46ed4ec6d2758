"""The experiment spec: pydantic models of every block, YAML loading with dotted overrides, and
validation that names the field to fix, all before Ray is started.

A spec file holds `name`, `task`, `model`, `optim`, `run`, `tune` and `tracking`. Any value may be a
search domain (`{grid: [...]}`, see orchestrator/search_space.py); such a spec is a *study*, run with
`orchestrator sweep`, and every grid combination is validated as a full spec up front. A spec file may
also start from another with `base: other.yaml` and give only what differs (`read_yaml`, `merge_base`).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from models import ModelConfig
from orchestrator.search_space import (
    DOMAIN_KINDS,
    Domain,
    SearchSpaceError,
    find_domains,
    grid_points,
    resolve,
    set_path,
    validation_points,
)
from tasks import check_compatible
from tasks.config import TaskConfig

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class SpecError(ValueError):
    """A spec cannot be run; the message names the field(s) and how to fix them."""


class _Section(BaseModel):
    # validate_default: the defaults of storage_path and tracking.uri are relative and must be made absolute too.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class OptimConfig(_Section):
    """AdamW with a warmup + decay learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW (beta1, beta2)."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to `lr`."""
    schedule: Literal["cosine", "linear", "inverse_sqrt", "constant"] = "cosine"
    """Decay after warmup: cosine or linear to 0 at max_steps, inverse_sqrt (Vaswani et al., 2017), or constant."""
    max_steps: int = 1000
    """Optimizer steps of the run (each is grad_accum micro-batches)."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    grad_clip: float | None = 1.0
    """Max global gradient norm; null disables clipping."""
    seed: int = 0
    """Seeds model init, dropout and data order; the same seed on CPU gives the same loss curve."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0 (got {self.lr})")
        if self.max_steps < 1 or self.grad_accum < 1:
            raise ValueError("optim.max_steps and optim.grad_accum must be >= 1")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(
                f"optim.warmup_steps={self.warmup_steps} must be in [0, optim.max_steps={self.max_steps}]; "
                "shorten the warmup or train longer"
            )
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"optim.grad_clip must be > 0 or null to disable (got {self.grad_clip})")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must both be in [0, 1) (got {self.betas})")
        return self


class RunSettings(_Section):
    """How one training run is placed and checkpointed (the `run:` block)."""

    workers: int = 1
    """Ray Train workers (DDP ranks) per run."""
    gpus_per_worker: float = 0
    """GPUs per worker; 0 trains on CPU with the gloo backend."""
    cpus_per_worker: float = 1
    """CPUs reserved per worker."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32; bf16 autocast (GPU only); or fp16 autocast with dynamic loss scaling (GradScaler; for GPUs without
    bf16 such as V100/T4; also runs on CPU, slowly): overflowing steps are skipped and counted (train/skipped_steps)."""
    tf32: bool = True
    """On CUDA, let fp32 matmuls and convolutions use TF32 tensor cores (Ampere and newer; no effect on CPU or
    older GPUs): ~10-bit mantissa products, fp32 accumulation."""
    compile: bool = False
    """torch.compile the model (in place, before DDP/FSDP wrapping); the first steps pay the compilation."""
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    """torch.compile backend: inductor generates kernels (C++ on CPU with the machine's compiler, Triton on GPU);
    aot_eager and eager only trace (cheap; for checking that a model compiles)."""
    activation_checkpointing: bool = False
    """Recompute each transformer layer's activations in backward instead of storing them (torch.utils.checkpoint):
    about one extra forward per step for activation memory of one layer. Reversible stacks already recompute."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """How Ray Train's prepare_model wraps the model across workers: ddp (replicated) or fsdp (sharded
    parameters, gradients and optimizer state; needs GPUs: torch's FSDP has no CPU backend)."""
    collective_timeout_s: int = 1800
    """Timeout of the process group's collectives (Ray's TorchConfig(timeout_s)): rank 0 evaluates alone while
    the other ranks wait at the next collective, so raise it above the time of one evaluation on long splits."""
    prefetch_batches: int = 2
    """Batches built ahead on a background thread (pinned memory on CUDA) while the device trains; 0 builds
    them on the training thread. The order and resume positions are the same either way."""
    checkpoint_upload: Literal["sync", "async"] = "sync"
    """sync: a report returns once its checkpoint is in storage and registered by Ray. async: training goes on
    while Ray uploads it in the background (ray.train.report's checkpoint_upload_mode); at most one upload is in
    flight, so a kill during an upload resumes from the checkpoint before (up to 2 x checkpoint_every steps back)."""
    checkpoint_every: int = 500
    """Optimizer steps between checkpoints (the last step always checkpoints)."""
    keep_checkpoints: int = 2
    """Checkpoints kept in storage (Ray's CheckpointConfig.num_to_keep); older ones are deleted."""
    eval_every: int = 500
    """Optimizer steps between evaluations; every evaluation is one report to Ray (and one ASHA rung step)."""
    log_every: int = 50
    """Optimizer steps between train/* metric lines (console + MLflow)."""
    storage_path: str = "runs"
    """Where runs, sweeps and checkpoints live: a local dir (made absolute) or a shared URI such as s3://bucket/runs."""
    shared_storage: bool = False
    """storage_path is a local path that every node of the cluster mounts (NFS, EFS, ...): lets it be used on a
    multi-node cluster, which otherwise refuses a local storage_path (each node would write its own copy)."""
    max_failures: int = 2
    """Worker-group restarts Ray Train attempts from the latest checkpoint before the run fails (-1: unlimited):
    a lost node or a killed worker. Spot reclaims that Ray sees coming (node drained as preempted) have their own
    unlimited budget in Ray Train and do not count; a deterministic error (NaN loss) fails again each time, so
    keep this small."""
    stop_on_nan: bool = True
    """Stop the run when train/loss or val/loss is NaN or infinite (an errored trial in a sweep; the sweep goes
    on); the diverged state is never checkpointed. false keeps training whatever the loss."""
    final_eval: bool = True
    """At the end, score the best checkpoint (by tune.metric) on all of the test split, export the model, and
    log both to the run (`test/*` metrics, `model/` artifacts); skipped when the data has no test split."""

    @field_validator("storage_path")
    @classmethod
    def _absolute_storage(cls, value: str) -> str:
        # Ray workers (and Tune trial drivers) do not share the launcher's cwd: keep only absolute paths.
        return value if "://" in value else str(Path(value).expanduser().resolve())

    @model_validator(mode="after")
    def _check(self) -> RunSettings:
        for name in ("workers", "checkpoint_every", "keep_checkpoints", "eval_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"run.{name} must be >= 1 (got {getattr(self, name)})")
        if self.gpus_per_worker < 0 or self.cpus_per_worker <= 0:
            raise ValueError("run.gpus_per_worker must be >= 0 and run.cpus_per_worker > 0")
        if self.workers > 1 and 0 < self.gpus_per_worker < 1:
            raise ValueError(
                f"run.gpus_per_worker={self.gpus_per_worker:g} with run.workers={self.workers}: DDP over NCCL needs a "
                "whole GPU per rank (two ranks on one GPU fail in NCCL); use run.gpus_per_worker=1, or run.workers=1 "
                "to pack several runs per GPU"
            )
        if self.gpus_per_worker > 1 and self.gpus_per_worker != int(self.gpus_per_worker):
            raise ValueError(f"run.gpus_per_worker={self.gpus_per_worker:g}: above 1, give a whole number of GPUs")
        if self.precision == "bf16" and self.gpus_per_worker == 0:
            raise ValueError("run.precision=bf16 needs GPUs (run.gpus_per_worker > 0); use precision: fp32 on CPU")
        if self.max_failures < -1:
            raise ValueError("run.max_failures must be >= 0, or -1 for unlimited retries")
        if self.strategy == "fsdp" and self.gpus_per_worker == 0:
            raise ValueError("run.strategy=fsdp needs GPUs (run.gpus_per_worker > 0): torch's FullyShardedDataParallel "
                             "has no CPU backend; use strategy: ddp on CPU")
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ValueError("run.precision=fp16 is not supported with run.strategy=fsdp (its sharded gradients need "
                             "a sharded loss scaler); use precision: bf16 with fsdp, or strategy: ddp with fp16")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"run.collective_timeout_s must be > 0 (got {self.collective_timeout_s})")
        if self.prefetch_batches < 0:
            raise ValueError(f"run.prefetch_batches must be >= 0 (got {self.prefetch_batches}); 0 disables prefetching")
        return self

    @property
    def gpus_per_run(self) -> float:
        return self.workers * self.gpus_per_worker


class TuneSettings(_Section):
    """How a sweep searches and schedules trials (the `tune:` block)."""

    metric: str | None = None
    """Metric compared across trials; must be one the task reports (default: the task's own, e.g. val/ppl)."""
    mode: Literal["min", "max"] | None = None
    """Whether lower or higher `metric` is better (default: the task's, e.g. min for val/ppl)."""
    scheduler: Literal["asha", "fifo"] = "asha"
    """asha stops weak trials early at evaluation rungs; fifo runs every trial to max_steps."""
    grace_period: int = 1
    """ASHA: evaluations a trial always gets before it may be stopped."""
    reduction_factor: int = 2
    """ASHA: keep the top 1/reduction_factor of trials at each rung."""
    search: Literal["grid", "random", "optuna"] = "grid"
    """grid: every grid combination x num_samples; random: grids drawn like choices; optuna: TPE (Optuna)."""
    num_samples: int = 1
    """grid: repeats of the grid (each draws new random values); random/optuna: trials in total."""
    max_concurrent: int | None = None
    """Trials at once; default the cluster's GPUs / GPUs per trial (CPU: CPUs / (workers * cpus_per_worker)),
    counting what the autoscaler may add (its node types' max_workers x resources), not only the nodes up now."""
    max_failures: int = 1
    """Retries of a trial whose Train run failed after its own run.max_failures restarts; a retried trial resumes
    its Train run from its last checkpoint under the same MLflow child run (-1: unlimited)."""

    @model_validator(mode="after")
    def _check(self) -> TuneSettings:
        if self.num_samples < 1 or self.grace_period < 1:
            raise ValueError("tune.num_samples and tune.grace_period must be >= 1")
        if self.reduction_factor < 2:
            raise ValueError(f"tune.reduction_factor must be >= 2 (got {self.reduction_factor})")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError("tune.max_concurrent must be >= 1, or omitted to derive it from the cluster")
        if self.max_failures < -1:
            raise ValueError("tune.max_failures must be >= 0, or -1 for unlimited retries")
        return self


class TrackingSettings(_Section):
    """Where runs are logged (the `tracking:` block)."""

    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a local SQLite file (made absolute) or a server such as http://head:5000."""
    experiment: str | None = None
    """MLflow experiment (one per study); defaults to the spec's name."""
    retries: int = 3
    """Attempts per logging call before it is dropped with a warning (training never stops for logging)."""
    timeout_s: float = 5.0
    """HTTP timeout of one MLflow request; keeps a slow or dead server from stalling training."""
    offline_ok: bool = False
    """Start even when `uri` cannot be reached (otherwise refused before Ray starts); metrics wait in the run
    folder's spool and are sent when the store answers, at the latest by `orchestrator resume`."""
    system_metrics: bool = False
    """Log MLflow's system metrics (system/*: CPU, memory, disk, network, and GPU utilisation and memory where
    NVIDIA's NVML is installed) from rank 0's node every `system_metrics_interval_s`."""
    system_metrics_interval_s: float = 10.0

    @field_validator("uri")
    @classmethod
    def _absolute_sqlite(cls, value: str) -> str:
        # The Tune driver and Ray workers run in other directories: a relative SQLite path would split the store.
        prefix = "sqlite:///"
        if value.startswith(prefix) and not value.startswith(prefix + "/") and value != prefix + ":memory:":
            return prefix + str(Path(value[len(prefix):]).resolve())
        return value

    @model_validator(mode="after")
    def _check(self) -> TrackingSettings:
        if self.retries < 1 or self.timeout_s <= 0:
            raise ValueError("tracking.retries must be >= 1 and tracking.timeout_s > 0")
        if self.system_metrics_interval_s <= 0:
            raise ValueError("tracking.system_metrics_interval_s must be > 0")
        return self


class ExperimentSpec(_Section):
    """A complete, resolved experiment: everything a run needs, and what is stored in its checkpoints."""

    name: str = Field(pattern=_NAME_PATTERN)
    """Run or sweep name (letters, digits, . _ -); names the storage folder and the MLflow experiment."""
    task: TaskConfig
    """Data and objective: {kind: mlm | clm | translation, ...} (tasks/config.py)."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Architecture, including the attention block (models/config.py)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    run: RunSettings = Field(default_factory=RunSettings)
    tune: TuneSettings = Field(default_factory=TuneSettings)
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)
    pretrain: dict[str, Any] | None = None
    """Two stages in one run or trial: first pretrain this spec's model with these fields merged over the spec
    ({task: {kind: mlm, ...}, optim: {...}, run: {...}}; model, name, tune and tracking stay the spec's), then
    fine-tune the spec itself from that run (model.init_from is filled in). See `pretraining_spec`."""

    @model_validator(mode="before")
    @classmethod
    def _default_experiment(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and isinstance(data.get("tracking", {}), Mapping):
            tracking = dict(data.get("tracking") or {})
            if tracking.get("experiment") is None and isinstance(data.get("name"), str):
                tracking["experiment"] = data["name"]
            data = {**data, "tracking": tracking}
        return data

    @model_validator(mode="after")
    def _check(self) -> ExperimentSpec:
        if self.model.freeze != "none" and self.model.init_from is None and self.pretrain is None:
            raise ValueError(f"model.freeze={self.model.freeze} keeps pretrained weights fixed, but nothing is "
                             "pretrained: name the pretraining run in model.init_from (or add a pretrain: stage), "
                             "or set model.freeze: none")
        if self.pretrain is not None:
            self._check_pretrain()
        check_compatible(self.task, self.model)
        metrics = tuple(self.task.metrics)
        if self.tune.metric is not None and self.tune.metric not in metrics:
            raise ValueError(
                f"tune.metric={self.tune.metric!r} is not reported by task.kind={self.task.kind}; "
                f"choose one of {list(metrics)}"
            )
        if self.tune.metric is None or self.tune.mode is None:
            # Resolve the task's defaults so that the stored spec and the MLflow params say what was compared.
            tune = self.tune.model_copy(update={"metric": self.tune.metric or self.task.default_metric,
                                                "mode": self.tune.mode or self.task.default_mode})
            return self.model_copy(update={"tune": tune})
        return self

    def _check_pretrain(self) -> None:
        extra = sorted(set(self.pretrain) - set(_PRETRAIN_FIELDS))
        if extra:
            raise ValueError(f"pretrain.{extra[0]} cannot be set: the pretraining stage takes {list(_PRETRAIN_FIELDS)} "
                             "and shares the spec's model (its weights are what fine-tuning starts from), name, "
                             "tune and tracking")
        if self.model.init_from is not None:
            raise ValueError("model.init_from and pretrain: are both set; the pretrain: stage makes the run to "
                             "fine-tune from, so remove one of them")
        if self.task.kind != "classify":
            raise ValueError(f"pretrain: is a stage before fine-tuning for task.kind: classify (got "
                             f"{self.task.kind}); remove pretrain:, or set task.kind: classify")
        stage = self.pretraining_spec()
        if stage.task.kind != "mlm":
            raise ValueError(f"pretrain.task.kind must be mlm (got {stage.task.kind}): classification fine-tunes "
                             "the bidirectional encoder of a masked LM")

    def pretraining_spec(self) -> ExperimentSpec:
        """Stage 1 of a two-stage spec: the spec's model (without init_from or freezing) with `pretrain`'s task,
        optim and run merged over the spec's, compared on the pretraining task's own metric."""
        assert self.pretrain is not None, "pretraining_spec() is for specs with a pretrain: stage"
        raw = self.model_dump(mode="json", exclude={"pretrain"})
        raw["name"] = f"{self.name}-pretrain"
        raw["model"] = {**raw["model"], "init_from": None, "freeze": "none"}
        raw["tune"] = {**raw["tune"], "metric": None, "mode": None}  # the pretraining task's own
        raw["task"] = {}  # the stage names its task in full: the fine-tuning task's fields mean nothing to it
        try:
            return ExperimentSpec.model_validate(_merge(raw, self.pretrain))
        except ValidationError as err:
            raise ValueError("pretrain: " + _describe(err, self.pretrain).strip()) from None

    def finetuning_spec(self, init_from: str) -> ExperimentSpec:
        """Stage 2 of a two-stage spec: this spec, fine-tuned from the pretraining run stored at `init_from`."""
        model = self.model.model_copy(update={"init_from": init_from})
        return self.model_copy(update={"model": model, "pretrain": None})

    @property
    def metric(self) -> str:
        """The compared metric: tune.metric, or the task's default."""
        return self.tune.metric or self.task.default_metric

    @property
    def mode(self) -> Literal["min", "max"]:
        return self.tune.mode or self.task.default_mode


_PRETRAIN_FIELDS = ("task", "optim", "run")


# --- loading --------------------------------------------------------------------------------------


def _read_mapping(path: Path, missing: str) -> dict[str, Any]:
    if not path.is_file():
        raise SpecError(missing)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(f"{path}: not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a spec is a mapping with name/task/model/... keys, got {type(data).__name__}")
    return data


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in a spec file, with its `base:` chain merged in (see `merge_base`); a clear error for a
    missing file, a non-mapping document, a missing base file or a cycle of bases."""
    path = Path(path)
    return _read_with_bases(
        path, f"spec file {str(path)!r} not found; pass the path of a YAML spec such as configs/smoke.yaml", ())


def _read_with_bases(path: Path, missing: str, chain: tuple[Path, ...]) -> dict[str, Any]:
    raw = _read_mapping(path, missing)
    if "base" not in raw:
        return raw
    base_name = raw.pop("base")
    if not isinstance(base_name, str) or not base_name:
        raise SpecError(f"{path}: base must be the path of another spec file (relative to this one), "
                        f"e.g. base: mhe.yaml; got {base_name!r}")
    if "name" not in raw:
        raise SpecError(f"{path}: name is required in a spec with base: {base_name} (a base's name is never "
                        "inherited: it names the storage folder and the MLflow experiment); add e.g. "
                        f"name: {path.stem.replace('_', '-')}")
    base_path = (path.parent / base_name).resolve()
    seen = (*chain, path.resolve())
    if base_path in seen:
        cycle = " -> ".join(str(p) for p in (*seen[seen.index(base_path):], base_path))
        raise SpecError(f"{path}: base: {base_name} makes a cycle of bases ({cycle}); remove one of these "
                        "base: fields")
    missing = (f"{path}: base: {base_name} not found (looked for {base_path}; a base path is relative to the "
               "file that names it)")
    return merge_base(_read_with_bases(base_path, missing, seen), raw)


# What makes a study itself: never taken from a base (the child's name also renames its scales, and
# tracking.experiment then defaults to the child's name).
_IDENTITY_KEYS = ("name", "tracking.experiment")


def _without_identity(base: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in base.items() if k != "name"}
    if isinstance(out.get("tracking"), Mapping):
        out["tracking"] = {k: v for k, v in out["tracking"].items() if k != "experiment"}
    if isinstance(out.get("scales"), Mapping):
        out["scales"] = {
            scale: ({k: v for k, v in entries.items() if k not in _IDENTITY_KEYS}
                    if isinstance(entries, Mapping) else entries)
            for scale, entries in out["scales"].items()
        }
    return out


def _is_domain(node: Any) -> bool:
    return isinstance(node, Mapping) and len(node) == 1 and next(iter(node)) in DOMAIN_KINDS


def _merge(base: Any, child: Any) -> Any:
    if not (isinstance(base, Mapping) and isinstance(child, Mapping)) or _is_domain(base) or _is_domain(child):
        return child  # scalars, lists, null and search domains replace whole, in either direction
    if "kind" in child and child["kind"] != base.get("kind"):
        return child  # another kind: the base's knobs belong to its own kind
    out = dict(base)
    for key, value in child.items():
        out[key] = _merge(base[key], value) if key in base else value
    return out


def merge_base(base: Mapping[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    """The child spec's mapping deep-merged over its base's (both as read, their own `base:` resolved).

    - Mappings merge key by key, recursively; keys the child adds come after the base's.
    - Scalars, lists and null replace whole, and so do search domains (`{grid: [...]}`) in either direction: a
      child domain replaces the base's value, and a child value replaces the base's domain.
    - A child mapping whose `kind` differs from the base mapping's (or where the base's names none) replaces it
      whole, so `model.attention: {kind: mha, heads: 8}` over a Linformer block keeps no stale `k`.
    - `scales:` merge per scale name, then per dotted key: the child's value for a key replaces the base's, and
      the base's other keys still apply.
    - `name` and `tracking.experiment` (also as scale entries) are never inherited: the child names itself.
    """
    base = _without_identity(base)
    child = dict(child)
    base_scales, child_scales = base.pop("scales", None), child.pop("scales", None)
    out = _merge(base, child)
    if "name" in child:  # first, where a spec file has it
        out = {"name": child["name"], **out}
    if isinstance(base_scales, Mapping) and isinstance(child_scales, Mapping):
        scales = dict(base_scales)
        for scale, entries in child_scales.items():
            inherited = scales.get(scale)
            both = isinstance(inherited, Mapping) and isinstance(entries, Mapping)
            scales[scale] = {**inherited, **entries} if both else entries
        out["scales"] = scales
    elif base_scales is not None or child_scales is not None:
        out["scales"] = child_scales if child_scales is not None else base_scales
    return out


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Dotted `key.path=value` overrides; values are parsed as YAML (`k=64`, `sharing=kv`, `lr={grid: [1, 2]}`)."""
    out = dict(raw)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or not re.fullmatch(r"[A-Za-z0-9_.]+", key):
            raise SpecError(f"override {item!r} is not key.path=value; e.g. model.attention.k=64")
        try:
            parsed = yaml.safe_load(value) if value else ""
        except yaml.YAMLError as err:
            raise SpecError(f"override {item!r}: value is not valid YAML: {err}") from err
        out = _assign(out, key, parsed, f"override {item!r}")
    return out


def _assign(raw: Mapping[str, Any], key: str, value: Any, label: str) -> dict[str, Any]:
    _refuse_path_through_domain(raw, key, label)
    try:
        return set_path(raw, key, value)
    except SearchSpaceError as err:
        raise SpecError(f"{label}: {err}") from err


RESUME_OVERRIDES = ("optim.max_steps", "run.max_failures", "run.checkpoint_every", "run.eval_every", "run.log_every",
                    "run.keep_checkpoints", "run.workers", "run.cpus_per_worker", "run.gpus_per_worker",
                    "run.final_eval", "tracking.")
"""What `orchestrator resume NAME key=value` may change: how long and where a run goes on and where it logs.
Everything else (model, task, data order, optimizer) shaped the checkpoints it continues from."""


def apply_resume_overrides(raw: Mapping[str, Any], overrides: Sequence[str], *, kind: str) -> dict[str, Any]:
    """The stored spec (`kind` run) or study (`kind` sweep) with the overrides a resume may make."""
    for item in overrides:
        key = item.partition("=")[0]
        if not any(key == allowed or (allowed.endswith(".") and key.startswith(allowed)) for allowed in RESUME_OVERRIDES):
            raise SpecError(f"resume override {item!r}: {key} cannot change on resume (its checkpoints were trained "
                            f"with the stored value); resume may change {', '.join(RESUME_OVERRIDES)}*. To change "
                            "anything else, start a new run from a checkpoint with model.init_from")
        if kind == "sweep" and key == "optim.max_steps":
            raise SpecError("resume override optim.max_steps: a sweep resumes only its unfinished trials (its finished "
                            "ones and ASHA's rungs stay as they were); train a chosen trial further with "
                            "`orchestrator train SPEC model.init_from=<its MLflow run id>` or start a longer sweep")
    return apply_overrides(raw, overrides)


def apply_scale(raw: Mapping[str, Any], scale: str | None) -> dict[str, Any]:
    """Drop the spec's `scales:` block and, with `scale`, apply that named set of dotted overrides.

    A study keeps its full size in the body and smaller sizes as overrides (`scales: {tiny: {model.d_model: 64,
    ...}}`), so the CPU version cannot drift from the real one. A scale also renames the study to
    `<name>-<scale>` (unless it sets `name` itself): its runs get their own storage folder and MLflow experiment
    instead of mixing into the full study's.
    """
    out = dict(raw)
    scales = out.pop("scales", None) or {}
    if not isinstance(scales, Mapping) or not all(isinstance(v, Mapping) for v in scales.values()):
        raise SpecError("scales must map a scale name to dotted overrides, e.g. scales: {tiny: {model.d_model: 64}}")
    if scale is None:
        return out
    if scale not in scales:
        known = ", ".join(sorted(scales)) or "none"
        raise SpecError(f"--scale {scale}: this spec defines no such scale (its scales: {known}); "
                        "pick one of them or add it under scales:")
    for key, value in scales[scale].items():
        out = _assign(out, str(key), value, f"scales.{scale}.{key}")
    if "name" not in scales[scale] and isinstance(out.get("name"), str):
        out["name"] = f"{out['name']}-{scale}"
    return out


def _refuse_path_through_domain(raw: Mapping[str, Any], key: str, label: str) -> None:
    """`model.attention.kind=mha` on a spec whose model.attention is a grid would silently break the grid."""
    node: Any = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        node = node.get(part) if isinstance(node, Mapping) else None
        if _is_domain(node):
            prefix = ".".join(parts[: i + 1])
            raise SpecError(
                f"{label}: {prefix} is a search domain ({{{next(iter(node))}: ...}}); override it whole, "
                f"e.g. {prefix}=<value> or {prefix}={{grid: [...]}}"
            )


def _field_path(loc: Sequence[Any], raw: Any) -> str:
    """A pydantic error location as the spec's dotted path, without the union tags pydantic inserts."""
    parts: list[str] = []
    node = raw
    for item in loc:
        if isinstance(node, Mapping) and item not in node and node.get("kind") == item:
            continue  # discriminated-union tag, e.g. ('model', 'attention', 'linformer', 'k')
        parts.append(str(item))
        node = node.get(item) if isinstance(node, Mapping) else None
    return ".".join(parts)


# Fields that other tools (or an older layout) spell differently; named in the unknown-field error.
_MOVED_FIELDS = {
    "warmup": "optim.warmup_steps",
    "batch_tokens": "task.batch_size (LM tasks: sequences per worker micro-batch) or task.max_tokens (translation: "
                    "tokens per worker micro-batch), times optim.grad_accum and run.workers per step",
    "batch_size": "task.batch_size",
    "max_tokens": "task.max_tokens",
    "lr_schedule": "optim.schedule",
    "num_heads": "model.attention.heads",
}


def _model_classes(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation may hold (through Optional, unions and Annotated)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [cls for arg in get_args(annotation) for cls in _model_classes(arg)]


def _known_fields(loc: Sequence[Any]) -> list[str]:
    """The field names valid next to the last item of `loc`, walking ExperimentSpec's models; a discriminated
    union's tag (e.g. 'linformer' in model.attention.linformer.k) narrows the union to its member."""
    classes: list[type[BaseModel]] = [ExperimentSpec]
    for item in loc[:-1]:
        inside = [c for cls in classes if item in cls.model_fields
                  for c in _model_classes(cls.model_fields[item].annotation)]
        if not inside:  # a union tag: keep the members whose `kind` is this literal
            inside = [cls for cls in classes
                      if "kind" in cls.model_fields and item in get_args(cls.model_fields["kind"].annotation)]
        classes = inside
        if not classes:
            return []
    return sorted({name for cls in classes for name in cls.model_fields})


def _unknown_field_message(loc: Sequence[Any]) -> str:
    name = str(loc[-1])
    hints = []
    if name in _MOVED_FIELDS:
        hints.append(f"this spec calls it {_MOVED_FIELDS[name]}")
    known = _known_fields(loc)
    close = difflib.get_close_matches(name, known, n=2, cutoff=0.6)
    if close and not hints:
        hints.append("did you mean " + " or ".join(close) + "?")
    if known and not close:
        hints.append("valid fields here: " + ", ".join(known))
    hint = ("; " + "; ".join(hints)) if hints else ""
    return f"unknown field{hint} (docs/orchestrator.md lists every block's fields)"


def _describe(err: ValidationError, raw: Mapping[str, Any]) -> str:
    lines = []
    for item in err.errors():
        path = _field_path(item["loc"], raw)
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            msg = _unknown_field_message(item["loc"])
        elif item["type"] == "missing":
            msg = "required field is missing; add it to the spec"
        lines.append(f"  {path}: {msg}" if path else f"  {msg}")
    return "\n".join(lines)


def validate_spec(raw: Mapping[str, Any], *, where: str = "spec") -> ExperimentSpec:
    """A resolved spec (no search domains) as an ExperimentSpec, or a SpecError naming every bad field."""
    try:
        domains = find_domains(raw)
    except SearchSpaceError as err:
        raise SpecError(f"{where}: {err}") from err
    if domains:
        paths = ", ".join(d.path for d in domains)
        raise SpecError(
            f"{where} has search domains ({paths}); run it with `orchestrator sweep`, or pin them with "
            f"overrides such as {domains[0].path}=<value>"
        )
    try:
        return ExperimentSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(f"{where} is invalid:\n{_describe(err, raw)}") from None
    except ValueError as err:  # raised outside pydantic's wrapping, e.g. by a task compatibility check
        raise SpecError(f"{where} is invalid:\n  {err}") from None


@dataclass(frozen=True)
class Study:
    """A spec with its search domains: what `validate` prints and `sweep` launches."""

    raw: dict[str, Any]
    """The spec as written (plus overrides), domains included; stored with a sweep to resume it."""
    domains: list[Domain]
    base: ExperimentSpec
    """The first validated trial; the settings no domain touches (run, tune, tracking) come from it."""

    def spec_for(self, assignment: Mapping[str, Any]) -> ExperimentSpec:
        """The full spec of one trial."""
        return validate_spec(resolve(self.raw, assignment), where=_trial_label(assignment))


def _trial_label(assignment: Mapping[str, Any]) -> str:
    if not assignment:
        return "spec"
    return "trial {" + ", ".join(f"{k}={v!r}" for k, v in assignment.items()) + "}"


def expected_trials(study: Study) -> int:
    """Trials the sweep runs: every grid combination num_samples times, or num_samples draws."""
    settings = study.base.tune
    per_sample = len(grid_points(study.domains)) if settings.search == "grid" else 1
    return per_sample * settings.num_samples


def study_from_raw(raw: Mapping[str, Any]) -> Study:
    """Validate a (possibly searched) spec: every grid combination, range edges and a few random draws."""
    raw = dict(raw)
    try:
        domains = find_domains(raw)
    except SearchSpaceError as err:
        raise SpecError(f"spec: {err}") from err
    for path in ("name", "tune", "run", "tracking"):
        if any(d.path == path or d.path.startswith(path + ".") for d in domains):
            raise SpecError(
                f"{path} cannot be searched: it configures the sweep itself; give it one value "
                f"(search over task, model and optim fields)"
            )
    base: ExperimentSpec | None = None
    for assignment in validation_points(domains) if domains else iter([{}]):
        spec = validate_spec(resolve(raw, assignment), where=_trial_label(assignment))
        base = base or spec
    assert base is not None
    return Study(raw=raw, domains=domains, base=base)


def load_study(path: str | Path, overrides: Sequence[str] = (), scale: str | None = None) -> Study:
    """Read a spec file, apply its `scale` and the CLI overrides, and validate every trial it describes."""
    return study_from_raw(apply_overrides(apply_scale(read_yaml(path), scale), overrides))


def load_spec(path: str | Path, overrides: Sequence[str] = (), scale: str | None = None) -> ExperimentSpec:
    """Read and validate a single-run spec (no search domains)."""
    return validate_spec(apply_overrides(apply_scale(read_yaml(path), scale), overrides), where=str(path))


# --- resources --------------------------------------------------------------------------------------


def check_gpus(spec: ExperimentSpec, available: float, where: str) -> None:
    """Fail before launching when one run asks for more GPUs than `where` has."""
    need = spec.run.gpus_per_run
    if need > available:
        raise SpecError(
            f"run.workers={spec.run.workers} x run.gpus_per_worker={spec.run.gpus_per_worker} asks for {need:g} "
            f"GPUs per run but {where} has {available:g}; lower run.workers or run.gpus_per_worker "
            "(0 trains on CPU), or add GPU nodes to the cluster"
        )


def local_gpu_count() -> int:
    """GPUs visible to this process (the check used when no Ray cluster is connected yet)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def spec_to_yaml(spec: ExperimentSpec | Mapping[str, Any]) -> str:
    """The resolved spec as YAML (what `validate` prints and every run stores)."""
    data = spec.model_dump(mode="json") if isinstance(spec, ExperimentSpec) else dict(spec)
    return yaml.safe_dump(data, sort_keys=False)
