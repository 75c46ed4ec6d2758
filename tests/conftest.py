"""Shared fixtures and the two test tiers (docs/testing.md: what each holds, its time, its slowest cases).

- The fast tier (`python -m pytest -q`, the README's command): every unit, method, kernel and spec test, in at
  most three minutes on 2 cores.
- The slow tier (tests marked `slow`): what starts real processes (Ray sweeps on the session's local Ray, Ray
  clusters of several nodes, the fake autoscaler, killed launchers, real `mlflow server` processes, `ray job
  submit`, the browser) and the CPU-heavy cases (inductor compiles). Collected always, run only with `RUN_SLOW=1`
  (the convention of Hugging Face transformers' `@slow`); `RUN_SLOW=1 python -m pytest -q -m slow` runs this
  tier alone, as `.ci/run` does after the fast tier.

Both tiers run on one pytest-xdist worker per core (pyproject's addopts); `_worker_group` keeps together what
must share a worker. `ray_cluster` starts ONE local Ray per worker that asks for it, and only when a test asks
for it: tests that never request it (spec, search space, cluster YAML) run without Ray. Whatever a session
starts ends with it, however pytest ends (tests/process_guard.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from tests import schedule

RUN_SLOW = "RUN_SLOW"
"""The switch of the real-process tier: set to 1 (or true/yes) to run the tests marked `slow`."""
_DESELECTED = pytest.StashKey[int]()
"""How many tests marked `slow` this session left out, for the summary line."""
_SLOW_MODULES_LEFT_OUT = pytest.StashKey[bool]()
"""This session left a module of slow tests only uncollected (`pytest_ignore_collect`)."""
_GUARD = pytest.StashKey[object]()
"""This session's guard process (tests/process_guard.py), held so that its pipe lives as long as pytest."""


def _run_slow() -> bool:
    return os.environ.get(RUN_SLOW, "").strip().lower() in ("1", "true", "yes")


def pytest_configure(config: pytest.Config) -> None:
    """Before any test starts a process: mark this session's environment and start its guard, so that nothing
    the session starts outlives it, however pytest ends (tests/process_guard.py); and let a SIGTERM end pytest
    as Ctrl-C does, with every fixture's teardown (the guard covers a SIGKILL, which runs none)."""
    from tests import process_guard

    tag = process_guard.new_tag()
    os.environ[process_guard.SESSION_ENV] = tag
    config.stash[_GUARD] = process_guard.start_guard(tag)
    process_guard.set_guard(config.stash[_GUARD])
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"pytest got signal {signum}")


SHARED_RAY = "ray_cluster"
"""The session fixture of the test process's own local Ray: under pytest-xdist each worker that runs a test asking
for it would start one, so those tests are kept on one worker (`xdist_group`). The session's `mlflow server` and
SeaweedFS are not: one of each per worker costs seconds, and keeping their tests apart from the rest would cost
the real-process tier its second worker."""


SERVER_FIXTURES = {"server", "s3_server", "ray_cluster"}
"""Fixtures that start servers (`mlflow server`, SeaweedFS, the session's local Ray): a test that uses one is in
the slow tier, marked or not."""


SLOW_MODULE = "pytestmark = pytest.mark.slow"
"""The line that marks a whole test module as the slow tier's."""


def pytest_ignore_collect(collection_path, config: pytest.Config) -> bool | None:
    """Without RUN_SLOW=1, a module marked slow as a whole is not even imported: each pytest-xdist worker
    collects every module it is given, and importing the real-process tier's modules (their process, server and
    cluster helpers) cost each worker of the fast tier about 3.6 CPU-seconds of its collection's 23, for tests
    it then deselects. None: pytest decides, as for any other path."""
    if _run_slow() or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    try:
        lines = collection_path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    if SLOW_MODULE not in lines:
        return None
    config.stash[_SLOW_MODULES_LEFT_OUT] = True
    return True


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist and `-m` read the marks (their own modifyitems hooks)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n`, pyproject's addopts), tests that share the session's Ray or a module's fixture
    run on one worker (`--dist loadgroup`); the rest spread over the workers one by one, the longest work first
    (tests/schedule.py). Without RUN_SLOW=1 the real-process tier is deselected (not skipped: it is not this
    command's work), and the summary says how to run it."""
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)  # a server's process: the real-process tier's (docs/testing.md)
        group = _worker_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
    if not _run_slow():
        slow = [item for item in items if item.get_closest_marker("slow")]
        if slow:
            items[:] = [item for item in items if not item.get_closest_marker("slow")]
            config.hook.pytest_deselected(items=slow)
            config.stash[_DESELECTED] = len(slow)
    items[:] = schedule.longest_first(items, unit_of=_work_unit, test_id=lambda item: item.nodeid,
                                      is_slow=lambda item: item.get_closest_marker("slow") is not None,
                                      seconds=schedule.recorded_seconds())


def _work_unit(item: pytest.Item) -> str:
    """What pytest-xdist deals out as one: an xdist_group, or the test alone."""
    marker = item.get_closest_marker("xdist_group")
    return f"@{marker.kwargs.get('name', marker.args[0] if marker.args else '')}" if marker else item.nodeid


def _worker_group(item: pytest.Item) -> str | None:
    """The xdist group of a test: a test of the session's local Ray, that Ray; a test of a module-scoped fixture
    (a module's servers, cluster or trained sweep), its module, so the fixture is built once; otherwise none, and
    the test goes to whichever worker is free."""
    if item.get_closest_marker("xdist_group"):
        return None
    fixtures = getattr(item, "_fixtureinfo", None)
    definitions = fixtures.name2fixturedefs if fixtures is not None else {}
    if SHARED_RAY in definitions:
        return SHARED_RAY
    if any(d.scope == "module" for defs in definitions.values() for d in defs):
        return item.nodeid.split("::", 1)[0]
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _RECORDED is not None:
        _RECORDED.append((report.nodeid, report.duration))


_RECORDED: list[tuple[str, float]] | None = [] if schedule.record_path() else None
"""Each phase's time, when RECORD_TEST_SECONDS asks for them (tests/schedule.py); under pytest-xdist the
controller gets every worker's reports, and only it writes."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = schedule.record_path()
    if path and _RECORDED and not hasattr(session.config, "workerinput"):
        schedule.write_seconds(path, _RECORDED)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    count = config.stash.get(_DESELECTED, 0)
    if count or config.stash.get(_SLOW_MODULES_LEFT_OUT, False):
        terminalreporter.write_line(f"{count} real-process tests (marked slow) not run, nor the modules of such tests "
                                    f"only: {RUN_SLOW}=1 python -m pytest -q -m slow runs them")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """Unit tests use tiny tensors: on a 2-core machine intra-op thread hand-offs cost far more than
    they save (several times slower with two threads). Ray workers are separate processes and keep
    their own setting."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True, scope="session")
def _mlflow_schema_built_once(tmp_path_factory):
    """A test's new SQLite MLflow store gets a copy of the schema MLflow built once in this process, not its
    own 2-5 s of migrations (tests/mlflow_schema.py)."""
    from tests.mlflow_schema import copy_built_schema

    copy_built_schema(tmp_path_factory.mktemp("mlflow-schema"))


MLFLOW_HTTP_SETTINGS = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES")


@pytest.fixture(autouse=True)
def _mlflow_http_settings_restored():
    """A launcher run in this process sets MLflow's per-request timeout and retries in os.environ
    (orchestrator/tracking/read.py, `configure_http`: 2 s in the tiny specs); without this, the next test on the
    same worker read a loaded server through a 2 s timeout and failed. Each test leaves them as it found them."""
    saved = {name: os.environ.get(name) for name in MLFLOW_HTTP_SETTINGS}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session")
def ray_cluster():
    """A 2-CPU, 0-GPU local Ray cluster (explicit counts keep tests machine-independent)."""
    import ray

    from orchestrator.cluster.ray_env import start_local_ray

    start_local_ray(num_cpus=2, num_gpus=0)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real `mlflow server` on 127.0.0.1 for the process-level tests (tests/real_runs.py): starting one
    costs about 25 s on 2 busy cores, and each case logs to an experiment of its own."""
    from tests.real_runs import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS, tests/s3_server.py) on 127.0.0.1 for the session, started only when a test
    asks for it; the tests skip, saying why, only where the `weed` binary cannot run."""
    from tests.s3_server import SeaweedS3, usable_reason

    reason = usable_reason()
    if reason:
        pytest.skip(reason)
    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    try:
        server.start()
    except (OSError, RuntimeError) as err:
        pytest.skip(f"SeaweedFS does not run on this machine: {err}"[:500])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The session's S3 server with its credentials and endpoint in this process's environment (as a user
    exports them) and a storage root of this test's own: yields (server, "s3://<bucket>/<prefix>")."""
    for name, value in s3_server.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    if s3_server.proc is None:  # an outage test that failed half-way: the next test needs it up
        s3_server.start()
    return s3_server, s3_server.new_root()


@pytest.fixture
def unreachable_s3(monkeypatch):
    """An S3 endpoint URL on a 127.0.0.1 port nothing listens on, with test credentials, none of the caller's
    endpoint variables (a `--storage-endpoint` flag sets one, which monkeypatch takes away again) and one attempt
    per S3 request (object_store.ATTEMPTS: the default five back off for seconds before the same refusal); the
    S3 filesystem cached for that endpoint is dropped afterwards, so no later test gets it."""
    import socket

    from orchestrator.storage import object_store

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    for name in object_store.ENDPOINT_VARS:
        monkeypatch.setenv(name, "unset-below")  # recorded, so the flag's value is taken away after the test
        monkeypatch.delenv(name)
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(object_store, "ATTEMPTS", 1)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        object_store._s3.cache_clear()
