"""Allocator settings for a process that runs the ledger.

The ledger streams the score grid in blocks of a few MiB, so it allocates and frees
buffers of that size many times per run. With glibc's default policy, freed memory
at the top of the heap is handed back to the kernel as soon as more than a few MiB
are free, and the next block's buffers are faulted in and zeroed again page by page.
At (1, 8, 512, 64) that is over a thousand page faults per call and a large share
of the run time.

:func:`retain_freed_memory` raises glibc's trim and mmap thresholds, so freed blocks
stay in the process for the next one. It changes process-wide state, so the library
never calls it by itself: the ``attn-ledger`` command calls it for its own process,
and library users may call it once at start-up. It has no effect (and returns False)
where the C library is not glibc.
"""

from __future__ import annotations

import sys

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
TRIM_BYTES = 256 << 20  # free memory kept at the top of the heap before any is returned
MMAP_BYTES = 32 << 20  # allocations below this come from the heap (32 MiB is glibc's largest)

_applied: bool | None = None


def retain_freed_memory(trim_bytes: int = TRIM_BYTES, mmap_bytes: int = MMAP_BYTES) -> bool:
    """Keep up to ``trim_bytes`` of freed heap memory, and serve allocations below ``mmap_bytes`` from the heap.

    Returns True when glibc accepted both settings. Idempotent; safe to call on any platform.
    """
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, for one, has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = mallopt(M_MMAP_THRESHOLD, int(mmap_bytes)) == 1 and mallopt(M_TRIM_THRESHOLD, int(trim_bytes)) == 1
    return _applied
