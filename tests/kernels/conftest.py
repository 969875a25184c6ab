"""Fixtures shared by the C++ op tests: the ops built, and each screen rule run both ways."""

from __future__ import annotations

import pytest

from kernels import cpu_ops


@pytest.fixture(scope="module")
def cpu_ops_built() -> None:
    """Fails (not skips) the module's tests when the C++ ops do not build here."""
    if not cpu_ops.load():
        pytest.fail(f"tolk's C++ ops did not build: {cpu_ops.error()}")


@pytest.fixture(params=["cpp", "torch"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The C++ ops, then the portable torch versions of the same rules (`cpu_ops.LOADED` off:
    every wrapper takes its torch reference)."""
    if request.param == "torch":
        monkeypatch.setattr(cpu_ops, "LOADED", False)
    return str(request.param)
