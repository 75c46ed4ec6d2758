"""The order pytest-xdist deals the tests out in (tests/schedule.py): the longest work units first."""

from __future__ import annotations

import json
from pathlib import Path

from tests.schedule import bare_id, longest_first, recorded_seconds, write_seconds

# (test id, work unit, slow?)
ITEMS = [
    ("m.py::short", "m.py::short", True),
    ("g.py::a", "@g", True),
    ("g.py::b", "@g", True),
    ("m.py::long", "m.py::long", True),
    ("n.py::new", "n.py::new", True),
    ("f.py::fast", "f.py::fast", False),
]


def _order(seconds: dict[str, float], items=ITEMS) -> list[str]:
    ordered = longest_first(items, unit_of=lambda i: i[1], test_id=lambda i: i[0], is_slow=lambda i: i[2],
                            seconds=seconds)
    return [test_id for test_id, _, _ in ordered]


def test_the_longest_unit_goes_first_and_a_units_tests_stay_together_in_their_order():
    seconds = {"m.py::short": 2.0, "g.py::a": 30.0, "g.py::b": 40.0, "m.py::long": 50.0, "n.py::new": 1.0}
    # @g is 70 s in all, more than its longest test: a unit's length is its tests' sum.
    assert _order(seconds) == ["g.py::a", "g.py::b", "m.py::long", "m.py::short", "n.py::new", "f.py::fast"]


def test_a_slow_test_without_a_recorded_time_counts_as_the_longest_recorded_one():
    seconds = {"m.py::short": 2.0, "g.py::a": 30.0, "g.py::b": 40.0, "m.py::long": 50.0}
    order = _order(seconds)
    assert order.index("n.py::new") < order.index("m.py::short")  # 50 s, as long as the longest recorded test
    assert order[-1] == "f.py::fast"  # a fast test without one counts as nothing


def test_without_recorded_times_units_go_by_their_number_of_tests_then_as_collected():
    assert _order({}) == ["g.py::a", "g.py::b", "m.py::short", "m.py::long", "n.py::new", "f.py::fast"]
    assert recorded_seconds(Path("/nonexistent/seconds.json")) == {}


def test_recorded_times_sum_a_tests_phases_under_its_id_without_the_xdist_group(tmp_path):
    assert bare_id("tests/t.py::test_a@ray_cluster") == "tests/t.py::test_a"
    assert bare_id("tests/t.py::test_b[x]@tests/t.py") == "tests/t.py::test_b[x]"
    assert bare_id("tests/t.py::test_c[user@host]") == "tests/t.py::test_c[user@host]"  # an @ of the test's own
    path = tmp_path / "seconds.json"
    write_seconds(str(path), [("tests/t.py::test_a@ray_cluster", 1.04), ("tests/t.py::test_a@ray_cluster", 20.0),
                              ("tests/t.py::test_a@ray_cluster", 0.5), ("tests/t.py::test_b[x]", 3.0)])
    assert json.loads(path.read_text()) == {"tests/t.py::test_a": 21.5, "tests/t.py::test_b[x]": 3.0}
    assert recorded_seconds(path) == {"tests/t.py::test_a": 21.5, "tests/t.py::test_b[x]": 3.0}
