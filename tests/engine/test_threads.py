"""The engine thread's OpenMP hygiene (workers/engine/threads.py)."""

from __future__ import annotations

import threading

import torch

from workers.engine.threads import release_openmp_pool, use_threads


def test_release_frees_the_pool_and_torch_still_computes() -> None:
    a = torch.randn(64, 96)
    b = torch.randn(96, 128)
    expected = a @ b  # runs a parallel region: this thread now owns an OpenMP pool
    assert release_openmp_pool() is True  # torch's Linux wheels bundle libgomp
    torch.testing.assert_close(a @ b, expected)  # the pool comes back on the next op
    assert release_openmp_pool() is True


def test_use_threads_sets_the_calling_threads_count_only() -> None:
    main_before = torch.get_num_threads()
    seen: list[int] = []

    def body() -> None:
        use_threads(1)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [1]
    assert torch.get_num_threads() == main_before
