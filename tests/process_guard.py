"""Nothing a test session started outlives it, however pytest ends (a SIGKILL included).

The tests start long-lived processes in sessions of their own (so that a test can end a whole tree at once):
`mlflow server`, SeaweedFS's `weed`, `python -m orchestrator` launchers with their own local Ray, Ray's
multi-node test clusters, the browser. A session of its own also means that a pytest killed midway takes none of
them with it: they went on listening on their ports, and the next run found them.

So conftest.py starts this module once per pytest session, as a small process of its own reading a pipe that
only pytest holds, and marks the session's environment with `SESSION_ENV=<tag>` before anything else starts:
every process the session starts inherits it (Popen copies os.environ; a local Ray's raylet passes it on to its
workers). The kernel closes the pipe when pytest ends, for any reason; the guard then SIGKILLs, until none is
left, every process whose environment carries the tag, and the processes Ray renamed (their environment blanked
by Ray's setproctitle) that keep a file open in a Ray session folder one of those tagged processes had open:
the same search as a launcher's reaper (orchestrator/cluster/reaper.py), keyed by the test session's tag. A
pytest that ends normally has stopped everything already, and the guard finds nothing.

A pytest run inside a test (tests/test_process_guard.py) gets a tag of its own, so an inner session's guard
never touches the outer session's processes; the outer guard still finds the inner pytest by the outer tag it
was started with, and ending it ends the inner guard's pipe.

A filesystem a test mounts (tests/test_full_disk.py's small tmpfs) is not a process: its fixture unmounts it at
teardown, and a SIGKILLed pytest runs none, which left the tmpfs mounted under pytest's temporary folder (and
pytest's later clean-ups failing on it: "Device or resource busy"). So the same pipe carries the mount points
the session holds (`tmpfs`): the guard unmounts those still held once the session's processes are gone.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from orchestrator.cluster import reaper

SESSION_ENV = "ORCHESTRATOR_TEST_SESSION"
"""In every process a test session started: that session's tag (`<pytest pid>-<random>`)."""
SETTLE_S = 20.0
"""How long the guard keeps looking for stragglers (a Ray worker being spawned while pytest died)."""


def ray_sessions_of(pids: list[int]) -> tuple[str, ...]:
    """The Ray session folders (`.../session_<time>_<pid>`) that these processes have a file open in."""
    found = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            parts = Path(target).parts
            for i, part in enumerate(parts):
                if part.startswith("session_") and part != "session_latest":
                    found.add(str(Path(*parts[: i + 1])))
                    break
    return tuple(sorted(found))


def sweep(tag: str, settle_s: float = SETTLE_S) -> int:
    """SIGKILL every process of the session `tag` (and the renamed Ray processes of its Ray sessions); how many."""
    tagged = reaper.owned_by(tag, variable=SESSION_ENV)
    sessions = ray_sessions_of(tagged)
    return reaper.reap(tag, sessions, settle_s=settle_s, variable=SESSION_ENV)


def start_guard(tag: str) -> subprocess.Popen:
    """The guard of the session `tag`, bound to this process by a pipe only this process holds (os.pipe's ends
    are not inherited by the processes the tests start, PEP 446). Its own session: a Ctrl-C to pytest's terminal
    does not stop it before it has done its job. The tag is not in its own environment (it would find itself
    harmless anyway: the search spares its own pid)."""
    root = Path(__file__).resolve().parents[1]
    env = {name: value for name, value in os.environ.items() if name != SESSION_ENV}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(root), env.get("PYTHONPATH"))))
    return subprocess.Popen([sys.executable, "-m", "tests.process_guard", tag], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env,
                            cwd=root)


def new_tag() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


_guard: subprocess.Popen | None = None
"""This process's guard (conftest.py's pytest_configure), told of the mounts the session holds."""


def set_guard(guard: subprocess.Popen) -> None:
    global _guard
    _guard = guard


def mount_line(word: str, path: Path) -> bytes:
    """A line of the guard's pipe: `mount` or `unmount`, then the path's bytes in hex (a path may hold any byte)."""
    return f"{word} {os.fsencode(path).hex()}\n".encode()


def _tell(word: str, path: Path) -> None:
    if _guard is None or _guard.stdin is None:
        return
    try:
        _guard.stdin.write(mount_line(word, path))
        _guard.stdin.flush()
    except OSError:  # the guard is gone (killed by hand): the block's own unmount still runs
        pass


@contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (made if missing), unmounted (lazily: a process may still hold a file
    in it) when the block ends, or by the guard if pytest ends first, however it ends. PermissionError, with
    mount's words, where it cannot be mounted (mounting needs root)."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                          text=True, check=False)
    if done.returncode != 0:
        raise PermissionError(f"mounting a tmpfs needs root: {done.stderr.strip()}")
    _tell("mount", path)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)
        _tell("unmount", path)


def held_mounts(lines: Iterable[bytes]) -> list[Path]:
    """The mount points a session's `mount` and `unmount` lines leave held, in the order they were mounted."""
    held: dict[Path, None] = {}
    for line in lines:
        word, _, hexed = line.strip().partition(b" ")
        if not hexed:
            continue
        path = Path(os.fsdecode(bytes.fromhex(hexed.decode())))
        if word == b"mount":
            held[path] = None
        elif word == b"unmount":
            held.pop(path, None)
    return list(held)


def main() -> None:
    import signal

    tag = sys.argv[1]
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # pytest's process group may be sent a SIGTERM with it
    mounts = held_mounts(sys.stdin.buffer)  # until EOF: pytest ended
    sweep(tag)
    for path in reversed(mounts):  # nothing of the session holds a file there any more
        subprocess.run(["umount", "-l", str(path)], check=False, capture_output=True)


if __name__ == "__main__":
    main()
