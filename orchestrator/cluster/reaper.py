"""The local Ray of a launcher ends with the launcher, however the launcher ends (a SIGKILL included).

Ray binds the processes a driver starts to it (the kernel's parent-death signal: gcs_server, raylet, the log
monitor), but not the raylet's own children: after `kill -9` of a launcher, Ray's DashboardAgent and
RuntimeEnvAgent live on, ignoring SIGTERM, and the Train workers go on training for seconds (and may write
one more checkpoint) until they notice that their raylet is gone.

So `start_local_ray` starts this module as a small process of its own, reading a pipe from the launcher, and
tells it the session folder of each Ray it starts (`/tmp/ray/session_<time>_<pid>`, one per Ray instance). The
kernel closes that pipe when the launcher ends, for any reason; the reaper then SIGKILLs, until none is left,
every process of that Ray, and no other: a process whose environment names the launcher as owner
(`OWNER_ENV`, set through the raylet's environment, which every Ray process inherits), or one whose environment
Ray blanked and that has a file open (or its working directory) in one of the session folders. Ray's agents
rename themselves (`ray::DashboardAgent`) with Ray's setproctitle, which zeroes the memory /proc/<pid>/environ
shows, so for them the session folder (their log files) is what is left; a process with a readable environment
that does not name the owner is never this Ray's, whatever it has open: a `tail -f` of a Ray log, a shell whose
working directory is the session folder, another launcher's Ray. A launcher that ends normally has already
shut its Ray down (Ray's atexit hook), so the reaper then finds nothing.
Ray's own reaper (ray/_private/ray_process_reaper.py) is the same idea for the process group, used only
where the kernel's fate sharing is missing; a process group is not the right unit here: a launcher started
from a shell shares its group with the shell's other jobs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

OWNER_ENV = "ORCHESTRATOR_LOCAL_RAY_OWNER"
"""In every process of a local Ray: who started it (`<launcher pid>-<random>`, unique per launcher)."""
SETTLE_S = 10.0
"""How long the reaper keeps looking for stragglers (a worker being spawned while the launcher died)."""


def _in_session(pid: str, sessions: tuple[str, ...]) -> bool:
    """The process has a file open, or its working directory, in one of the session folders."""
    if not sessions:
        return False
    links = [f"/proc/{pid}/cwd"]
    try:
        links += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    for link in links:
        try:
            target = os.readlink(link)
        except OSError:
            continue
        if target.startswith(sessions):
            return True
    return False


def owned_by(owner: str, sessions: tuple[str, ...] = (), spare: tuple[int, ...] = (),
             variable: str = OWNER_ENV) -> list[int]:
    """The processes of `owner`'s Ray: its owner in their environment (as `variable`), or an environment Ray
    blanked (a process it renamed) and a file in one of its session folders; never this one nor those in
    `spare`."""
    needle = f"{variable}={owner}".encode()
    sessions = tuple(folder.rstrip("/") + "/" for folder in sessions)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) in (os.getpid(), *spare):
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # Ray's setproctitle zeroes the environment from its start (variables added to the parent after it
        # started may survive at the end); a real environment never starts with an empty entry.
        blanked = environ.startswith(b"\0")
        if needle in environ.split(b"\0") or (blanked and _in_session(entry, sessions)):
            found.append(int(entry))
    return found


def reap(owner: str, sessions: tuple[str, ...] = (), spare: tuple[int, ...] = (), settle_s: float = SETTLE_S,
         variable: str = OWNER_ENV) -> int:
    """SIGKILL every process of `owner`'s Ray (but those in `spare`) until a scan finds none twice in a row (or
    `settle_s` passed); how many were killed. `variable` names the environment variable that carries the owner
    (the test suite's guard, tests/process_guard.py, marks its own processes with another)."""
    killed, quiet_scans, deadline = 0, 0, time.monotonic() + settle_s
    while quiet_scans < 2 and time.monotonic() < deadline:
        pids = owned_by(owner, sessions, spare, variable)
        quiet_scans = 0 if pids else quiet_scans + 1
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    return killed


def tell_session(reaper: subprocess.Popen, session_dir: str) -> None:
    """Add a Ray session folder to those the reaper clears."""
    reaper.stdin.write(f"{os.path.realpath(session_dir)}\n".encode())
    reaper.stdin.flush()


def start_reaper(owner: str) -> subprocess.Popen:
    """The reaper of `owner`'s Ray, bound to this process by a pipe only this process holds (os.pipe's ends are
    not inherited by the processes Ray starts, PEP 446). Its own session: a Ctrl-C to the launcher's terminal
    does not stop it before it has done its job."""
    # By file: the module needs nothing but the standard library, and no import path of the launcher's.
    return subprocess.Popen([sys.executable, __file__, owner], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def main() -> None:
    owner = sys.argv[1]
    launcher = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sessions = tuple(line.decode().strip() for line in sys.stdin.buffer)  # until EOF: the launcher ended
    # The launcher itself is spared: its interpreter closes the pipe while it finalizes, with its own Ray log
    # files in the session folder still open, after Ray's atexit shutdown stopped the rest.
    reap(owner, tuple(filter(None, sessions)), spare=(launcher,))


if __name__ == "__main__":
    main()
