"""Nothing a run starts outlives it: the tool adopts what its workers leave behind and ends it.

A kernel may fork, and a forked child may leave the process group (``setsid``), so killing the
worker's group does not reach it. On Linux the tool makes itself a *child subreaper*
(``prctl(PR_SET_CHILD_SUBREAPER)``): a descendant whose parent dies is reparented to the tool
instead of to init, so it stays findable as a descendant (``/proc``: children of the tool's pid,
recursively). :func:`end_descendants` kills those started since a snapshot with ``SIGKILL`` and
reaps them. The CLI calls it before it renames any output into place and on every way out;
:func:`end_helpers` also stops multiprocessing's fork server and resource tracker when the
process is about to exit (a process that runs several commands keeps them between commands).

Elsewhere than Linux there is no ``/proc`` and no subreaper: nothing is found and nothing ends.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Iterable

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
PF_EXITING = 0x4  # linux/sched.h: set in a process's flags as it starts to exit, before it closes its files
GRACE_S = 2.0  # how long to wait for killed processes to be gone


@dataclass(frozen=True)
class Proc:
    """One process under ``/proc``: its id, its parent's, its state letter, its start time (clock
    ticks), and whether it has begun to exit (it may still show as running while it does)."""

    pid: int
    ppid: int
    state: str
    start: int
    exiting: bool = False

    @property
    def key(self) -> tuple[int, int]:
        """Who it is: a pid can be reused, a pid with its start time cannot."""
        return (self.pid, self.start)


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux); False where it cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _read(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode("ascii", errors="replace")
    except OSError:  # gone meanwhile
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces and parentheses
    return Proc(pid, int(fields[1]), fields[0], int(fields[19]), bool(int(fields[6]) & PF_EXITING))


def processes() -> list[Proc]:
    """Every process this one can see (empty without ``/proc``)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    found = (_read(int(n)) for n in names if n.isdigit())
    return [p for p in found if p is not None]


def descendants(root: int | None = None) -> list[Proc]:
    """The children of ``root`` (default: this process), their children, and so on."""
    root = os.getpid() if root is None else root
    children: dict[int, list[Proc]] = {}
    for p in processes():
        children.setdefault(p.ppid, []).append(p)
    out: list[Proc] = []
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child.pid)
    return out


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (one exiting, or a zombie, dead but not reaped, does not)."""
    p = _read(pid)
    return p is not None and p.state not in ("Z", "X") and not p.exiting


def snapshot() -> frozenset[tuple[int, int]]:
    """Who this process's descendants are now, so that :func:`end_descendants` spares them."""
    return frozenset(p.key for p in descendants())


def helper_pids() -> frozenset[int]:
    """multiprocessing's fork server and resource tracker, where this process started them."""
    pids = set()
    forkserver = sys.modules.get("multiprocessing.forkserver")
    tracker = sys.modules.get("multiprocessing.resource_tracker")
    for pid in (getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None),
                getattr(getattr(tracker, "_resource_tracker", None), "_pid", None)):
        if isinstance(pid, int):
            pids.add(pid)
    return frozenset(pids)


def _reap(pid: int) -> bool:
    """Collect the exit status of our child ``pid`` if it has one; True once it is gone."""
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:  # not our child (or reaped already): gone when /proc says so
        return not alive(pid)
    return done == pid


def end_descendants(before: Iterable[tuple[int, int]] = (), keep: Iterable[int] = (),
                    grace_s: float = GRACE_S) -> int:
    """Kill (``SIGKILL``) and reap every descendant not in ``before`` and not in ``keep``.

    The descendants of a kept process are still ended. Processes orphaned while this runs are
    reparented here (see :func:`become_subreaper`) and ended in turn.

    Returns:
        How many processes were ended.
    """
    spared, kept, me = set(before), set(keep), os.getpid()
    ended: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        found = [p for p in descendants() if p.key not in spared and p.pid not in kept]
        if not found:
            return len(ended)
        for p in found:
            if p.state not in ("Z", "X"):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            ended.add(p.pid)
        for p in found:
            if p.ppid == me:
                _reap(p.pid)
        if time.monotonic() > deadline:  # a process stuck in the kernel (state D): SIGKILL lands when it returns
            return len(ended)
        time.sleep(0.01)


def _stop_forkserver() -> None:
    server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if not isinstance(pid, int):
        return
    try:
        os.kill(pid, signal.SIGKILL)  # it holds nothing to tidy: its socket lives in the abstract namespace
    except ProcessLookupError:
        pass
    try:
        server._stop()  # closes its pipe, reaps it, forgets it: the next worker starts a fresh one
    except (OSError, AttributeError):
        pass


def _stop_tracker() -> None:
    tracker = getattr(sys.modules.get("multiprocessing.resource_tracker"), "_resource_tracker", None)
    fd, pid = getattr(tracker, "_fd", None), getattr(tracker, "_pid", None)
    if not isinstance(pid, int):
        return
    if isinstance(fd, int):
        try:
            os.close(fd)  # end of file tells it to free what leaked, then leave
        except OSError:
            pass
    tracker._fd, tracker._pid = None, None
    deadline = time.monotonic() + GRACE_S
    while not _reap(pid):
        if time.monotonic() > deadline:  # something still holds its pipe: end it without the tidying
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
            return
        time.sleep(0.01)


def end_helpers() -> None:
    """Stop the fork server and the resource tracker, for a process about to exit."""
    _stop_forkserver()
    _stop_tracker()


def end_all(before: Iterable[tuple[int, int]] = ()) -> int:
    """Everything this process started since ``before``, multiprocessing's helpers included."""
    ended = end_descendants(before, keep=helper_pids())
    end_helpers()
    return ended + end_descendants(before)
