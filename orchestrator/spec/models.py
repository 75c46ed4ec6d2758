"""The pydantic models of a spec: one typed block per component (optim, run, tune, tracking; the task's and the
model's come from tasks/ and models/), every field documented under it, constraints between fields checked in
validators whose messages name the field and the fix."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from models import ModelConfig
from orchestrator.spec.merge import merge_mappings
from orchestrator.spec.messages import describe_errors
from orchestrator.spec.names import Name
from orchestrator.storage.locations import resolve as resolve_location
from tasks import check_compatible, listops, long_range, pretrained_config
from tasks.config import TaskConfig

COST_OBJECTIVES = ("params.attention", "params.total", "train/tokens_per_s", "memory/peak_gb", "train/loss")
"""What every training run reports besides its task's metrics, so a further objective of tune.metric may be it:
the sizes (orchestrator/launch/worker.py reports them with every result) and the train/* of each report step."""


class SpecError(ValueError):
    """A spec cannot be run; the message names the field(s) and how to fix them."""


class _Section(BaseModel):
    # validate_default: the defaults of storage_path and tracking.uri are relative and must be made absolute too.
    # allow_inf_nan=False: a NaN passes every `x <= 0` check and fails only in a worker, minutes later.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


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
    """Micro-batches accumulated per optimizer step (the step's gradient: the mean over all their target tokens)."""
    grad_clip: float | None = 1.0
    """Max global gradient norm; null disables clipping."""
    seed: int = 0
    """Seeds model init, dropout and data order; the same seed on CPU gives the same loss curve."""

    @model_validator(mode="after")
    def _check(self) -> OptimConfig:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0 (got {self.lr})")
        if self.max_steps < 0 or self.grad_accum < 1:
            raise ValueError("optim.max_steps must be >= 1 (0 only for task.kind: pretrained_lm, which may score "
                             "without training) and optim.grad_accum >= 1")
        if not 0 <= self.warmup_steps <= self.max_steps:
            raise ValueError(f"optim.warmup_steps={self.warmup_steps} must be in [0, optim.max_steps="
                             f"{self.max_steps}]; shorten the warmup or train longer")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0 (got {self.weight_decay}); 0 disables it")
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
    """GPUs per worker, at most 1 (a worker is one rank on one device; below 1 packs runs of one worker onto a
    GPU); 0 trains on CPU with the gloo backend."""
    cpus_per_worker: float = 1
    """CPUs reserved per worker."""
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """fp32; bf16 autocast (with run.strategy=fsdp: bf16 parameters and fp32 gradient reduction instead); or fp16
    autocast with dynamic loss scaling (GradScaler; for GPUs without bf16 such as V100/T4): overflowing steps are
    skipped and counted (train/skipped_steps). Softmax, log-sum-exp and the loss stay fp32 in every precision. Both
    half precisions also run on CPU (torch's CPU autocast), which exists for testing the GPU paths and for CPUs
    with bf16 units; elsewhere it is slower than fp32."""
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
    """How the model is spread across workers: ddp (replicated, through Ray Train's prepare_model) or fsdp (FSDP2's
    fully_shard per transformer layer: sharded parameters, gradients and optimizer state, checkpoints written
    shard by shard through torch.distributed.checkpoint; NCCL on GPUs, gloo on CPU)."""
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
    storage_endpoint: str | None = None
    """URL of an S3-compatible store serving an s3:// storage_path (MinIO, SeaweedFS, R2, Ceph:
    http://<host>:9000); null: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL from the environment, else AWS S3.
    Credentials are never spec fields: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws, an IAM role."""
    storage_region: str | None = None
    """Region of the s3:// storage_path's bucket; null: AWS_REGION / AWS_DEFAULT_REGION or the AWS profile's."""
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
        return resolve_location(value)

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
        if self.gpus_per_worker > 1:
            # A worker is one rank on one device (ray.train.torch.get_device: the lowest of its GPUs); the others
            # would be reserved and idle.
            raise ValueError(
                f"run.gpus_per_worker={self.gpus_per_worker:g}: each worker trains on one GPU, so the other "
                f"{math.ceil(self.gpus_per_worker) - 1:g} would be reserved and idle; use run.gpus_per_worker=1 with "
                f"run.workers={self.workers * math.ceil(self.gpus_per_worker)} (one rank per GPU; run.strategy=fsdp "
                "shards a model too large for one GPU)")
        if self.max_failures < -1:
            raise ValueError("run.max_failures must be >= 0, or -1 for unlimited retries")
        if self.strategy == "fsdp" and self.precision == "fp16":
            raise ValueError("run.precision=fp16 is not supported with run.strategy=fsdp (its sharded gradients need "
                             "a sharded loss scaler); use precision: bf16 with fsdp, or strategy: ddp with fp16")
        if self.collective_timeout_s <= 0:
            raise ValueError(f"run.collective_timeout_s must be > 0 (got {self.collective_timeout_s})")
        if "://" in self.storage_path:
            scheme, rest = self.storage_path.split("://", 1)
            if "@" in rest.split("/", 1)[0] or "?" in rest:
                raise ValueError(
                    "run.storage_path must be a plain URI (scheme://bucket/path): credentials and options in it would "
                    "be logged as a param; give credentials as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or "
                    "AWS_PROFILE, ~/.aws/credentials) and the store's address as run.storage_endpoint")
        if self.storage_endpoint is not None:
            if not self.storage_path.startswith("s3://"):
                raise ValueError(f"run.storage_endpoint is set but run.storage_path={self.storage_path!r} is not an "
                                 "s3:// URI; set run.storage_path=s3://<bucket>/runs, or remove run.storage_endpoint")
            if not self.storage_endpoint.startswith(("http://", "https://")) or "@" in self.storage_endpoint:
                raise ValueError(f"run.storage_endpoint={self.storage_endpoint!r} must be the store's URL, "
                                 "http://<host>:<port> or https://<host> (credentials go in the environment)")
        if self.prefetch_batches < 0:
            raise ValueError(f"run.prefetch_batches must be >= 0 (got {self.prefetch_batches}); 0 disables prefetching")
        return self

    @property
    def gpus_per_run(self) -> float:
        return self.workers * self.gpus_per_worker


class TuneSettings(_Section):
    """How a sweep searches and schedules trials (the `tune:` block)."""

    metric: str | list[str] | None = None
    """Metric compared across trials; must be one the task reports (default: the task's own, e.g. val/ppl). A list
    makes several objectives ([val/acc, params.attention]): the first is a task metric (it ranks checkpoints and
    the report's table), the others task metrics or costs (COST_OBJECTIVES); needs scheduler: fifo."""
    mode: Literal["min", "max"] | list[Literal["min", "max"]] | None = None
    """Whether lower or higher `metric` is better (default: the task's, e.g. min for val/ppl); a list, one per
    objective, when `metric` is a list."""
    seeds: list[int] | None = None
    """Seeds every method point runs with ([0, 1, 2]): each grid point once per seed (it sets optim.seed), so the
    report pairs seed s of a method with seed s of the reference. Grid search only."""
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
        if self.seeds is not None:
            self._check_seeds()
        if isinstance(self.metric, list) or isinstance(self.mode, list):
            self._check_objectives()
        return self

    def _check_seeds(self) -> None:
        assert self.seeds is not None
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"tune.seeds={self.seeds} must list distinct seeds, e.g. [0, 1, 2]")
        if self.search != "grid" and len(self.seeds) > 1:
            raise ValueError(f"tune.seeds with search: {self.search}: a searcher proposes one point per trial, so "
                             "its points cannot be repeated over seeds; search with one seed (tune.seeds: [0]), "
                             "then run the chosen points as a grid (search: grid) with tune.seeds")

    def _check_objectives(self) -> None:
        metrics = self.metric if isinstance(self.metric, list) else [self.metric]
        modes = self.mode if isinstance(self.mode, list) else [self.mode]
        if not metrics or None in metrics or len(set(metrics)) != len(metrics):
            raise ValueError(f"tune.metric={self.metric} must list distinct metric names, e.g. [val/acc, "
                             "params.attention]")
        if len(modes) != len(metrics) or None in modes:
            raise ValueError(f"tune.metric lists {len(metrics)} objectives: give tune.mode as a list of as many "
                             f"min/max, one per objective (got tune.mode={self.mode})")
        if len(metrics) > 1 and self.scheduler == "asha":
            raise ValueError(f"tune.metric has {len(metrics)} objectives but tune.scheduler: asha stops trials on one "
                             "metric; set tune.scheduler: fifo (or give one metric)")


class TrackingSettings(_Section):
    """Where runs are logged (the `tracking:` block)."""

    uri: str = "sqlite:///mlflow.db"
    """MLflow tracking URI: a local SQLite file (made absolute) or a server such as http://head:5000."""
    experiment: Name | None = None
    """MLflow experiment (one per study; letters, digits, . _ -); defaults to the spec's name."""
    retries: int = 3
    """Attempts per logging call before it is dropped with a warning (training never stops for logging)."""
    timeout_s: float = 5.0
    """HTTP timeout of one MLflow request; keeps a slow or dead server from stalling training."""
    offline_ok: bool = False
    """Start even when `uri` cannot be reached (otherwise refused before Ray starts); metrics wait in the run
    folder's spool and are sent when the store answers, at the latest by `orchestrator resume`."""
    system_metrics: bool = False
    """Log MLflow's system metrics (system/*: CPU, memory, disk, network, and GPU utilisation and memory where
    NVIDIA's NVML is installed: rank 0's own GPU, as gpu_0) from rank 0's node every `system_metrics_interval_s`."""
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
        if "@" in self.uri.split("://", 1)[-1].split("/", 1)[0]:
            raise ValueError(
                "tracking.uri must not hold credentials (user:password@host): they would be printed, logged as a "
                "param and stored in every checkpoint; set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
                "in the environment instead (MLflow reads them), and give the server as http://<host>:<port>")
        if self.retries < 1 or self.timeout_s <= 0:
            raise ValueError("tracking.retries must be >= 1 and tracking.timeout_s > 0")
        if self.system_metrics_interval_s <= 0:
            raise ValueError("tracking.system_metrics_interval_s must be > 0")
        return self


class ExperimentSpec(_Section):
    """A complete, resolved experiment: everything a run needs, and what is stored in its checkpoints."""

    name: Name
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
        if self.optim.max_steps == 0 and self.task.kind != "pretrained_lm":
            raise ValueError(f"optim.max_steps=0 trains nothing, which only task.kind: pretrained_lm (scoring a "
                             f"pretrained model) can do; task.kind={self.task.kind} needs optim.max_steps >= 1")
        check_compatible(self.task, self.model)
        _check_fit(self.task, self.model, self.optim.max_steps)
        metrics = tuple(self.task.metrics)
        objectives = self.tune.metric if isinstance(self.tune.metric, list) else [self.tune.metric]
        if objectives[0] is not None and objectives[0] not in metrics:
            raise ValueError(f"tune.metric={objectives[0]!r} is not reported by task.kind={self.task.kind}; choose "
                             f"one of {list(metrics)}" + (" (the first objective ranks checkpoints: a task metric)"
                                                          if len(objectives) > 1 else ""))
        for name in objectives[1:]:
            if name not in metrics + COST_OBJECTIVES:
                raise ValueError(f"tune.metric objective {name!r} is reported by no run of task.kind={self.task.kind}; "
                                 f"choose among {list(metrics + COST_OBJECTIVES)}")
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
            return ExperimentSpec.model_validate(merge_mappings(raw, self.pretrain))
        except ValidationError as err:
            raise ValueError("pretrain: " + describe_errors(err, self.pretrain, ExperimentSpec).strip()) from None

    def finetuning_spec(self, init_from: str) -> ExperimentSpec:
        """Stage 2 of a two-stage spec: this spec, fine-tuned from the pretraining run stored at `init_from`."""
        model = self.model.model_copy(update={"init_from": init_from})
        return self.model_copy(update={"model": model, "pretrain": None})

    @property
    def metric(self) -> str:
        """The compared metric: tune.metric (the first of several objectives), or the task's default."""
        return self.objectives[0][0]

    @property
    def mode(self) -> Literal["min", "max"]:
        return self.objectives[0][1]

    @property
    def objectives(self) -> list[tuple[str, Literal["min", "max"]]]:
        """(metric, mode) of each objective: one, or several when tune.metric is a list."""
        metric, mode = self.tune.metric or self.task.default_metric, self.tune.mode or self.task.default_mode
        if isinstance(metric, list):
            return list(zip(metric, mode if isinstance(mode, list) else [mode] * len(metric)))
        return [(metric, mode[0] if isinstance(mode, list) else mode)]


_PRETRAIN_FIELDS = ("task", "optim", "run")


def _check_fit(task: Any, model: ModelConfig, max_steps: int) -> None:
    """The model (pretrained_lm: its patch) against the longest sequence and the vocabulary the task feeds it."""
    if task.kind == "pretrained_lm":  # check_compatible refused its model: block; the patch's knobs run
        pretrained_config.check_patch(task, max_steps)  # its length bounds; no attention dropout to fine-tune
        return
    # Translation: the decoder's evaluation targets and beam search reach model.max_seq_len (tasks/translation.py).
    longest, source = ((model.max_seq_len, "model.max_seq_len") if task.kind == "translation" else
                       (task.max_len, "task.max_len") if task.kind == "classify" else (task.seq_len, "task.seq_len"))
    vocab = getattr(task, "vocab_size", {"bytelm": long_range.BYTE_VOCAB, "listops": listops.VOCAB_SIZE}.get(task.kind))
    model.check_task(task.kind, longest, source, None if model.init_from else vocab)  # init_from: the run's tokenizer


def spec_to_yaml(spec: ExperimentSpec | Mapping[str, Any]) -> str:
    """The resolved spec as YAML (what `validate` prints and every run stores)."""
    data = spec.model_dump(mode="json") if isinstance(spec, ExperimentSpec) else dict(spec)
    return yaml.safe_dump(data, sort_keys=False)
