"""The terminal lines of orchestrator/console/progress.py: report lines, trial labels, the sweep progress line and
its ETA. No Ray."""

from __future__ import annotations

import os
import pickle
import sys

import pytest

from orchestrator.console.progress import (
    SweepProgress,
    describe_config,
    quiet_exit_in_finalizers,
    report_line,
    trial_label,
)


def test_a_whole_attention_block_is_described_by_kind_and_knobs():
    assert describe_config({"model.attention": {"kind": "mhe", "heads": 4, "mode": "mul"}}) == "mhe heads=4 mode=mul"
    assert describe_config({"model.attention.k": 64, "optim.lr": 0.002}) == "k=64, lr=0.002"
    assert trial_label("4774b_00002", {"model.attention": {"kind": "sha", "heads": 4}}) == "00002 sha heads=4"


def test_report_line_shows_step_loss_and_the_sweep_metric_only():
    line = report_line("00000 mha heads=4", {"step": 100, "train/loss": 4.1234567, "val/ppl": 61.23456,
                                             "lr": 0.001, "train/tokens_per_s": 5e4, "val/loss": 4.1},
                       max_steps=300, metric="val/ppl")
    assert line == "[00000 mha heads=4] step 100/300 | train/loss 4.123 | val/ppl 61.23"


def _sweep(total=3, max_steps=100):
    return SweepProgress(name="smoke", total=total, max_steps=max_steps, metric="val/ppl", mode="min", started=0.0)


def test_counts_best_and_eta_from_the_steps_made_so_far():
    progress = _sweep()
    progress.sync({"a": "done", "b": "running"}, {"a": ("00000 mha", {"val/ppl": 50.0, "step": 100})})
    progress.result("a", "00000 mha", {"step": 100, "evaluations": 2, "training_iteration": 2, "val/ppl": 50.0})
    progress.result("b", "00001 sha", {"step": 50, "evaluations": 1, "training_iteration": 1, "val/ppl": 80.0})
    # 150 steps in 60 s = 2.5 steps/s; left: b's 50 steps + one pending trial's 100 = 150 -> 60 s.
    assert progress.counts() == {"done": 1, "running": 1, "pending": 1, "errored": 0}
    assert progress.steps_per_s(now=60.0) == 2.5
    assert progress.eta_s(now=60.0) == 60.0
    assert progress.line(now=60.0) == ("sweep smoke: 1/3 done, 1 running, 1 pending, 0 errored | best val/ppl 50 "
                                       "(00000 mha) | 2.50 steps/s | ETA 0:01:00")


def test_best_follows_the_mode_and_ignores_nan():
    progress = SweepProgress(name="s", total=2, max_steps=10, metric="val/bleu", mode="max", started=0.0)
    progress.result("a", "a", {"step": 5, "val/bleu": 20.0})
    progress.result("b", "b", {"step": 5, "val/bleu": float("nan")})
    progress.result("b", "b", {"step": 10, "val/bleu": 25.0})
    assert progress.best == (25.0, "b")


def test_a_resumed_trial_counts_its_steps_from_its_first_report_in_this_launcher():
    progress = _sweep(total=1)
    # Resumed from step 40: its first report here is at step 50 (evaluation 5, Tune iteration 1).
    progress.result("a", "a", {"step": 50, "evaluations": 5, "training_iteration": 1})
    assert progress.steps_per_s(now=10.0) is None  # nothing made here yet
    progress.result("a", "a", {"step": 60, "evaluations": 6, "training_iteration": 2})
    assert progress.steps_per_s(now=10.0) == 1.0
    assert progress.eta_s(now=10.0) == 40.0


def test_errored_trials_count_as_neither_pending_nor_running_and_end_the_eta():
    progress = _sweep(total=2)
    progress.result("a", "a", {"step": 100})
    progress.sync({"a": "done", "b": "error"})
    assert progress.counts() == {"done": 1, "running": 0, "pending": 0, "errored": 1}
    assert "ETA" not in progress.line(now=10.0)


def test_a_pickled_progress_forgets_its_clock():
    """Tune stores its callbacks with the sweep; a resume in another process must not use the old clock."""
    progress = _sweep()
    progress.result("a", "a", {"step": 10})
    restored = pickle.loads(pickle.dumps(progress))
    assert restored.started is None and restored.steps == {} and restored.best == progress.best


FINALIZER = """
import sys
from orchestrator.console.progress import quiet_exit_in_finalizers
quiet_exit_in_finalizers()

class Dying:
    def __del__(self):
        raise {error}

Dying()
print("went on", flush=True)
"""


@pytest.mark.parametrize(("error", "shown"), [("SystemExit(1)", False), ("ValueError('a real bug')", True)])
def test_a_sigterm_exit_inside_a_finalizer_is_not_printed_but_other_errors_are(error, shown):
    """Ray's SIGTERM handler raises SystemExit wherever a worker is; inside a finalizer Python would print
    "Exception ignored ... SystemExit: 1" with a traceback on the launcher's terminal."""
    import subprocess
    import sys

    from orchestrator.cluster.ray_env import PROJECT_ROOT

    done = subprocess.run([sys.executable, "-c", FINALIZER.format(error=error)], capture_output=True, text=True,
                          cwd=PROJECT_ROOT, env={**os.environ, "ORCHESTRATOR_VERBOSE": "0"}, timeout=60)
    assert done.stdout == "went on\n"
    assert ("Exception ignored" in done.stderr) is shown, done.stderr


def test_the_finalizer_hook_is_set_once_however_often_a_process_asks(monkeypatch):
    """A trial driver reused for trial after trial (orchestrator/launch/sweep.py) asks once per trial; a hook
    wrapping the last one each time would end, a thousand trials on, in a RecursionError at the first finalizer."""
    monkeypatch.setenv("ORCHESTRATOR_VERBOSE", "0")
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    quiet_exit_in_finalizers()
    first = sys.unraisablehook
    quiet_exit_in_finalizers()
    assert sys.unraisablehook is first and first.drops_system_exit
