"""`RetryJob`: one request of a serving stage that may run it a second time.

Three stages answer a request from one or two runs of the stages inside them: faithfulness
(a suspect answer is asked again in the retry prompt form, `~faithful`), span protection (a
masked answer that does not restore is asked again unmasked, `~unmasked`) and conversation
context (an answer that copies the history is asked again without it, `~nohistory`). What they
share is here, once:

* the caller's handle, whose cancel reaches the run now in flight (the first, or the rerun
  once it was submitted);
* `rerun`: the same request under `<request id><suffix>`, with the stage's changes and without
  the conversation's history (a rerun never had it: the history once waited under the first
  run's request id, workers/stages/context/stage.py), its submit refused with the engine's own
  exception (the stage answers what it has), a cancel that raced with that submit passed on
  to the new run;
* `rerun_ended`: the ends of a rerun that every stage treats alike: cancelled (the caller
  gets CANCELLED with the work of both runs) or failed (the stage answers from the first run,
  counted as rerun);
* `resolve`: the caller's handle set, under the caller's request id.

What a stage does with each run's result (check, restore, merge, note, count) stays in the
stage. Callbacks run on the engine's thread; this holds one lock for a few assignments.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from workers.engine.types import (
    FinishReason,
    GenerationResult,
    RequestHandle,
    TranslationRequest,
)
from workers.stages.wrapper import merged_runs

__all__ = ["RetryJob"]


class RetryJob:
    """One request of a stage: its first run, its reruns one at a time (a stage's one retry;
    the cascade's large run and, should that fail after an early stop, the small one again),
    and the caller's handle."""

    def __init__(self, request: TranslationRequest, state: Any = None) -> None:
        """`state`: what the stage keeps about the request (its checks, its masked text)."""
        self.request = request
        self.state = state
        self.handle = RequestHandle(request.request_id, lambda _rid: self.cancel())
        self._lock = threading.Lock()
        self._inner: RequestHandle | None = None
        self._cancelled = False

    @property
    def cancelled(self) -> bool:
        """The caller cancelled: no rerun starts after that."""
        with self._lock:
            return self._cancelled

    def run(
        self,
        engine: Any,
        on_done: Callable[[GenerationResult], None],
        request: TranslationRequest | None = None,
    ) -> None:
        """Submit `request` (default: the caller's) to `engine`, `on_done` with its result;
        a refused submit raises (the stage decides what that means)."""
        inner = engine.submit_translation(request if request is not None else self.request)
        with self._lock:
            self._inner = inner
            cancel_now = self._cancelled  # cancel() raced with the submit above
        inner.add_done_callback(on_done)
        if cancel_now:
            inner.cancel()

    def rerun(
        self,
        engine: Any,
        suffix: str,
        on_done: Callable[[GenerationResult], None],
        **changes: Any,
    ) -> None:
        """Run the request again under `<request id><suffix>`, with `changes` and without
        history (module notes); a refused submit raises."""
        again = dataclasses.replace(
            self.request,
            request_id=self.request.request_id + suffix,
            history=(),
            **changes,
        )
        self.run(engine, on_done, again)

    def rerun_ended(
        self,
        first: GenerationResult,
        second: GenerationResult,
        on_failed: Callable[[GenerationResult, str], None],
    ) -> bool:
        """Settle a rerun that was cancelled (answer CANCELLED, both runs' work) or failed
        (`on_failed(first counted as rerun, why)`); False when it answered (the stage's part)."""
        if second.finish_reason is FinishReason.CANCELLED:
            self.resolve(merged_runs(first, second, self.request.request_id))
            return True
        if not second.ok:
            why = f"finished {second.finish_reason.value}: {second.error}"
            on_failed(dataclasses.replace(first, retries=first.retries + 1), why)
            return True
        return False

    def resolve(self, result: GenerationResult) -> None:
        """Answer the caller, under its own request id."""
        self.handle.set_result(dataclasses.replace(result, request_id=self.request.request_id))

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            inner = self._inner
        if inner is not None:
            inner.cancel()
