"""Torch's CPU thread pools and the engine thread: one OpenMP pool at a time.

PyTorch's CPU kernels parallelize with OpenMP (libgomp in the Linux wheels). libgomp keeps one
pool of worker threads *per thread that calls into it*, and the pools outlive their work: the
main thread that loaded the model and warmed the prefix cache keeps its pool after handing the
model to the engine thread. Once the pools together hold more threads than there are CPUs,
libgomp stops spinning at its barriers and sleeps on futexes instead ("throttled spin"), so
every parallel op pays a wake-up. Measured on the 2-core machine (torch 2.11): a float32
linear 8x576 @ 576x1536 takes 94 us on a fresh thread and 188 us on the engine thread once the
main thread had run torch work; the whole engine served 35% fewer requests per second from its
own thread than from the main thread.

The rule that avoids it: a thread that ran torch work on the engine's behalf (loading, warm-up,
a synchronous `generate`) releases its pool when it is done (`release_openmp_pool`, the OpenMP 5
`omp_pause_resource_all` on the calling thread's pool), and the engine thread sets its own
intra-op thread count when it starts (the count is per thread in OpenMP). Other runtimes (Intel
OpenMP, no OpenMP, CUDA-only work) make both a no-op. Nothing here imports the rest of tolk.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from functools import cache

import torch

__all__ = ["release_openmp_pool", "use_threads"]

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime usable


@cache
def _libgomps() -> tuple[ctypes.CDLL, ...]:
    """Every libgomp this process has loaded, torch's bundled copy first.

    There may be more than one: scikit-learn's wheel vendors its own (`scikit_learn.libs/
    libgomp-<hash>.so`), loaded in the worker by the libraries that import it. Each keeps its
    own pools; torch's kernels use torch's. (Taking the first path in sorted order once picked
    scikit-learn's, so the worker's start-up pool was never released and its decode steps ran
    at half speed behind libgomp's throttled barriers: issue #25, docs/BENCHMARKS.md.)"""
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__))
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line}
    except OSError:
        return ()
    libs = []
    for path in sorted(paths, key=lambda p: (not os.path.realpath(p).startswith(torch_dir), p)):
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        libs.append(lib)
    return tuple(libs)


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker threads (recreated on its next parallel op), in
    every libgomp loaded (torch's and any other library's).

    Returns True when torch's libgomp (the first) released its pool. Call it on a thread that
    has finished its torch work before another thread (the engine loop) takes over.
    """
    libs = _libgomps()
    if not libs:
        return False
    codes = [lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) for lib in libs]
    if codes[0] != 0:  # inside a parallel region: not ours to free
        log.debug(
            "omp_pause_resource_all on %s returned %d", threading.current_thread().name, codes[0]
        )
    return codes[0] == 0


def use_threads(n: int) -> None:
    """Set the calling thread's intra-op thread count (OpenMP's count is per thread)."""
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
