"""Large CPU tensors on transparent huge pages (Linux `madvise(MADV_HUGEPAGE)`).

Batch-1 decode streams every weight once per token and reads the KV cache by slot. With 4 KiB
pages a 135 MB int8 model spans ~33,000 pages, far past the TLB's reach, so reads stall on page
walks. Most kernels set transparent huge pages to `madvise` (the default here), so an allocation
only gets 2 MiB pages when asked. `to_huge_pages(tensors)` copies a group of CPU tensors into one
2 MiB-aligned buffer advised for huge pages before its first touch and returns views into it
(same shapes and dtypes; the originals can then be dropped); `zeros` allocates a fresh zeroed
tensor the same way (the KV pools, with no first copy in 4 KiB pages). Measured on SmolLM2 int8
at batch 1 (2 cores): the step's int8 projections 39 -> 34 us a call. Anywhere else (not Linux,
not CPU, no libc) the tensors come back unchanged and `zeros` is `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_ALIGN = 64  # each tensor starts on a cache line


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def _advised_views(specs: Sequence[tuple[torch.Size, torch.dtype]]) -> list[Tensor] | None:
    """Uninitialized CPU tensors of these shapes/dtypes in one 2 MiB-aligned buffer, advised
    for huge pages before anything touches it; None where madvise is not available."""
    libc = _libc()
    if libc is None:
        return None
    nbytes = [shape.numel() * dtype.itemsize for shape, dtype in specs]
    sizes = [(n + _ALIGN - 1) // _ALIGN * _ALIGN for n in nbytes]
    total = sum(sizes)
    raw = torch.empty(total + HUGE_PAGE, dtype=torch.uint8)  # not touched yet
    start = -raw.data_ptr() % HUGE_PAGE
    length = min((total + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, raw.numel() - start)
    rc = libc.madvise(ctypes.c_void_p(raw.data_ptr() + start), ctypes.c_size_t(length),
                      _MADV_HUGEPAGE)  # fmt: skip
    if rc != 0:
        log.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    views, offset = [], start
    for (shape, dtype), n, size in zip(specs, nbytes, sizes, strict=True):
        views.append(raw[offset : offset + n].view(dtype).view(shape))
        offset += size
    return views


def to_huge_pages(tensors: Sequence[Tensor]) -> list[Tensor]:
    """Copies of `tensors` (CPU) packed into one huge-page-advised buffer; unchanged on failure."""
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return list(tensors)
    views = _advised_views([(t.shape, t.dtype) for t in tensors])
    if views is None:
        return list(tensors)
    for view, t in zip(views, tensors, strict=True):
        view.copy_(t)
    return views


def zeros(shape: Sequence[int], *, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """`torch.zeros` whose CPU memory is advised for huge pages before it is first written (the
    KV pools: `workers.engine.prepare.PreparedModel.allocate_kv_pools`)."""
    if torch.device(device).type == "cpu":
        views = _advised_views([(torch.Size(shape), dtype)])
        if views is not None:
            return views[0].zero_()
    return torch.zeros(tuple(shape), dtype=dtype, device=device)
