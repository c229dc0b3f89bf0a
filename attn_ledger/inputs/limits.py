"""Bounds on what a request may ask for, checked before anything is allocated.

Every size a user gives (batch, lengths, widths, heads) ends up as the side of some tensor,
so sizes are bounded by one memory estimate rather than by a cap per option: a request is
refused (exit 2) when its estimated peak memory (:mod:`attn_ledger.engine.budget`) exceeds the headroom, the smallest of

* the cgroup's ``memory.max - memory.current`` (v2) or ``memory.limit_in_bytes -
  memory.usage_in_bytes`` (v1), over the process's cgroup and its ancestors,
* ``RLIMIT_AS`` less the process's current ``VmSize``,
* ``MemAvailable`` from ``/proc/meminfo``,

or the ``--max-memory`` a user states instead. Values that never become a tensor's side
(seeds, windows, the count of mask parts, config files) have fixed bounds here.

"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from attn_ledger.errors import InputError, ResourceError, shown


SEED_MAX = 2**63 - 1  # seeds are 0..SEED_MAX in every command and config
MAX_MASK_PARTS = 8  # relations joined by '+' (there are seven relation names)
MAX_MASK_CHARS = 200
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_DEPTH = 8  # a config is a table of values and lists; deeper nesting is refused
MAX_INT_DIGITS = 100  # the longest integer literal a config or option may hold
MAX_POSITION = 1 << 48  # windows, prefix lengths, cuts and block sizes stay far inside int64
ANNOUNCE_GRID = 1 << 28  # score-grid entries above which a run prints its estimate before starting
ANNOUNCE_BYTES = 1 << 30  # or estimated bytes above which it does


def format_bytes(n: float) -> str:
    """Bytes in binary units: ``512 B``, ``3.0 MiB``, ``1.5 GiB``; huge values in powers of ten."""
    if n >= 1 << 70:
        return f"{n:.2e} bytes"
    for unit, size in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


_SIZE = re.compile(r"([0-9]{1,20})(?:\.([0-9]{1,6}))?\s*([KMGT]?)(?:i?B)?", re.IGNORECASE)


def parse_size(text: str, field: str = "--max-memory") -> int:
    """``"8G"``, ``"512MiB"``, ``"1.5g"`` or plain bytes ``"1000000"`` (binary units) -> bytes."""
    m = _SIZE.fullmatch(text.strip()) if text.isascii() else None
    if m is None:
        raise InputError(f"{field}: got {shown(text)}, expected a size such as 8G, 512M or a number of bytes")
    whole, frac, unit = m.group(1), m.group(2) or "", m.group(3).upper()
    scale = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
    value = int(whole) * scale + ((int(frac) * scale) // 10 ** len(frac) if frac else 0)
    if value < 1:
        raise InputError(f"{field}: got {shown(text)}, expected a positive size")
    return value


# --- headroom ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Headroom:
    """Bytes a request may still allocate, and which limit set it."""

    bytes: int | None  # None: no limit could be read
    source: str


def _read_int(path: Path) -> int | None:
    """An integer file of /proc or /sys; ``max`` (no limit) and anything unreadable are None."""
    try:
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if not text.isdigit():
        return None
    value = int(text)
    return None if value >= 1 << 60 else value  # cgroup v1 writes "no limit" as a page-rounded 2^63


def _cgroup_paths(proc: Path) -> tuple[str | None, str | None]:
    """This process's cgroup v2 path and cgroup v1 memory-controller path."""
    v2 = v1 = None
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v2, v1


def _ancestors(root: Path, rel: str) -> Iterable[Path]:
    """The cgroup directory for ``rel`` under ``root`` and each parent up to ``root``.

    Inside a container the path from /proc may not exist under its own cgroup mount; then
    only the mount's root is read (it is the container's own cgroup).
    """
    parts = [p for p in rel.split("/") if p]
    for n in range(len(parts), -1, -1):
        d = root.joinpath(*parts[:n])
        if d.is_dir():
            yield d


def cgroup_headroom(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The least of ``limit - usage`` over this process's memory cgroup and its ancestors (v2 or v1)."""
    v2, v1 = _cgroup_paths(proc)
    best: int | None = None
    if v2 is not None and (cgroup_root / "cgroup.controllers").exists():
        for d in _ancestors(cgroup_root, v2):
            limit, used = _read_int(d / "memory.max"), _read_int(d / "memory.current")
            if limit is not None:
                room = limit - (used or 0)
                best = room if best is None else min(best, room)
    if v1 is not None:
        root = cgroup_root / "memory"
        for d in _ancestors(root, v1):
            limit, used = _read_int(d / "memory.limit_in_bytes"), _read_int(d / "memory.usage_in_bytes")
            if limit is not None:
                room = limit - (used or 0)
                best = room if best is None else min(best, room)
    return None if best is None else max(0, best)


def _status_kib(proc: Path, key: str) -> int | None:
    try:
        for line in (proc / "self" / "status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def address_space_headroom(proc: Path = Path("/proc")) -> int | None:
    """``RLIMIT_AS`` less the current ``VmSize``; None when address space is unlimited."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft == resource.RLIM_INFINITY:
            return None
    except (ImportError, OSError, ValueError):
        return None
    vm = _status_kib(proc, "VmSize")
    return max(0, soft - (vm or 0) * 1024)


def available_memory(proc: Path = Path("/proc")) -> int | None:
    """``MemAvailable`` from /proc/meminfo, in bytes."""
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def headroom(max_memory: int | None = None, *, proc: Path = Path("/proc"),
             cgroup_root: Path = Path("/sys/fs/cgroup")) -> Headroom:
    """What a request may allocate: ``max_memory`` when given, else the least of the machine's limits."""
    if max_memory is not None:
        return Headroom(max_memory, "--max-memory")
    found = [(cgroup_headroom(proc, cgroup_root), "cgroup memory limit less usage"),
             (address_space_headroom(proc), "RLIMIT_AS less VmSize"),
             (available_memory(proc), "MemAvailable")]
    known = [(n, src) for n, src in found if n is not None]
    if not known:
        return Headroom(None, "no memory limit readable")
    n, src = min(known)
    return Headroom(n, src)


# --- estimates -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """Peak memory a request is expected to add, by part, and how many score-grid entries it computes."""

    what: str
    parts: tuple[tuple[str, int], ...]
    grid_entries: int = 0

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.parts)

    def largest(self) -> str:
        name, n = max(self.parts, key=lambda p: p[1])
        return f"{name} {format_bytes(n)}"


def require_fits(estimate: Estimate, max_memory: int | None = None, **where: Any) -> Headroom:
    """Refuse (exit 2) a request whose estimate exceeds the headroom; return the headroom otherwise.

    Raises:
        ResourceError: one line naming the estimate, its largest part and the headroom.
    """
    room = headroom(max_memory, **where)
    if room.bytes is not None and estimate.bytes > room.bytes:
        raise ResourceError(
            f"memory: {estimate.what} needs about {format_bytes(estimate.bytes)} (largest part: {estimate.largest()}), "
            f"expected at most the {format_bytes(room.bytes)} available ({room.source}); use smaller sizes"
            + ("" if max_memory is not None else " or state a budget with --max-memory"),
            needed=estimate.bytes, available=room.bytes,
        )
    return room


def announcement(estimate: Estimate, room: Headroom) -> str | None:
    """One line to print before a large request starts, or None for a small one."""
    if estimate.grid_entries < ANNOUNCE_GRID and estimate.bytes < ANNOUNCE_BYTES:
        return None
    room_text = "" if room.bytes is None else f" of {format_bytes(room.bytes)} available"
    return (f"estimate: {estimate.what} needs about {format_bytes(estimate.bytes)}{room_text}"
            f" and computes {estimate.grid_entries:.3g} score-grid entries; progress follows")
