"""Transparent huge pages for large host buffers that fill as they are used: the CPU's KV pool and the host tier.

Such a buffer comes from calloc as untouched pages, so a pool costs nothing until its slots are written, and
then every 4 KiB page faults once. Where a fault is expensive that is most of a first step's time: in the
developers' VM (Firecracker, free pages reported back to the host) a fault cost 4-10 us, and a fresh process's
433-token step on the default model spent ~220 ms of its ~420 in `set_kv`. Advised as huge pages, the kernel
maps 2 MiB at a fault (100 MiB faulted in ~13 ms against 95-260 ms a page at a time, measured there); where
transparent huge pages are off or the kernel ignores the advice, nothing changes.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import numpy as np

logger = logging.getLogger(__name__)

_MADV_HUGEPAGE = 14  # madvise's advice number (linux/mman.h)
HUGE_PAGE = 2 << 20  # x86-64's and arm64's (4 KiB granule) transparent huge page


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _madvise()


def advise_huge_pages(array: np.ndarray) -> int:
    """Ask for huge pages over the whole 2 MiB pages inside `array`'s memory (before it is first written);
    returns the bytes advised (0 where the buffer holds no whole huge page or madvise is unavailable)."""
    if _MADVISE is None:
        return 0
    start = array.ctypes.data
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    length = (start + array.nbytes - first) // HUGE_PAGE * HUGE_PAGE
    if length <= 0:
        return 0
    if _MADVISE(first, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d)", ctypes.get_errno())
        return 0
    return length
