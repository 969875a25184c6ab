"""The load test's Kafka side: the project's `TranslationClient` on an asyncio loop of its own.

Locust runs its users as gevent greenlets on the main thread; the client is asyncio and polls
confluent-kafka on a background thread. `KafkaBridge` keeps them apart: it owns one real thread
running an event loop with one started `TranslationClient`, and

* `send(lang, text, scheduled_at)` (any thread, returns at once) starts one `translate()` task
  on that loop: the user never waits for a reply, so the arrival rate stays what the schedule
  says however slow the worker is (open loop);
* each task measures its latency from the *scheduled* send time (`time.monotonic()` of the
  user's timer), not from when the send actually started, so a late send counts against the
  service (measuring from the actual send would hide the wait: coordinated omission); the lag
  itself is kept as
  `send_lag_s`;
* finished requests (a reply of any status, a timeout, a request never delivered) are
  appended to a deque that `drain()` empties from the greenlet side: deque append/popleft
  are atomic, so no lock and no gevent primitive crosses threads.

The client waits for a reply up to `timeout_s` after the send; the request carries
`deadline_s` (the worker answers EXPIRED past it).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from workers.client import (
    TranslationClient,
    TranslationError,
    TranslationNotDelivered,
    TranslationTimeout,
)

__all__ = ["Completion", "KafkaBridge"]


@dataclass(frozen=True, slots=True)
class Completion:
    lang: str  # target language (the request topic)
    request_id: str  # the client's request id ("" only when the client was already closed)
    status: str  # OK / ERROR / REJECTED / EXPIRED (the reply's), TIMEOUT, NOT_DELIVERED
    scheduled_at: float  # epoch seconds of the scheduled send
    latency_s: float  # scheduled send -> reply received (or -> the failure)
    send_lag_s: float  # how late the send started after its scheduled time
    tokens_out: int
    reply_chars: int
    error: str | None
    decode_s: float | None = None  # the reply's `timings.decode_ms` (TTFT = latency - decode)
    # The reply's timings in seconds (queue, prefill, decode, total: the worker's view from the
    # request's timestamp to its reply); empty when no reply came.
    worker_s: Mapping[str, float] = field(default_factory=dict)
    withheld: bool = False  # an ERROR reply whose answer the faithfulness checks withheld


class KafkaBridge:
    """One `TranslationClient` on a dedicated event-loop thread; see the module notes."""

    def __init__(
        self,
        bootstrap: str,
        *,
        topic_prefix: str = "",
        kafka_config: Mapping[str, Any] | None = None,
        deadline_s: float | None = 30.0,
        timeout_s: float = 35.0,
        client_factory: Callable[[], TranslationClient] | None = None,
    ) -> None:
        self.deadline_s = deadline_s
        self.timeout_s = timeout_s
        self._make_client = client_factory or (
            lambda: TranslationClient(
                bootstrap,
                topic_prefix=topic_prefix,
                kafka_config=kafka_config,
                default_timeout=timeout_s,
            )
        )
        self._client: TranslationClient | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="tolk-load-kafka", daemon=True)
        self._done: deque[Completion] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        # sent and not finished: counted when `send` is called, so a `close` right after the
        # last send waits for it (it is spawned on the loop thread a moment later)
        self._outstanding = 0
        self._count_lock = threading.Lock()
        self.sent = 0

    # -- lifecycle ----------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def start(self, timeout_s: float = 60.0) -> None:
        """Start the loop thread and the client (joins the reply topic); raises
        `TranslationError` when the client cannot start."""
        self._thread.start()
        self._client = self._make_client()
        future: Future[None] = asyncio.run_coroutine_threadsafe(self._client.start(), self._loop)
        future.result(timeout_s)

    def close(self, wait_s: float = 0.0) -> None:
        """Wait up to `wait_s` for requests still out (their replies are drained later), then
        close the client and stop the loop."""
        end = time.monotonic() + wait_s
        while self._outstanding and time.monotonic() < end:
            time.sleep(0.02)
        if self._client is not None:
            client = self._client
            self._client = None
            asyncio.run_coroutine_threadsafe(client.close(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- requests -----------------------------------------------------------------------------

    @property
    def outstanding(self) -> int:
        return self._outstanding

    def send(self, lang: str, source_lang: str, text: str, scheduled_at: float) -> None:
        """Start one request (from any thread); `scheduled_at` is a `time.monotonic()` value."""
        with self._count_lock:
            self.sent += 1
            self._outstanding += 1
        self._loop.call_soon_threadsafe(self._spawn, lang, source_lang, text, scheduled_at)

    def drain(self) -> list[Completion]:
        """The requests finished since the last call (any thread)."""
        out: list[Completion] = []
        while True:
            try:
                out.append(self._done.popleft())
            except IndexError:
                return out

    def _spawn(self, lang: str, source_lang: str, text: str, scheduled_at: float) -> None:
        task = self._loop.create_task(self._one(lang, source_lang, text, scheduled_at))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _one(self, lang: str, source_lang: str, text: str, scheduled_at: float) -> None:
        client = self._client
        wall_at = time.time() - (time.monotonic() - scheduled_at)
        lag = max(0.0, time.monotonic() - scheduled_at)
        rid, status, error, tokens, chars = "", "ERROR", None, 0, 0
        decode_s: float | None = None
        worker_s: dict[str, float] = {}
        withheld = False
        try:
            if client is None:
                raise TranslationError("load test client closed")
            reply = await client.translate(
                text,
                to=lang,
                src=source_lang,
                deadline=self.deadline_s,
                timeout=self.timeout_s,
                raise_on_error=False,
            )
            rid, status, error = reply.request_id, reply.status, reply.error
            tokens, chars = reply.tokens_out, len(reply.text)
            if "decode_ms" in reply.timings:
                decode_s = reply.timings["decode_ms"] / 1e3
            worker_s = {
                k.removesuffix("_ms"): float(v) / 1e3
                for k, v in reply.timings.items()
                if k.endswith("_ms")
            }
            withheld = reply.withheld is not None
        except TranslationTimeout as exc:
            rid, status, error = exc.request_id, "TIMEOUT", str(exc)
        except TranslationNotDelivered as exc:
            rid, status, error = exc.request_id, "NOT_DELIVERED", str(exc)
        except TranslationError as exc:
            status, error = "ERROR", str(exc)
        finally:
            with self._count_lock:
                self._outstanding -= 1
        self._done.append(
            Completion(
                lang=lang,
                request_id=rid,
                status=status,
                scheduled_at=wall_at,
                latency_s=time.monotonic() - scheduled_at,
                send_lag_s=lag,
                tokens_out=tokens,
                reply_chars=chars,
                error=error,
                decode_s=decode_s,
                worker_s=worker_s,
                withheld=withheld,
            )
        )
