"""glibc's allocator, tuned for a worker whose model states are large arrays replaced at every fold-in
(nothing where there is no glibc)."""

from __future__ import annotations

import ctypes
import time

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's mallopt parameter numbers."""
MMAP_THRESHOLD = 16 * 2**20
"""Allocations of this size and more (the model state's large arrays) are mmapped and returned to the
system when freed (`tune_allocator`)."""
TRIM_THRESHOLD = 64 * 2**20
"""Free memory at the top of the heap that glibc keeps on a free rather than handing back. Fixing the mmap
threshold turns glibc's dynamic adjustment off, and its 128 KiB default then made requests shrink and
regrow the heap: /recommend without a cached row took twice as long (benchmarks/serve.py floor). A
/recommend over the synthetic Epinions catalogue (139,738 items) holds 16 to 64 MiB of temporaries: at
16 MiB the heap was handed back and refaulted on every request (53 ms per request instead of 38, timed
in process). A fold-in's `release_memory` hands the rest back."""


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def tune_allocator() -> None:
    """Fix glibc's mmap and trim thresholds (MMAP_THRESHOLD, TRIM_THRESHOLD). Each online rating builds a
    new model state of large arrays and drops the last one; with glibc's defaults the mmap threshold rises
    to the largest array freed, such arrays then come from the heap, and a worker's memory grew with the
    ratings it folded in (benchmarks/serve.py soak; docs/online.md). Nothing where there is no glibc."""
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)  # fixing one turns glibc's dynamic adjustment off


RELEASE_INTERVAL_S = 1.0
"""Least time between two trims of the heap (`release_memory`). A trim walks the heap and the pages it
hands back fault in again at the next fold-in: once per fold-in it took 18% of a worker's fold-in time
under 100 ratings/s (py-spy, ML-100K default artifact); once a second bounds the memory all the same."""

_last_release = 0.0


def release_memory() -> None:
    """Hand the heap's free pages back to the system after a model state was replaced (glibc's
    malloc_trim; nothing elsewhere), at most once per RELEASE_INTERVAL_S."""
    global _last_release
    now = time.monotonic()
    if now - _last_release < RELEASE_INTERVAL_S:
        return
    _last_release = now
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


_LIBC = _libc()
