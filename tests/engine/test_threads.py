"""The engine thread's OpenMP hygiene (workers/engine/threads.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from workers.engine.threads import release_openmp_pool, use_threads


def test_release_frees_the_pool_and_torch_still_computes() -> None:
    a = torch.randn(64, 96)
    b = torch.randn(96, 128)
    expected = a @ b  # runs a parallel region: this thread now owns an OpenMP pool
    assert release_openmp_pool() is True  # torch's Linux wheels bundle libgomp
    torch.testing.assert_close(a @ b, expected)  # the pool comes back on the next op
    assert release_openmp_pool() is True


# A child process: which libgomps are loaded, and which pools exist, depends on what the test
# process imported before. scikit-learn (sentence-transformers imports it; so does the worker)
# vendors a second libgomp; it is loaded first here, as in the worker.
_POOL_CHILD = textwrap.dedent(
    """
    import os, sys, time
    try:
        import sklearn.cluster  # noqa: F401  (loads scikit-learn's own libgomp)
    except ImportError:
        pass
    import torch
    from workers.engine.threads import _libgomps, release_openmp_pool

    torch.set_num_threads(2)
    def threads():
        return len(os.listdir("/proc/self/task"))
    x = torch.randn(2_000_000)
    x.sum()  # a parallel region: torch's pool gets its worker thread
    with_pool = threads()
    assert release_openmp_pool() is True
    # the paused pool's worker exits on its own thread, soon after the call returns (a CI run
    # under load still listed it once): wait up to 5 s for it to go
    end = time.monotonic() + 5
    while threads() >= with_pool and time.monotonic() < end:
        time.sleep(0.01)
    print(len(_libgomps()), with_pool, threads())
    """
)


def test_release_frees_torchs_pool_even_beside_another_libgomp() -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one CPU: torch makes no pool")
    done = subprocess.run(
        [sys.executable, "-c", _POOL_CHILD], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    libs, with_pool, after = map(int, done.stdout.split())
    assert libs >= 1
    assert after == with_pool - 1  # torch's pool worker is gone (it was not, with two libgomps)


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


@pytest.mark.parametrize("release", [True, False])
def test_an_engine_set_to_release_its_pool_does_so_each_time_it_runs_out_of_work(
    release: bool, tiny_config: object, tiny_models: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EngineConfig.release_pool_when_idle` (the cascade's large model): the loop thread frees
    its OpenMP pool when it goes idle, once per idle spell, and serves on when work comes."""
    import time

    from workers.engine import engine as engine_module
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.types import GenerationRequest, SamplingParams

    _hf, loaded = tiny_models(tiny_config("qwen2"))  # type: ignore[operator]
    config = EngineConfig(kv_cache_tokens=1024, block_size=4, release_pool_when_idle=release)
    engine = Engine(loaded, config)
    calls: list[str] = []
    real = engine_module.release_openmp_pool

    def counted() -> bool:
        calls.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(engine_module, "release_openmp_pool", counted)
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        for burst in range(2):
            handle = engine.submit(GenerationRequest(f"r{burst}", list(range(10, 30)), params))
            assert handle.result(timeout=60).ok
            time.sleep(0.3)  # idle spells: the loop waits in 50 ms naps
    finally:
        engine.stop()
    from_loop = [name for name in calls if name == "tolk-engine"]
    assert len(from_loop) == (3 if release else 0)  # idle at start, after each burst


def test_an_engine_yielding_to_another_takes_no_step_while_that_one_is_busy(
    tiny_config: object, tiny_models: object
) -> None:
    """`Engine.yields_to` (the cascade's large model yields to its small one): while it says
    busy, the loop steps no request of its own, none is lost; once it says idle, they run."""
    import time

    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.types import GenerationRequest, SamplingParams

    _hf, loaded = tiny_models(tiny_config("qwen2"))  # type: ignore[operator]
    engine = Engine(loaded, EngineConfig(kv_cache_tokens=1024, block_size=4))
    other_busy = threading.Event()
    other_busy.set()
    engine.yields_to = other_busy.is_set
    engine.start()
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        handles = [
            engine.submit(GenerationRequest(f"r{i}", list(range(10 + i, 30)), params))
            for i in range(2)
        ]
        time.sleep(0.4)
        assert not any(h.done() for h in handles) and engine.stats.steps == 0
        assert engine.loop_heartbeat is not None  # the loop comes round while it yields
        other_busy.clear()
        assert all(h.result(timeout=60).ok for h in handles)
        assert engine.stats.steps > 0
    finally:
        engine.stop()
