"""The shape of the code (docs/architecture.md): orchestrator/'s rooms layered as that page states and draws them,
no import cycle, small modules in every package, the packages' one direction, lazy faces, one owner of the
storage layout, one way into MLflow, and read-only commands that do not import Ray."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from docs import architecture
from orchestrator.storage.layout import RunLayout, checkpoint_name, checkpoint_step, checkpoint_steps, latest_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orchestrator"
MAX_LINES = 450
"""STYLE.md splits a module past about 500 lines; DESIGN.md asks for none over about 450 in any package."""
LIMITED = ("orchestrator", "models", "tasks", "kernels", "benchmarks")
ROOMS = [path.name for path in sorted(PACKAGE.iterdir()) if (path / "__init__.py").exists()]


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
    graph = architecture.import_graph()  # function-local imports count: a cycle hidden in one is a cycle
    assert "orchestrator.launch.run" in graph and "orchestrator.storage.layout" in graph["orchestrator.launch.run"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle among orchestrator modules: " + " -> ".join(cycle)


def test_no_module_of_the_five_packages_is_over_the_line_limit():
    files = [path for package in LIMITED for path in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100 and PACKAGE / "launch" / "run.py" in files
    long = {str(path.relative_to(ROOT)): n for path in files if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by responsibility (over {MAX_LINES} lines): {long}"


# --- the rooms of orchestrator/, against docs/architecture.md ---------------------------------------------------

def test_the_rooms_import_no_cycle_and_only_the_rooms_below_them():
    page = architecture.PAGE.read_text()
    layers = architecture.stated_layers(page)
    assert sorted(layers) == sorted([*ROOMS, architecture.ENTRY]), "docs/architecture.md lists every room, once"
    rooms = architecture.room_graph()
    assert find_cycle(rooms) is None, "import cycle among rooms: " + " -> ".join(find_cycle(rooms))
    upward = architecture.against_the_layers(architecture.arrows_of(rooms), layers)
    assert not upward, ("these imports point up the layers of docs/architecture.md; move the code down (or the "
                        "layering, on that page, first):\n" + "\n".join(upward))


def test_the_pages_picture_is_the_code_and_points_only_down():
    page = architecture.PAGE.read_text()
    drawn, actual = architecture.drawn_arrows(page), architecture.arrows_of(architecture.room_graph())
    assert not architecture.against_the_layers(drawn, architecture.stated_layers(page))
    assert drawn == actual, (f"docs/architecture.md draws other arrows than the code has: only in the code "
                             f"{sorted(actual - drawn)}, only drawn {sorted(drawn - actual)}; if the code is right, "
                             "run python -m docs.architecture")


def test_an_upward_import_is_caught_by_the_layers_and_by_the_picture(tmp_path):
    """The check itself: a storage module that imports the launcher must fail both ways."""
    graph = architecture.import_graph()
    graph["orchestrator.storage.layout"] = graph["orchestrator.storage.layout"] | {"orchestrator.launch.run"}
    arrows = architecture.arrows_of(architecture.room_graph(graph))
    page = architecture.PAGE.read_text()
    assert architecture.against_the_layers(arrows, architecture.stated_layers(page)) == ["storage --> launch"]
    assert arrows - architecture.drawn_arrows(page) == {("storage", "launch")}
    assert find_cycle(architecture.room_graph(graph)) is not None


def test_the_top_level_packages_depend_one_way():
    """orchestrator -> tasks -> models -> kernels: nothing imports a package to its left."""
    order = ["orchestrator", "tasks", "models", "kernels"]
    wrong = []
    for i, package in enumerate(order):
        for path in sorted((ROOT / package).rglob("*.py")):
            for name in architecture.imported_names(path):
                top = name.split(".")[0]
                if top in order[:i]:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(sorted(set(wrong)))


FACED_ROOMS = [room for room in ROOMS if room not in ("spec", "tracking")]
FACE_CHECK = textwrap.dedent("""
    import importlib, json, sys
    rooms = {rooms!r}
    faces = {{room: importlib.import_module(f"orchestrator.{{room}}") for room in rooms}}
    found = {{room: {{"inside": sorted(m for m in sys.modules if m.startswith(f"orchestrator.{{room}}."))}}
              for room in rooms}}  # a face loads nothing until a name is used
    for room, face in faces.items():
        try:
            for name in face.__all__:
                getattr(face, name)
            found[room]["resolved"] = len(face.__all__)
        except Exception as err:
            found[room]["error"] = f"{{type(err).__name__}}: {{err}}"
    print("FACES", json.dumps(found))
""")


@pytest.fixture(scope="module")
def faces() -> dict[str, dict]:
    """What one fresh interpreter finds of every face: the room's modules loaded once every face is imported (none
    may be, so a face that loads its own modules, or another room's, is caught), then whether each offered name
    resolves. One interpreter for all, not one per room (each imports torch, and launch's names Ray and MLflow:
    seconds apiece): every face is imported before any name is asked, so the first check is the per-room one or
    stricter; a name that resolved only in some import order would need an import cycle, which
    test_orchestrator_has_no_import_cycle refuses."""
    done = subprocess.run([sys.executable, "-c", FACE_CHECK.format(rooms=FACED_ROOMS)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "FACES " in done.stdout, done.stdout + done.stderr
    return json.loads(done.stdout.split("FACES ", 1)[1])


@pytest.mark.slow
@pytest.mark.parametrize("room", FACED_ROOMS)
def test_a_face_offers_names_that_resolve_and_loads_nothing_until_asked(room, faces):
    found = faces[room]
    assert not found["inside"], f"importing the faces loaded modules of orchestrator.{room}: {found['inside']}"
    assert "error" not in found and "resolved" in found, found


def test_a_face_refuses_a_name_that_a_module_would_shadow():
    from orchestrator import lazy_face
    with pytest.raises(ImportError, match=r"\['run'\]"):
        lazy_face("orchestrator.launch", {"run": "run", "run_sweep": "sweep"})
    getattr_, _ = lazy_face("orchestrator.launch", {"run_sweep": "sweep"})
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        getattr_("nothing")


def test_the_cli_and_the_benchmarks_import_rooms_by_their_faces():
    """`from orchestrator.launch.run import ...` in cli.py or a benchmark reaches past the face."""
    deep = re.compile(r"^\s*from orchestrator\.(" + "|".join(r for r in ROOMS if r not in ("spec", "tracking"))
                      + r")\.\w+ import", re.M)
    files = [PACKAGE / "cli.py", *sorted((ROOT / "benchmarks").rglob("*.py"))]
    offenders = [f"{path.relative_to(ROOT)}: {m.group(0).strip()}" for path in files
                 for m in deep.finditer(path.read_text())]
    assert not offenders, "import these through the room's face (its __init__):\n" + "\n".join(offenders)


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
    offenders = _offenders(CHECKPOINT_NAME_CODE, {PACKAGE / "storage" / "layout.py"})
    assert not offenders, "use orchestrator.storage.layout.checkpoint_name / checkpoint_step:\n" + "\n".join(offenders)


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
    import contextlib, io, json, sys, traceback
    from orchestrator.cli import main
    found = {{}}
    for label, argv in {commands!r}:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exit:
                code = exit.code
            except Exception:
                code = "raised " + traceback.format_exc()
        loaded = sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))
        found[label] = {{"code": code, "ray": loaded[:5], "out": out.getvalue(), "err": err.getvalue()}}
    print("COMMANDS", json.dumps(found))
""")
READ_ONLY = {"status": (["status", "nothing-here", "--storage-path", "{tmp}/runs"], 2),
             "report": (["report", "--tracking-uri", "sqlite:///{tmp}/absent.db", "--experiment", "x"], 2),
             "stored-status": (["status", "unit", "--storage-path", "{tmp}/stored"], 0)}
"""The read-only commands run, in this order, by one fresh interpreter: argv and the exit code expected."""


@pytest.fixture(scope="module")
def read_only_runs(tmp_path_factory) -> dict[str, dict]:
    """Each command of READ_ONLY, one after another in one fresh interpreter: its exit code, output and the Ray
    modules loaded once it returned. One interpreter is as strict as one each: Ray, once imported, stays in
    sys.modules, so a command that imports it is seen after it (and after every later one); what one command
    imported before another cannot hide Ray, since that import would have brought Ray in with the first.
    The stored run: what the launcher had recorded (storage, then MLflow), for the whole status path."""
    tmp = tmp_path_factory.mktemp("read-only")
    storage = tmp / "stored"
    RunLayout(str(storage), "unit").write_meta({"kind": "run", "spec": {
        "name": "unit", "task": {"kind": "clm"}, "tracking": {"uri": f"sqlite:///{tmp}/m.db"}}})
    (storage / "unit" / checkpoint_name(2)).mkdir()
    commands = [(label, [arg.format(tmp=tmp) for arg in argv]) for label, (argv, _) in READ_ONLY.items()]
    done = subprocess.run([sys.executable, "-c", _READ_ONLY.format(commands=commands)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "COMMANDS " in done.stdout, done.stdout + done.stderr
    return {"storage": storage, **json.loads(done.stdout.split("COMMANDS ", 1)[1])}


def _ran_without_ray(found: dict, label: str) -> dict:
    ran = found[label]
    assert ran["code"] == READ_ONLY[label][1], ran
    assert not ran["ray"], (f"Ray was imported by {label} or a command before it ({list(READ_ONLY)}): "
                            f"{ran['ray']}")
    return ran


@pytest.mark.slow
@pytest.mark.parametrize("command", ["status", "report"])
def test_read_only_commands_do_not_import_ray(read_only_runs, command):
    _ran_without_ray(read_only_runs, command)


@pytest.mark.slow
def test_status_of_a_stored_run_does_not_import_ray(read_only_runs):
    """The whole status path (storage, then MLflow), on a run the launcher had recorded."""
    ran = _ran_without_ray(read_only_runs, "stored-status")
    storage = read_only_runs["storage"]
    assert f"last checkpoint: {storage}/unit/{checkpoint_name(2)}" in ran["out"], ran


def test_only_the_tracking_modules_build_mlflow_clients_or_create_runs():
    tracking = set((PACKAGE / "tracking").glob("*.py"))
    offenders = _offenders(r"MlflowClient\(|create_run|from mlflow|import mlflow", tracking)
    assert not offenders, "read through orchestrator.tracking.read, write through .write:\n" + "\n".join(offenders)


def test_the_callback_a_runs_controller_unpickles_imports_ray_alone():
    """Ray unpickles a run's callbacks in its Train controller's process, importing the module that defines each:
    the launcher's report relay must not bring the spec, torch and the models into every controller."""
    import ast

    from orchestrator.launch.ray_console import RunReports
    from orchestrator.launch.controller_parts import ReportRelay

    reports = RunReports.__new__(RunReports)  # without its queue actor (no Ray here)
    reports._queue = "queue"
    relay = reports.relay()
    assert type(relay) is ReportRelay and relay.queue == "queue"
    tree = ast.parse((PACKAGE / "launch" / "controller_parts.py").read_text())
    imported = {node.module if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert {name.split(".")[0] for name in imported} <= {"__future__", "typing", "ray"}, imported
