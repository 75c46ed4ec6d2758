"""Launching and the run lifecycle, one module per command or stage: `preflight` and `name_lock` (checks and the
name's one live launcher, before Ray), `validate_checks` (those `validate` makes of the machine), `run` (one Ray Train run), `sweep` (a Tune sweep of driver trials),
`worker` and `worker_config` (Ray Train glue around the training core), `ray_console` (Ray's output turned
into the console's lines), `evaluate` and `deliver` (the final evaluation of a run and what it leaves for
MLflow), `pretrained` (`model.init_from`), `resuming`, `status`, `sweep_summary` (the report on a sweep's
parent run), `prepare`, and `local_run` (the core in this process without Ray)."""

from orchestrator import lazy_face

OFFERS = {
    **dict.fromkeys(["LaunchError", "check_data_files", "check_storage", "check_tracking"], "preflight"),
    "check_before_ray": "validate_checks",
    **dict.fromkeys(["run_training", "RunOutcome"], "run"),
    **dict.fromkeys(["run_sweep", "SweepOutcome"], "sweep"),
    "resume": "resuming",
    "status_cli": "status",
    "evaluate_stored": "evaluate",
    **dict.fromkeys(["prepare_spec", "describe_argv"], "prepare"),
    "train_locally": "local_run",
    "WorkerConfig": "worker_config",
}
__all__ = sorted(OFFERS)
__getattr__, __dir__ = lazy_face(__name__, OFFERS)
