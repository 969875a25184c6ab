"""`HandleWitness`: wraps a Kafka handle (real or fake) and records how threads use it.

librdkafka (and confluent-kafka-python, whose `close()` destroys the handle with the GIL
released) allows no call on a handle during or after its `close()`: a `consume()` still running
on another thread keeps using the freed queue (issue 26). The witness records, for each
`close()`, the calls other threads were inside at that moment (`closed_during`), which thread
closed it (`close_threads`), and every call made after the close (`calls_after_close`).
"""

from __future__ import annotations

import threading
from typing import Any


class HandleWitness:
    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()
        self._active: dict[int, list[str]] = {}  # thread ident -> the calls it is inside
        self._closed = False
        self.closed_during: list[str] = []  # calls of other threads running when close() came
        self.close_threads: list[str] = []  # names of the threads that called close()
        self.calls_after_close: list[str] = []

    @property
    def inner(self) -> Any:
        return self._inner

    def in_call(self, name: str) -> bool:
        """True while some thread is inside `name`."""
        with self._lock:
            return any(name in calls for calls in self._active.values())

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            me = threading.get_ident()
            with self._lock:
                if name == "close":
                    self.close_threads.append(threading.current_thread().name)
                    self.closed_during.extend(
                        c for t, calls in self._active.items() if t != me for c in calls
                    )
                elif self._closed:
                    self.calls_after_close.append(name)
                self._active.setdefault(me, []).append(name)
            try:
                return attr(*args, **kwargs)
            finally:
                with self._lock:
                    calls = self._active[me]
                    calls.remove(name)
                    if not calls:
                        del self._active[me]
                    if name == "close":
                        self._closed = True

        return call
