"""workers/stages/protected/stage.py around tests/workers/fakes.py's FakeEngine: masked and
restored,
retried unmasked, flagged; notes on the result, outcomes counted, the reply's metadata."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from schemas.wire import WireRequest, read_result, write_result
from tests.workers.fakes import FakeEngine, fake_translation
from workers.engine.types import FinishReason, GenerationResult, RequestHandle, TranslationRequest
from workers.kafka.records import ConsumedRecord, InFlight
from workers.kafka.replies import engine_reply
from workers.metrics import WorkerMetrics
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.protected.stage import NOTE_KEY, RETRY_SUFFIX, ProtectedSpansEngine
from workers.text.spans import DEFAULT_STYLE

TEXT = "Order A-12345 arrives at 8:30"


class RewritingEngine(FakeEngine):
    """A FakeEngine whose masked translations (text with a mask token) go through `rewrite`
    first, the way a model may drop, repeat or break a token; unmasked texts as FakeEngine.
    `unmasked_rewrite` does the same to unmasked texts (a model that garbles a span)."""

    def __init__(
        self,
        rewrite: Callable[[str], str] = lambda t: t,
        unmasked_rewrite: Callable[[str], str] = lambda t: t,
        **kwargs: object,
    ) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rewrite = rewrite
        self.unmasked_rewrite = unmasked_rewrite
        self.texts: list[str] = []  # every text submitted, in order

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        text = request.text
        self.texts.append(text)
        masked = DEFAULT_STYLE.token(1) in text
        rewritten = self.rewrite(text) if masked else self.unmasked_rewrite(text)
        return super().submit_translation(dataclasses.replace(request, text=rewritten))


@pytest.fixture
def make_engine() -> Iterator[Callable[..., tuple[ProtectedSpansEngine, RewritingEngine]]]:
    started: list[FakeEngine] = []

    def make(**kwargs: object) -> tuple[ProtectedSpansEngine, RewritingEngine]:
        inner = RewritingEngine(**kwargs)  # type: ignore[arg-type]
        inner.start()
        started.append(inner)
        return ProtectedSpansEngine(inner), inner

    yield make
    for engine in started:
        engine.stop()


def translate(engine: ProtectedSpansEngine, text: str, request_id: str = "r1", **kw: object):
    handle = engine.submit_translation(TranslationRequest(request_id, text, "en", "de", **kw))  # type: ignore[arg-type]
    return handle.result(timeout=5)


def test_spans_are_masked_and_restored(make_engine) -> None:
    engine, inner = make_engine()
    result = translate(engine, TEXT)
    assert inner.texts == ["Order <x1> arrives at <x2>"]  # the model never saw the spans
    assert result.ok and result.request_id == "r1"
    # FakeEngine reverses the words: the tokens moved and were restored where they went
    assert result.text == "[de] 8:30 at arrives A-12345 Order"
    assert result.notes == {NOTE_KEY: "restored", f"{NOTE_KEY}.spans": "2"}
    assert engine.outcomes == {("de", "restored"): 1}


def test_text_without_spans_passes_through_untouched(make_engine) -> None:
    engine, inner = make_engine()
    result = translate(engine, "Where is my parcel?")
    assert inner.texts == ["Where is my parcel?"]
    assert result.text == fake_translation("Where is my parcel?", "de")
    assert result.notes == {} and not engine.outcomes


@pytest.mark.parametrize(
    ("rewrite", "problem"),
    [
        (lambda t: t.replace("<x2>", ""), "missing 2"),
        (lambda t: t.replace("<x1>", "<x1> <x1>"), "duplicated 1"),
        (lambda t: t.replace("<x2>", "<x2"), "mangled <x2"),
    ],
    ids=["missing", "duplicated", "mangled"],
)
def test_restore_failure_retries_unmasked(make_engine, rewrite, problem: str) -> None:
    engine, inner = make_engine(rewrite=rewrite)
    result = translate(engine, TEXT)
    assert inner.texts == ["Order <x1> arrives at <x2>", TEXT]  # one retry, unmasked
    assert inner.submitted == ["r1", "r1" + RETRY_SUFFIX]
    assert result.ok and result.request_id == "r1"
    assert result.text == fake_translation(TEXT, "de")  # the unmasked translation
    assert result.notes[NOTE_KEY] == "retried_unmasked"
    assert problem in result.notes[f"{NOTE_KEY}.restore_error"]
    assert result.notes[f"{NOTE_KEY}.preserved"] == "2/2"
    assert engine.outcomes == {("de", "retried_unmasked"): 1}
    # the answer carries the work of both runs
    masked_tokens_in = len(rewrite("Order <x1> arrives at <x2>").split()) + 10
    assert result.tokens_in == masked_tokens_in + len(TEXT.split()) + 10


def test_the_conversation_id_goes_to_the_masked_run_and_the_unmasked_retry(make_engine) -> None:
    engine, inner = make_engine(rewrite=lambda t: t.replace("<x2>", ""))
    result = translate(engine, TEXT, conversation_id="conv-5")
    assert result.notes[NOTE_KEY] == "retried_unmasked"
    assert inner.conversations == {"r1": "conv-5", "r1" + RETRY_SUFFIX: "conv-5"}
    translate(engine, "no spans here", request_id="r2", conversation_id="conv-6")
    assert inner.conversations["r2"] == "conv-6"


def test_unmasked_retry_that_loses_a_span_is_flagged(make_engine) -> None:
    engine, _ = make_engine(
        rewrite=lambda t: t.replace("<x2>", ""),
        unmasked_rewrite=lambda t: t.replace("8:30", "8.30"),
    )
    result = translate(engine, TEXT)
    assert result.ok
    assert result.text == fake_translation("Order A-12345 arrives at 8.30", "de")
    assert result.notes[NOTE_KEY] == "flagged"
    assert result.notes[f"{NOTE_KEY}.preserved"] == "1/2"
    assert engine.outcomes == {("de", "flagged"): 1}


def test_retry_that_cannot_finish_answers_the_masked_translation_flagged(make_engine) -> None:
    # The masked run drops a token; the unmasked retry fails (FakeEngine fails "__fail__"
    # texts), so the answer is the masked translation restored as far as it goes.
    engine, _ = make_engine(
        rewrite=lambda t: t.replace("<x2>", ""),
        unmasked_rewrite=lambda t: t + " __fail__",
    )
    result = translate(engine, TEXT)
    assert result.ok and result.finish_reason is FinishReason.STOP
    assert result.text == "[de] at arrives A-12345 Order"
    assert result.notes[NOTE_KEY] == "flagged"
    assert "error" in result.notes[f"{NOTE_KEY}.retry"]
    assert engine.outcomes == {("de", "flagged"): 1}


def test_failed_masked_run_is_passed_on_for_the_worker_to_handle(make_engine) -> None:
    engine, inner = make_engine()
    result = translate(engine, TEXT + " __fail__")
    assert result.finish_reason is FinishReason.ERROR and result.request_id == "r1"
    assert len(inner.texts) == 1 and not engine.outcomes


def test_expired_deadline_is_not_retried(make_engine) -> None:
    engine, inner = make_engine()
    result = translate(engine, TEXT, deadline=time.monotonic() - 1)
    assert result.finish_reason is FinishReason.EXPIRED
    assert len(inner.texts) == 1


def test_cancel_reaches_the_inner_run(make_engine) -> None:
    engine, inner = make_engine()
    inner.hold()
    handle = engine.submit_translation(
        TranslationRequest(request_id="c1", text=TEXT, source_lang="en", target_lang="de")
    )
    handle.cancel()
    result = handle.result(timeout=5)
    assert result.finish_reason is FinishReason.CANCELLED and result.request_id == "c1"


def test_text_with_mask_like_tokens_is_translated_unmasked(make_engine) -> None:
    engine, inner = make_engine()
    text = "Template <x1> has 3 slots"
    result = translate(engine, text)
    assert inner.texts == [text]
    assert result.notes[NOTE_KEY] == "skipped"
    assert engine.outcomes == {("de", "skipped"): 1}


def test_outcomes_go_to_the_bound_worker_metrics(make_engine) -> None:
    engine, _ = make_engine(rewrite=lambda t: t.replace("<x1>", ""))
    worker_metrics = WorkerMetrics(CollectorRegistry())
    engine.bind_metrics(worker_metrics.stages)  # as the worker binds its stages
    translate(engine, TEXT, request_id="m1")
    translate(engine, "Where is it?", request_id="m2")  # no spans: not counted
    value = worker_metrics.registry.get_sample_value(
        "tolk_protected_spans_total", {"lang": "de", "outcome": "retried_unmasked"}
    )
    assert value == 1.0


def test_wrapper_delegates_the_engine_interface() -> None:
    inner = FakeEngine(model_version="fake-7")
    engine = ProtectedSpansEngine(inner)
    assert engine.model_version == "fake-7" and engine.languages == inner.languages
    assert engine.count_tokens("a b c") == 3
    inner.model_version = "fake-8"  # read through, never a stale copy
    assert engine.model_version == "fake-8"
    assert not hasattr(engine, "pending")  # nothing else of the inner engine shows through


def test_notes_reach_the_reply_metadata_and_the_wire() -> None:
    rec = ConsumedRecord(
        tp=("tolk.requests.de", 0),
        offset=5,
        key=b"k",
        value=b"",
        lang="de",
        request=WireRequest(
            request_id="r9",
            source_lang="en",
            target_lang="de",
            text=TEXT,
            created_at=0,
            reply_topic="tolk.replies",
        ),
        broker_ts_ms=1_000,
    )
    result = GenerationResult(
        "r9", [1], "x", FinishReason.STOP, notes={NOTE_KEY: "flagged", f"{NOTE_KEY}.spans": "2"}
    )
    reply = engine_reply(
        InFlight(
            request_id="r9",
            lang="de",
            handle=RequestHandle("r9", lambda _rid: None),
            records=[rec],
            submitted_ms=1_000,
        ),
        result,
        worker_id="w",
        model_version="m",
        now_ms=2_000,
    )
    assert reply.metadata == {NOTE_KEY: "flagged", f"{NOTE_KEY}.spans": "2"}
    assert read_result(write_result(reply)).metadata == reply.metadata


def test_mask_form_follows_the_inner_model(make_engine) -> None:
    engine, inner = make_engine(model_version="smollm2-135m")
    result = translate(engine, TEXT)
    assert inner.texts == ["Order [1] arrives at [2]"]
    assert result.text == "[de] 8:30 at arrives A-12345 Order"


def test_worker_with_protected_spans_replies_with_metadata_and_counts() -> None:
    """The whole worker (fake broker) around the wrapper: the reply on the wire carries the
    restored text and the outcome in `metadata`; the worker's registry counts it."""
    from tests.workers.polling import wait_for
    from tests.workers.test_worker_fake_engine import make_rig, request_bytes

    inner = FakeEngine()
    options = ServingOptions.of(Settings(), faithful=False, protect_spans=True)
    rig = make_rig(engine=build_served_engine(inner, options))
    try:
        rig.send(request_bytes("p1", TEXT), "de", key=b"p1")
        rig.send(request_bytes("p2", "no spans here"), "de", key=b"p2")
        wait_for(lambda: rig.reply_count() == 2, what="2 replies")
        replies = rig.replies()
        assert replies["p1"]["text"] == "[de] 8:30 at arrives A-12345 Order"
        assert replies["p1"]["metadata"] == {NOTE_KEY: "restored", f"{NOTE_KEY}.spans": "2"}
        assert replies["p2"]["metadata"] == {}
        assert rig.metric("tolk_protected_spans_total", lang="de", outcome="restored") == 1.0
    finally:
        rig.worker.stop()
        rig.thread.join(10)
