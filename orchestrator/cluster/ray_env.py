"""The environment of the project's Ray processes: one place that says which variables they get and how.

A local Ray (the launcher's own `ray.init`) gets them through the raylet: `start_local_ray` sets them in the
launcher's environment only while `ray.init` starts the raylet, which passes its environment to every worker
process it starts (so the launcher's own environment, which Ray Train and Tune copy into the actors they
create, stays as the user left it). Two of them trim what a run starts on one machine:
- no workers started ahead of time: Ray starts one per CPU when the first job connects, but they only serve
  tasks with an empty runtime env, and every actor of a Train run has one (the controller is created with
  Ray Train's own env vars, and its actors inherit them), so they never ran anything of a run and only took
  CPU while the run's own processes started;
- no preemption watcher actor: one machine is not preempted (on a cluster it stays on).
And one shortens a wait: Ray Train's controller collects a worker's `report` when it polls the workers,
every 2 s by default, and a worker's queue of reports holds one, so every report after the first waited for
the next poll: up to 2 s of a worker's time per checkpoint, most of a short run on one machine. A local Ray
polls every `TRAIN_POLL_INTERVAL_S` (a poll is one small call per worker; the user's own value wins).
benchmarks/RESULTS.md, "Time to first metric", lists the processes a run starts and when.

A local Ray listens on the loopback only (`_loopback`): Ray binds its gRPC servers (GCS, raylet, object
manager, every worker) and agents to the node's address, and on Linux that is the machine's network address,
so by default other machines could reach them while a run lasts.

A cluster joined through RAY_ADDRESS keeps its job's own environment (nodes set theirs up, cluster.yaml), so
there the Train workers get what they need through Ray Train's `worker_runtime_env` (`train_worker_env`).
Secrets never go that way (the MLflow credentials, S3 keys): Ray writes every runtime env it sets up or
releases into the node's logs (runtime_env_agent.log, at INFO) and keeps it in the GCS, where the dashboard
and `ray list` show it. A cluster's nodes have them in the environment `ray start` ran with (cluster.yaml
reads ~/.ray/mlflow_credentials there), which every Ray process of the node inherits, as a local Ray's
processes inherit the launcher's.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from orchestrator.cluster.reaper import OWNER_ENV, start_reaper, tell_session
from orchestrator.console.progress import VERBOSE_ENV, verbose
from orchestrator.storage.locations import ray_storage
from orchestrator.storage.object_store import storage_env

PROJECT_ROOT = Path(__file__).resolve().parents[2]
"""The checkout (orchestrator/cluster/ray_env.py is two folders down): on every Ray process's PYTHONPATH."""
TRAIN_V2 = "RAY_TRAIN_V2_ENABLED"
LOCAL_RAY = "ORCHESTRATOR_LOCAL_RAY"
"""Set to 1 in every process of a Ray the launcher started itself (through the raylet's environment)."""
WORKER_NICENESS = "RAY_worker_niceness"
TRAIN_POLL_INTERVAL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
"""How often Ray Train's controller polls its workers (ray/train/v2/_internal/constants.py); a worker's
`report` waits for the poll that collects the report before it (its result queue holds one)."""
TRAIN_POLL_INTERVAL_S = "0.2"
SINGLE_MACHINE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Ray's switch between a node address other machines reach (on Linux, by default) and the loopback (its
default on macOS and Windows, where Ray runs one machine only): ray/_private/services.py,
`get_node_ip_address`. At 0, a Ray process binds and advertises 127.0.0.1."""

_started_here = False
"""This process started the local Ray it is connected to (its own environment no longer says so)."""
_owner = f"{os.getpid()}-{secrets.token_hex(4)}"
"""This launcher, as the owner of its local Ray's processes (orchestrator/cluster/reaper.py)."""
_reaper = None


def use_train_v2() -> None:
    """Import `ray.train` as Train V2 (Ray reads the variable when `ray.train` is first imported; V2 is Ray
    2.60's default; this makes sure of it). The variable is unset again afterwards, so that Ray Train and Tune,
    which copy the Train variables a driver set into the actors they create, have nothing of ours to copy."""
    if "ray.train" in sys.modules or TRAIN_V2 in os.environ:
        return
    os.environ[TRAIN_V2] = "1"
    try:
        import ray.train  # noqa: F401
    finally:
        del os.environ[TRAIN_V2]


def stored_result(run_folder: str) -> Any:
    """The ray.train.Result of a stored Train run (checkpoints, metrics), read without Ray running. Ray's
    checkpoint manager logs, at INFO, that it found the run's snapshot and advises deleting the folder to start
    anew: advice for a new run that lands there by mistake, not for a launcher reading its own run, so it is
    shown with --verbose only."""
    use_train_v2()  # Result.from_path reads V2 storage
    import logging

    from ray.train import Result

    checkpoint_log = logging.getLogger("ray.train.v2._internal.execution.checkpoint.checkpoint_manager")
    before = checkpoint_log.level
    if not verbose():
        checkpoint_log.setLevel(logging.WARNING)
    path, filesystem = ray_storage(run_folder)  # the S3 store of orchestrator/storage/object_store.py, as Ray Train wrote it
    try:
        return Result.from_path(path, storage_filesystem=filesystem)
    finally:
        checkpoint_log.setLevel(before)


def local_ray_environment() -> dict[str, str]:
    """Every process of a local Ray: Train V2; trial drivers in the launcher's working directory (relative data
    paths keep working); this checkout importable even when not pip-installed; the launcher's verbosity; Ray's
    workers at normal priority (Ray starts them at niceness 15 so that its daemons stay responsive, and a
    training worker then loses every CPU contest on a shared machine: benchmarks/RESULTS.md, "Ray overhead");
    no preemption watcher and no prestarted workers, and Train's controller polling its workers every
    TRAIN_POLL_INTERVAL_S unless the user chose (the module's docstring says why); the launcher as owner, so
    that they end with it (orchestrator/cluster/reaper.py)."""
    pythonpath = os.pathsep.join(p for p in (str(PROJECT_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {TRAIN_V2: "1", "RAY_CHDIR_TO_TRIAL_DIR": "0", "PYTHONPATH": pythonpath,
            VERBOSE_ENV: "1" if verbose() else "0", WORKER_NICENESS: "0",
            "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0", "RAY_prestart_worker_first_driver": "0", LOCAL_RAY: "1",
            TRAIN_POLL_INTERVAL: os.environ.get(TRAIN_POLL_INTERVAL, TRAIN_POLL_INTERVAL_S),
            OWNER_ENV: _owner, SINGLE_MACHINE: "0"}


@contextmanager
def _loopback() -> Iterator[None]:
    """While it lasts, a Ray started here takes 127.0.0.1 as its node address, so that its GCS, raylet, object
    manager, agents and workers listen on the loopback only (tests/test_ray_env.py lists their sockets).
    Ray's gRPC servers bind the loopback when the node address is a loopback one and every interface
    otherwise, whatever address is given: `ray.init(_node_ip_address="127.0.0.1")` is rewritten to the
    machine's network address (`resolve_ip_for_localhost`) unless Ray is in its single-machine mode. That
    mode is a constant Ray reads from SINGLE_MACHINE when `ray` is first imported, long before a launcher
    gets here, so it is set on Ray's module for the start; the processes the start spawns read the variable
    themselves (`local_ray_environment`)."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def own_address() -> dict[str, str]:
    """The address the local Ray's GCS will have, given to every one of its processes as RAY_ADDRESS. Ray code
    that looks its cluster up instead of using its connection (Ray's State API client with no address, as Ray
    Train's PlacementGroupCleaner calls it: a local Ray's runs now leave that actor out, launch/train_actors.py)
    otherwise scans the machine for GCS processes and fails as soon as a second Ray runs there ("Found multiple
    active Ray instances"), e.g. another launcher's, and its thread dies with it."""
    import ray._private.services

    with socket.socket() as probe:  # a free port for the GCS (RAY_GCS_SERVER_PORT, read by ray/_private/node.py)
        probe.bind(("", 0))
        port = probe.getsockname()[1]
    host = ray._private.services.get_node_ip_address()
    return {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"{host}:{port}"}


def joined_runtime_env(address: str) -> dict[str, Any]:
    """The `ray.init` runtime env of a launcher joining the cluster at `address`: every process of its job
    (Ray Train's controller and its actors, Tune's trial drivers) gets the cluster's GCS address as
    RAY_ADDRESS, for the reason `own_address` gives; on a machine that runs several Rays (one per engineer,
    or a test cluster beside a local one) the placement-group cleaner's thread otherwise dies on "Found
    multiple active Ray instances". Under `ray job submit` Ray merges this with the job's own runtime env,
    variable by variable (ray/_private/worker.py, `_merge_runtime_env`), so the submitted working_dir and
    env_vars stay. A Ray Client address (ray://) has no GCS address here to give."""
    if address.startswith("ray://"):
        return {}
    from ray._private.services import canonicalize_bootstrap_address_or_die

    return {"env_vars": {"RAY_ADDRESS": canonicalize_bootstrap_address_or_die(address)}}


START_ATTEMPTS = 3
"""Starts of a local Ray before its failure is the user's: Ray waits a fixed 30 s (ray/_private/node.py,
`raylet_start_wait_time_s`, not configurable) for the raylet to register, which a 2-core machine under load
can miss; the next start usually succeeds."""
NODE_START_TIMEOUT = "The current node timed out during startup"
"""The start of Ray's error when that wait runs out."""


def start_local_ray(**init_kwargs: Any) -> None:
    """`ray.init` of a local Ray whose every process has `local_ray_environment()`; this process's own
    environment is as it was afterwards (a test session's later subprocesses, and Ray Train's copying of the
    driver's variables, see none of it). Its processes end with this one, however it ends (ray_reaper.py)."""
    global _started_here, _reaper
    import ray

    use_train_v2()
    if _reaper is None:  # first: a launcher killed while Ray starts leaves nothing either
        _reaper = start_reaper(_owner)
    with _environment(local_ray_environment()), _loopback():
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                with _environment(own_address()):
                    # No dashboard: it costs start-up time and memory, and MLflow is where a run is watched.
                    # address="local": a new Ray, whatever RAY_ADDRESS (now its own) says.
                    context = ray.init(address="local", include_dashboard=False, **init_kwargs)
                tell_session(_reaper, context.address_info["session_dir"])
                break
            except Exception as err:  # Ray raises a bare Exception for it; only its own words tell it apart
                if NODE_START_TIMEOUT not in str(err) or attempt == START_ATTEMPTS:
                    raise
                ray.shutdown()  # what Ray registered of the timed-out start
                print(f"Ray's raylet did not register within Ray's own 30 s (a loaded machine); starting the local "
                      f"Ray again ({attempt + 1}/{START_ATTEMPTS})", file=sys.stderr, flush=True)
    _started_here = True


def on_local_ray() -> bool:
    return _started_here or os.environ.get(LOCAL_RAY) == "1"


def train_worker_env() -> dict[str, Any] | None:
    """Ray Train's `worker_runtime_env`: none on a local Ray (the raylet gave every worker the environment);
    on a joined cluster the launcher's verbosity, which `tracking.ConsoleLogger` reads, normal priority
    for the training process (as Ray's job supervisor does for drivers), and the S3 endpoint and region
    (orchestrator/storage/object_store.py; credentials stay with each node)."""
    if on_local_ray():
        return None
    return {"env_vars": {VERBOSE_ENV: "1" if verbose() else "0", WORKER_NICENESS: "0", **storage_env()}}
