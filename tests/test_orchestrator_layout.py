"""The shape of orchestrator/ (docs/orchestrator.md, "Modules"): no import cycle, small modules, one owner of
the storage layout, one way into MLflow, and read-only commands that do not import Ray."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from orchestrator.layout import RunLayout, checkpoint_name, checkpoint_step, checkpoint_steps, latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orchestrator"
MAX_LINES = 450
"""STYLE.md splits a module past about 500 lines; DESIGN.md asks for none over about 450 in orchestrator/."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Module -> the orchestrator modules it imports, anywhere in the file (function-local imports count: a
    cycle hidden in a function is still a cycle)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from orchestrator.tracking import write` names a module; `from orchestrator.spec import X` a name
                targets = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    edges.add(target)
                    break
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the graph as a path that ends where it starts, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return stack[stack.index(child):] + [child]
            if child not in state and (found := visit(child)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_orchestrator_has_no_import_cycle():
    graph = import_graph()
    assert "orchestrator.run" in graph and "orchestrator.layout" in graph["orchestrator.run"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among orchestrator modules: " + " -> ".join(cycle)


def test_no_orchestrator_module_is_over_the_line_limit():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by responsibility (over {MAX_LINES} lines): {long}"


def _code_files() -> list[Path]:
    return sorted([*PACKAGE.rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])


def _offenders(pattern: str, allowed: set[Path]) -> list[str]:
    regex = re.compile(pattern)
    return [f"{path.relative_to(ROOT)}:{i}: {line.strip()}" for path in _code_files() if path not in allowed
            for i, line in enumerate(path.read_text().splitlines(), 1) if regex.search(line)]


# Formatting (`checkpoint_{step:09d}`, "%09d", a "checkpoint_" prefix) or parsing (`checkpoint_(\d+)`, a glob or
# removeprefix of it) a checkpoint folder's name.
CHECKPOINT_NAME_CODE = r"""checkpoint_\{|%09d|:09d|["']checkpoint_["'*]|checkpoint_\(|checkpoint_\\d"""


def test_checkpoint_folder_names_are_made_and_parsed_only_in_the_layout():
    offenders = _offenders(CHECKPOINT_NAME_CODE, {PACKAGE / "layout.py"})
    assert not offenders, "use orchestrator.layout.checkpoint_name / checkpoint_step:\n" + "\n".join(offenders)


def test_checkpoint_names_round_trip(tmp_path):
    assert checkpoint_name(2750) == "checkpoint_000002750" and checkpoint_step("checkpoint_000002750") == 2750
    assert checkpoint_step("checkpoint_latest") is None and checkpoint_step(".partial-x") is None
    for step in (3, 12):
        (tmp_path / "run" / checkpoint_name(step)).mkdir(parents=True)
    (tmp_path / "run" / "evaluation").mkdir()
    assert checkpoint_steps(str(tmp_path / "run")) == {checkpoint_name(3): 3, checkpoint_name(12): 12}
    assert latest_checkpoint(str(tmp_path / "run")) == f"{tmp_path}/run/{checkpoint_name(12)}"


def test_run_layout_names_the_folders_of_a_sweep(tmp_path):
    layout = RunLayout(str(tmp_path), "study")
    for folder in ("trials/train-a1", "trials/pretrain-a1", "trials/train-b2"):
        (tmp_path / "study" / folder).mkdir(parents=True)
    assert layout.trial_folder("a1") == f"{tmp_path}/study/trials/train-a1"
    assert layout.trials() == [("a1", layout.trial_folder("a1")), ("b2", layout.trial_folder("b2"))]
    assert [label for label, _ in layout.stage_runs()] == ["pretrain-a1", "a1", "b2"]
    assert not layout.has_checkpoint()
    (tmp_path / "study" / "trials" / "pretrain-a1" / checkpoint_name(1)).mkdir()
    assert layout.has_checkpoint()
    assert layout.spool == f"{tmp_path}/study/mlflow-spool.jsonl" and layout.report_dir == tmp_path / "study" / "report"
    remote = RunLayout("s3://bucket/runs", "study")
    assert remote.remote and remote.lock_path is None and remote.report_dir is None
    assert remote.spool == "s3://bucket/runs/study/mlflow-spool.jsonl"
    assert remote.lock_location == "s3://bucket/runs/study/.orchestrator.lock"
    assert RunLayout("gs://bucket/runs", "study").lock_location is None  # no conditional writes through pyarrow
    assert remote.trial_folder("a1") == "s3://bucket/runs/study/trials/train-a1"


_READ_ONLY = textwrap.dedent("""
    import sys
    from orchestrator.cli import main
    code = main({argv!r})
    assert code == {code}, code
    loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
    assert not loaded, loaded[:5]
    print("no ray")
""")


@pytest.mark.parametrize("argv, code", [
    (["status", "nothing-here", "--storage-path", "{tmp}/runs"], 1),
    (["report", "--tracking-uri", "sqlite:///{tmp}/absent.db", "--experiment", "x"], 2),
], ids=["status", "report"])
def test_read_only_commands_do_not_import_ray(tmp_path, argv, code):
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    done = subprocess.run([sys.executable, "-c", _READ_ONLY.format(argv=argv, code=code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "no ray" in done.stdout, done.stdout + done.stderr


def test_status_of_a_stored_run_does_not_import_ray(tmp_path):
    """The whole status path (storage, then MLflow), on a run the launcher had recorded."""
    storage = tmp_path / "runs"
    RunLayout(str(storage), "unit").write_meta({"kind": "run", "spec": {
        "name": "unit", "task": {"kind": "clm"}, "tracking": {"uri": f"sqlite:///{tmp_path}/m.db"}}})
    (storage / "unit" / checkpoint_name(2)).mkdir()
    script = _READ_ONLY.format(argv=["status", "unit", "--storage-path", str(storage)], code=0)
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "no ray" in done.stdout, done.stdout + done.stderr
    assert f"last checkpoint: {storage}/unit/{checkpoint_name(2)}" in done.stdout


def test_only_the_tracking_modules_build_mlflow_clients_or_create_runs():
    tracking = set((PACKAGE / "tracking").glob("*.py"))
    offenders = _offenders(r"MlflowClient\(|create_run|from mlflow|import mlflow", tracking)
    assert not offenders, "read through orchestrator.tracking.read, write through .write:\n" + "\n".join(offenders)
