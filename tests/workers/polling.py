"""`wait_for`: poll a condition until it holds or a timeout fails the test."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(
    pred: Callable[[], bool], timeout: float = 10.0, what: str = "", interval: float = 0.02
) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what or pred}")
