"""The suite's own parallel run (tests/conftest.py): who shares an xdist worker, how many
torch threads each worker takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TESTS_DIR, serial_group, worker_threads


@pytest.mark.parametrize(
    ("path", "fixtures", "group"),
    [
        ("kernels/test_triton_attention.py", (), "triton-interpreter"),
        ("kernels/test_triton_swaps.py", (), "triton-interpreter"),
        ("faults/test_scale_out.py", ("stack_up", "fault_stack"), "fault-stack"),
        ("compose/test_stack_security.py", ("secure_stack",), "secure-stack"),
        ("workers/test_store_outage.py", ("private_redis",), "private-redis"),
        ("workers/test_cache_outage.py", (), "private-redis"),
        ("compose/test_stack_redis_bounded.py", (), "private-redis"),
        # on the shared broker with topics of its own: free to run beside anything
        ("faults/test_rollout_real_workers.py", ("kafka_bootstrap",), None),
        ("kernels/test_attention.py", (), None),
        ("workers/test_worker_kafka.py", ("kafka_bootstrap", "redis_url"), None),
    ],
)
def test_serial_groups(path: str, fixtures: tuple[str, ...], group: str | None) -> None:
    assert serial_group(TESTS_DIR / path, fixtures) == group


def test_a_path_outside_the_tests_has_no_group(tmp_path: Path) -> None:
    assert serial_group(tmp_path / "test_x.py") is None


def test_the_collected_tests_carry_their_group(request: pytest.FixtureRequest) -> None:
    """What this session collected: every test of a group has the mark xdist reads."""
    for item in request.session.items:
        group = serial_group(Path(item.path), item.fixturenames)  # type: ignore[attr-defined]
        mark = item.get_closest_marker("xdist_group")
        assert (mark.args[0] if mark else None) == group, item.nodeid


@pytest.mark.parametrize(
    ("cpus", "workers", "threads"), [(2, 2, 1), (2, 1, 2), (16, 2, 8), (2, 3, 1), (None, 2, 1)]
)
def test_worker_threads_share_the_cpus(cpus: int | None, workers: int, threads: int) -> None:
    assert worker_threads(cpus, workers) == threads
