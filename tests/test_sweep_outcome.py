"""What a sweep prints as its best trial once it ends or is interrupted (orchestrator/launch/sweep_summary.py
`best_of`). No Ray: the candidates are what `_sweep_outcome` passes, Tune's best and each trial's newest report."""

from __future__ import annotations

import math

from orchestrator.launch.sweep_summary import best_of

MHA, SHA = {"model.attention": {"kind": "mha"}}, {"model.attention": {"kind": "sha"}}


def test_after_an_interrupt_the_best_is_the_best_of_the_trials_newest_reports_not_tunes_lagging_one():
    """Ctrl-C at step 400: Tune's results held mha's 6.294 from an older evaluation; the trial folders' newest
    reports (shown on the trial lines) are mha 6.201 and sha 6.101. The summary named mha at 6.294."""
    tune_best = {"config": MHA, "metrics": {"val/ppl": 6.294, "step": 300}}
    trials = [{"trial_id": "a", "config": MHA, "metrics": {"val/ppl": 6.201, "step": 400}},
              {"trial_id": "b", "config": SHA, "metrics": {"val/ppl": 6.101, "step": 400}}]
    best = best_of([tune_best, *trials], "val/ppl", "min")
    assert best == {"config": SHA, "metrics": {"val/ppl": 6.101, "step": 400}}
    # a higher-is-better metric takes the largest; Tune's history can hold a better value than any last report
    assert best_of([{"config": MHA, "metrics": {"val/acc": 0.9}}, {"config": SHA, "metrics": {"val/acc": 0.8}}],
                   "val/acc", "max")["config"] == MHA


def test_no_candidate_with_a_finite_value_gives_no_best():
    assert best_of([], "val/ppl", "min") is None
    assert best_of([{"config": MHA, "metrics": {"val/ppl": math.nan}}, {"config": SHA, "metrics": {}}],
                   "val/ppl", "min") is None
    assert best_of([{"config": MHA, "metrics": {"val/ppl": math.nan}}, {"config": SHA, "metrics": {"val/ppl": 7.0}}],
                   "val/ppl", "min")["config"] == SHA
