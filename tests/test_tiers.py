"""What decides a test's tier (tests/conftest.py, docs/testing.md), apart from the marks themselves."""

from __future__ import annotations

from types import SimpleNamespace

from tests import conftest


def test_a_module_marked_slow_as_a_whole_is_left_uncollected_without_run_slow(tmp_path, monkeypatch):
    """Without RUN_SLOW=1 a module whose tests are all the slow tier's (its `pytestmark` line) is not imported at
    all; a module with one slow test among others, and a helper that is not a test module, are collected as ever;
    with RUN_SLOW=1 every module is."""
    slow = tmp_path / "test_processes.py"
    slow.write_text("import pytest\n\npytestmark = pytest.mark.slow\n\n\ndef test_a():\n    pass\n")
    mixed = tmp_path / "test_mixed.py"
    mixed.write_text("import pytest\n\n\n@pytest.mark.slow\ndef test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    helper = tmp_path / "process_helpers.py"
    helper.write_text("import pytest\n\npytestmark = pytest.mark.slow\n")
    config = SimpleNamespace(stash={})
    monkeypatch.delenv(conftest.RUN_SLOW, raising=False)
    assert [conftest.pytest_ignore_collect(path, config) for path in (slow, mixed, helper)] == [True, None, None]
    monkeypatch.setenv(conftest.RUN_SLOW, "1")
    assert [conftest.pytest_ignore_collect(path, config) for path in (slow, mixed, helper)] == [None, None, None]
