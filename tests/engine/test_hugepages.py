"""to_huge_pages: same values in one 2 MiB-aligned buffer (whether the kernel grants huge pages
is the system's call: /sys/kernel/mm/transparent_hugepage/enabled)."""

from __future__ import annotations

import sys

import pytest
import torch

from workers.engine.hugepages import HUGE_PAGE, to_huge_pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux-only here")
def test_tensors_are_copied_into_one_aligned_buffer() -> None:
    tensors = [torch.randn(3, 5), torch.randint(-127, 127, (1000, 77), dtype=torch.int8),
               torch.arange(10, dtype=torch.int64)]  # fmt: skip
    moved = to_huge_pages(tensors)
    for before, after in zip(tensors, moved, strict=True):
        assert after.dtype == before.dtype and after.shape == before.shape
        assert torch.equal(after, before) and after.data_ptr() != before.data_ptr()
        assert after.data_ptr() % 64 == 0
    assert moved[0].data_ptr() % HUGE_PAGE == 0
    storages = {t.untyped_storage().data_ptr() for t in moved}
    assert len(storages) == 1  # one buffer
    original = int(tensors[1][0, 0])
    moved[1][0, 0] = 0 if original else 1  # copies: writes do not reach the originals
    assert int(tensors[1][0, 0]) == original


def test_empty_and_non_cpu_inputs_come_back_unchanged() -> None:
    assert to_huge_pages([]) == []
    meta = torch.empty(4, device="meta")
    assert to_huge_pages([meta])[0] is meta


def test_zeros_are_zero_and_aligned() -> None:
    from workers.engine.hugepages import zeros

    pool = zeros((5, 16, 3, 64), dtype=torch.float32, device="cpu")
    assert pool.shape == (5, 16, 3, 64) and pool.dtype == torch.float32
    assert not pool.any()
    if sys.platform.startswith("linux"):
        assert pool.data_ptr() % HUGE_PAGE == 0
