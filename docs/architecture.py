"""The picture in docs/architecture.md, drawn from the code's own imports, and the reading of what that page
allows. tests/test_orchestrator_layout.py holds the code against the page with these functions.

    python -m docs.architecture            # rewrite the page's picture (mermaid) and its matrix, docs/img/rooms.png
    python -m docs.architecture --check    # exit 1, naming the arrows, when the page's picture is not the code's

A room is a subpackage of orchestrator/ (`orchestrator.launch.run` is in room `launch`); the modules at the top
of the package (cli.py, __main__.py) are the room `cli`, and the package root (`orchestrator/__init__.py`, the
faces' lazy loader) is below every room and left out of the picture. Every import counts, wherever it stands
in a file (a function-local or TYPE_CHECKING import is still an arrow a reader must know about).

The page states the layering once: the numbered list under "## Layers" orders the rooms from the top down, and a
room may import only rooms below it. The picture, between the `rooms:begin` and `rooms:end` markers, holds one
`A --> B` line per room A whose modules import room B's.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orchestrator"
PAGE = ROOT / "docs" / "architecture.md"
PNG = ROOT / "docs" / "img" / "rooms.png"
ENTRY = "cli"
"""The room of orchestrator/'s top-level modules (cli.py, __main__.py)."""
ROOT_MODULE = "orchestrator"
BEGIN, END = "<!-- rooms:begin (python -m docs.architecture) -->", "<!-- rooms:end -->"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    return {module_name(path): path for path in sorted(package.rglob("*.py"))}


def imported_names(path: Path) -> list[str]:
    """Every absolute import of the file as dotted candidates: `from a.b import c` gives a.b.c then a.b (c may
    name a module or a thing in a.b)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports."""
    known = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph[name] = set()
        for target in imported_names(path):
            while target and target not in known:  # `orchestrator.spec.X` where X is a class of spec/
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def room_of(module: str) -> str | None:
    """The room of an orchestrator module; None for the package root."""
    parts = module.split(".")
    if parts == [ROOT_MODULE]:
        return None
    if len(parts) == 2 and not (PACKAGE / parts[1]).is_dir():
        return ENTRY
    return parts[1]


def room_graph(graph: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Room -> the other rooms its modules import (the package root left out)."""
    rooms: dict[str, set[str]] = {}
    for module, targets in (import_graph() if graph is None else graph).items():
        if (room := room_of(module)) is None:
            continue
        rooms.setdefault(room, set()).update(t for t in map(room_of, targets) if t is not None and t != room)
    return rooms


def arrows_of(rooms: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in rooms.items() for b in targets}


def stated_layers(page: str) -> list[str]:
    """The rooms of the page's "## Layers" list, top first (each item starts with the room's name in backticks)."""
    section = page.split("## Layers", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\d+\. `([a-z_]+)/?`", section, re.M)


def drawn_arrows(page: str) -> set[tuple[str, str]]:
    block = page.split(BEGIN, 1)[1].split(END, 1)[0]
    return set(re.findall(r"^\s*([a-z_]+) --> ([a-z_]+)\s*$", block, re.M))


def against_the_layers(arrows: set[tuple[str, str]], layers: list[str]) -> list[str]:
    """The arrows that do not point down the stated order (or name a room the order lacks)."""
    rank = {room: i for i, room in enumerate(layers)}
    return sorted(f"{a} --> {b}" for a, b in arrows
                  if a not in rank or b not in rank or rank[a] >= rank[b])


def mermaid(arrows: set[tuple[str, str]], layers: list[str]) -> str:
    rank = {room: i for i, room in enumerate(layers)}
    lines = ["```mermaid", "flowchart TD"]
    lines += [f"    {a} --> {b}" for a, b in sorted(arrows, key=lambda e: (rank.get(e[0], 99), rank.get(e[1], 99)))]
    return "\n".join(lines + ["```"])


def draw_png(arrows: set[tuple[str, str]], layers: list[str], out: Path) -> None:
    """The rooms' dependency matrix: row A, column B is filled when A imports B, rooms in the stated order (top
    room first). Layered code leaves everything on or above the diagonal empty; a filled cell there would be an
    upward import."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(layers)
    labels = ["cli.py" if room == ENTRY else f"{room}/" for room in layers]
    fig, ax = plt.subplots(figsize=(0.55 * n + 2.4, 0.5 * n + 1.6))
    for i in range(n):
        for j in range(n):
            upward = j <= i
            filled = (layers[i], layers[j]) in arrows
            ax.add_patch(plt.Rectangle((j, i), 1, 1, ec="white", lw=1.5,
                                       fc=("#c0392b" if upward else "#2e5c8a") if filled
                                       else ("#f3e3e1" if upward else "#eef2f7")))
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_xticks([j + 0.5 for j in range(n)], labels, rotation=50, ha="right", family="monospace", fontsize=9)
    ax.set_yticks([i + 0.5 for i in range(n)], labels, family="monospace", fontsize=9)
    ax.tick_params(length=0)
    ax.set_aspect("equal")
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title("orchestrator/: row imports column\n(blue: an import; red cells would point up)", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare the page's picture with the code")
    args = parser.parse_args(argv)
    page = PAGE.read_text()
    layers = stated_layers(page)
    arrows = arrows_of(room_graph())
    wrong = against_the_layers(arrows, layers)
    if wrong:
        print("imports against the layers of docs/architecture.md (move the code, or change the layering there "
              "first):\n  " + "\n  ".join(wrong), file=sys.stderr)
        return 1
    drawn = drawn_arrows(page)
    if args.check:
        if drawn != arrows:
            print(f"docs/architecture.md's picture is not the code's: in the code only {sorted(arrows - drawn)}, "
                  f"drawn only {sorted(drawn - arrows)}; run python -m docs.architecture", file=sys.stderr)
            return 1
        print(f"docs/architecture.md matches the code: {len(arrows)} arrows among {len(layers)} rooms")
        return 0
    head, rest = page.split(BEGIN, 1)
    PAGE.write_text(head + BEGIN + "\n" + mermaid(arrows, layers) + "\n" + END + rest.split(END, 1)[1])
    draw_png(arrows, layers, PNG)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(arrows)} arrows) and {PNG.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
