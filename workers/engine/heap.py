"""Memory that freed engines leave behind: `trim_heap()`.

The probe builds an engine per candidate (each with its own weights: ~1-2 GB for Gemma 3 270M
in float32, several times that for a 1.5B model) and drops them when it has measured; a switch
of configuration drops the old engine's model side. Python frees the tensors, but glibc's
allocator keeps the freed pages in its arenas, so the worker's resident memory stayed at the
probe's peak (measured: 11.3 GB for Gemma 3 270M after a first-start probe, 0.8 GB of it
live). `malloc_trim(0)` hands the free pages back to the system. Where the C library has no
`malloc_trim` (musl, macOS) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
from typing import Any

__all__ = ["trim_heap"]

log = logging.getLogger(__name__)


def trim_heap() -> bool:
    """Collect garbage, then return the allocator's free pages to the system; whether the C
    library could."""
    gc.collect()
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))


@functools.cache
def _malloc_trim() -> Any:
    """libc's `malloc_trim`, looked up once (`find_library` runs ldconfig); None without it."""
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    return trim
