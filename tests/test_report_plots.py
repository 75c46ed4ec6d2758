"""The score-vs-parameters plot draws what its legend names: the Pareto front as a visible line whenever the front
has any extent, out to the largest model plotted (orchestrator/report/plots.py, `front_line`).

The smoke sweep's usual outcome is the case that once drew a legend entry with no line: one method both smallest
and best, so its front is a single point and a step line through one point has no length.
"""

from __future__ import annotations

import math

import pytest

from orchestrator.report.metrics import MethodRow
from orchestrator.report.pareto import pareto_front
from orchestrator.report.plots import front_line, score_vs_params_figure

# val/ppl (lower is better) and attention parameters of the smoke study's three kinds (d_model 64, 4 heads).
SMOKE = {"mha": (32_768, 89.7), "mhe": (14_720, 102.5), "sha": (14_336, 81.5)}


def _row(label: str, params: float, score: float) -> MethodRow:
    return MethodRow(label=label, kind=label, knobs={}, run_ids=("r",), n_runs=1, score_mean=score,
                     score_std=math.nan, params_attention=params, params_total=params, prr=math.nan,
                     peop=math.nan, tokens_per_s=math.nan, peak_memory_gb=math.nan)


def _front(points: dict[str, tuple[float, float]], mode: str = "min") -> tuple[list[float], list[float]]:
    params = [p for p, _ in points.values()]
    scores = [s for _, s in points.values()]
    return front_line(params, scores, pareto_front(params, scores, mode))


def test_a_one_point_front_is_held_flat_to_the_largest_model():
    # sha is smallest and best: the front is sha alone, drawn from sha to mha's size at sha's score.
    assert _front(SMOKE) == ([14_336, 32_768], [81.5, 81.5])


def test_a_staircase_steps_down_at_each_front_point_and_ends_at_the_largest_model():
    points = {"small": (10.0, 50.0), "mid": (20.0, 40.0), "dominated": (30.0, 45.0), "large": (40.0, 30.0),
              "larger": (80.0, 35.0)}
    # Step "post": each score holds until the next front point; the last (large) holds out to "larger".
    assert _front(points) == ([10.0, 20.0, 40.0, 80.0], [50.0, 40.0, 30.0, 30.0])
    # Higher is better: the same geometry with the scores' sense flipped.
    flipped = {name: (p, -s) for name, (p, s) in points.items()}
    assert _front(flipped, "max") == ([10.0, 20.0, 40.0, 80.0], [-50.0, -40.0, -30.0, -30.0])


def test_a_front_ending_at_the_largest_model_gets_no_extra_point():
    assert _front({"a": (10.0, 50.0), "b": (20.0, 40.0)}) == ([10.0, 20.0], [50.0, 40.0])
    assert _front({"only": (10.0, 50.0)}) == ([10.0], [50.0])


def test_a_point_without_a_score_does_not_stretch_the_front():
    unscored = {"a": (10.0, 50.0), "b": (20.0, 40.0), "unscored": (99.0, math.nan)}
    assert _front(unscored) == ([10.0, 20.0], [50.0, 40.0])


def _drawn(rows):
    fig = score_vs_params_figure(rows, "val/ppl", "min")
    ax = fig.axes[0]
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    shown = ax.get_legend()
    legend = {text.get_text(): handle for text, handle in zip(shown.get_texts(), shown.legend_handles)}
    return dashed, legend


def test_the_plot_draws_the_front_its_legend_shows():
    dashed, legend = _drawn([_row(label, *point) for label, point in SMOKE.items()])
    assert len(dashed) == 1
    xs, ys = dashed[0].get_data()
    assert (min(xs), max(xs)) == (14_336, 32_768) and set(ys) == {81.5}  # a visible line, not a point
    # Each score holds to the right until the next front point (a larger model), not to the left of it.
    assert dashed[0].get_drawstyle() == "steps-post"
    assert legend["Pareto front"].get_linestyle() == "--"
    assert legend["dominated"].get_linestyle() == "None"


@pytest.mark.parametrize("points", [{"only": (10.0, 50.0)}, {"a": (10.0, 60.0), "b": (20.0, 50.0)}])
def test_the_legend_shows_a_line_only_where_one_is_drawn(points):
    dashed, legend = _drawn([_row(label, *point) for label, point in points.items()])
    has_line = any(len(set(line.get_xdata())) > 1 for line in dashed)
    assert (legend["Pareto front"].get_linestyle() == "--") == has_line
    assert "dominated" not in legend  # every point is on the front
