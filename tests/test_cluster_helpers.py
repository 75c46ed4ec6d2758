"""The tests' own multi-node cluster (tests/cluster_helpers.py `LocalCluster`) starts its head again on Ray's 30 s
raylet timeout, as the launcher's local Ray does (tests/test_ray_env.py), and on nothing else. The head's start is a
real child process; the timeout is stood in for by an error the child really raises (an argument Ray refuses)."""

from __future__ import annotations

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
