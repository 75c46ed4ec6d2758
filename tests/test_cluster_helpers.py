"""The tests' own clusters (tests/cluster_helpers.py: `LocalCluster`, `RayHead`) start their head again on Ray's
30 s raylet timeout, as the launcher's local Ray does (tests/test_ray_env.py), and on nothing else
(`start_again_on_node_timeout`); LocalCluster's worker nodes likewise, ending the timed-out node's raylet
(`_add_node`). LocalCluster's start is a real child process; the timeout is stood in for by an
error the child really raises (an argument Ray refuses)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests import cluster_helpers

pytestmark = pytest.mark.slow  # child interpreters that import Ray

REFUSED = "unexpected keyword argument 'no_such_ray_argument'"


def test_a_head_that_cannot_start_is_named_after_one_attempt(capsys):
    with pytest.raises(RuntimeError, match=rf"did not start \(attempt 1 of \d\): .*{REFUSED}"):
        cluster_helpers.LocalCluster(num_cpus=0, no_such_ray_argument=1)
    assert "starting it again" not in capsys.readouterr().err


def test_a_head_that_timed_out_is_started_again_up_to_its_attempts(monkeypatch, capsys):
    monkeypatch.setattr(cluster_helpers, "NODE_START_TIMEOUT", REFUSED)  # this refusal now reads as the timeout
    attempts = cluster_helpers.START_ATTEMPTS
    with pytest.raises(RuntimeError, match=rf"did not start \(attempt {attempts} of {attempts}\)"):
        cluster_helpers.LocalCluster(num_cpus=0, no_such_ray_argument=1)
    err = capsys.readouterr().err
    assert [f"({n}/{attempts})" in err for n in range(2, attempts + 1)] == [True] * (attempts - 1), err


def test_each_start_of_an_autoscaling_head_finds_its_autoscaler_config(monkeypatch):
    """A failed start's temp dir is removed with it, so the config `ray start --autoscaling-config` names is
    written again before every attempt (it was not: the second start found no file)."""
    seen = []

    def failing_ray_start(command, **_):
        config = next(a for a in command if a.startswith("--autoscaling-config=")).split("=", 1)[1]
        seen.append(Path(config).is_file())
        raise subprocess.CalledProcessError(1, command, output="", stderr=REFUSED)

    monkeypatch.setattr(cluster_helpers, "NODE_START_TIMEOUT", REFUSED)
    monkeypatch.setattr(cluster_helpers.subprocess, "run", failing_ray_start)
    with pytest.raises(RuntimeError, match="the Ray head did not start"):
        cluster_helpers.RayHead(num_cpus=0, autoscaling={"worker_types": {"cpu_worker": {"resources": {"CPU": 1},
                                                                                        "max_workers": 1}},
                                                         "max_workers": 1})
    assert seen == [True] * cluster_helpers.START_ATTEMPTS


class _NodesThatTimeOut:
    """Stands in for `ray.cluster_utils.Cluster`: each add_node starts a child process (the node's raylet) and the
    first `timeouts` of them then fail as Ray does when the raylet does not register in 30 s."""

    def __init__(self, timeouts: int, error: str = cluster_helpers.NODE_START_TIMEOUT):
        self.timeouts, self.error, self.raylets = timeouts, error, []

    def add_node(self, **node_args):
        self.raylets.append(subprocess.Popen(["sleep", "60"]))
        if len(self.raylets) <= self.timeouts:
            raise Exception(f"{self.error}. This could happen because some of the raylet failed to startup")
        return node_args


def test_a_worker_node_that_timed_out_is_started_again_and_its_raylet_ended(capsys):
    """`_add_node` (LocalCluster's add): the timed-out attempt's raylet, a child started during the attempt, is
    killed, a child from before (another node's raylet) lives on, and the next attempt's node is returned."""
    earlier = subprocess.Popen(["sleep", "60"])
    cluster = _NodesThatTimeOut(timeouts=1)
    try:
        assert cluster_helpers._add_node(cluster, {"num_cpus": 2}) == {"num_cpus": 2}
        assert cluster.raylets[0].wait(timeout=10) == -9
        assert cluster.raylets[1].poll() is None and earlier.poll() is None
        assert f"starting it again (2/{cluster_helpers.START_ATTEMPTS})" in capsys.readouterr().err
    finally:
        for proc in (earlier, *cluster.raylets):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("timeouts, error", [(99, cluster_helpers.NODE_START_TIMEOUT), (1, "GCS unreachable")])
def test_a_worker_node_fails_after_its_attempts_or_at_once_on_another_error(timeouts, error):
    cluster = _NodesThatTimeOut(timeouts, error)
    try:
        with pytest.raises(Exception, match=error):
            cluster_helpers._add_node(cluster, {"num_cpus": 2})
        assert len(cluster.raylets) == (cluster_helpers.START_ATTEMPTS if timeouts == 99 else 1)
    finally:
        for proc in cluster.raylets:
            proc.kill()
            proc.wait()
