"""workers/stages/faithful/stage.py around a scripted engine: the length guard's cap, a clean answer
passed through, a suspect one retried with the retry form, then withheld (the default policy)
or flagged, notes, counters and the reply's metadata."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry

from schemas.wire import ResultTimings, WireRequest, WireResult, read_result, write_result
from workers import reply_metadata
from workers.client.types import TranslationReply
from workers.engine.types import FinishReason, GenerationResult, RequestHandle, TranslationRequest
from workers.kafka.engine_retries import is_failed_run
from workers.kafka.records import ConsumedRecord, InFlight
from workers.kafka.replies import FINISH_REASON_KEY as REPLIES_FINISH_REASON_KEY
from workers.kafka.replies import engine_reply
from workers.metrics import WorkerMetrics
from workers.stages.cache.policy import is_cacheable
from workers.stages.faithful.rules import LengthCaps
from workers.stages.faithful.stage import (
    CANDIDATE_KEY,
    FINISH_REASON_KEY,
    GUARD_REASON,
    NOTE_KEY,
    RETRY_SUFFIX,
    FaithfulEngine,
)

REQUEST_R1 = WireRequest(
    request_id="r1", source_lang="en", target_lang="de", text="x", created_at=0, reply_topic="r"
)
PATIENCE_DE = "Vielen Dank für Ihre Geduld. Ihr Ersatzgerät wird morgen verschickt."
# 2 x source words + 3 output tokens for en-de in the test table
CAPS = LengthCaps({"scripted": {"en-de": {"slope": 2.0, "intercept": 3.0}}})


@dataclass
class Call:
    request_id: str
    text: str
    max_new_tokens: int | None
    prompt_form: str | None
    conversation_id: str | None = None


Script = Callable[[Call], tuple[str, FinishReason]]


@dataclass
class ScriptedEngine:
    """Answers at once with `script(call)`; records every call. Counts words as tokens."""

    script: Script
    model_version: str = "scripted-1"
    languages: tuple[str, ...] = ("en", "de")
    calls: list[Call] = field(default_factory=list)

    def submit_translation(self, request: TranslationRequest) -> RequestHandle:
        r = request
        request_id = r.request_id
        call = Call(request_id, r.text, r.max_new_tokens, r.prompt_form, r.conversation_id)
        self.calls.append(call)
        out, reason = self.script(call)
        handle = RequestHandle(request_id, lambda _rid: None)
        tokens = len(out.split())
        handle.set_result(
            GenerationResult(request_id, list(range(tokens)), out, reason, 10, tokens)
        )
        return handle

    def count_tokens(self, text: str) -> int:
        return len(text.split())

    def start(self) -> None: ...

    def stop(self, drain: bool = True, timeout: float | None = None) -> None: ...


def make(script: Script, **kw: object) -> tuple[FaithfulEngine, ScriptedEngine]:
    inner = ScriptedEngine(script)
    return FaithfulEngine(inner, caps=CAPS, retry_form="zero_shot", **kw), inner  # type: ignore[arg-type]


def translate(engine: FaithfulEngine, text: str, **kw: object) -> GenerationResult:
    handle = engine.submit_translation(TranslationRequest("r1", text, "en", "de", **kw))  # type: ignore[arg-type]
    return handle.result(timeout=5)


def test_the_guard_caps_by_the_source_and_keeps_a_tighter_language_cap() -> None:
    engine, inner = make(lambda c: ("Wo ist meine Bestellung?", FinishReason.STOP))
    result = translate(engine, "Where is my order?", max_new_tokens=256)
    assert inner.calls[0].max_new_tokens == 2 * 4 + 3  # 4 source "tokens"
    assert result.text == "Wo ist meine Bestellung?" and result.notes == {}
    translate(engine, "Where is my order?", max_new_tokens=5)
    assert inner.calls[1].max_new_tokens == 5  # the language's own cap is tighter
    assert engine.checks == {} and engine.outcomes == {}


def test_a_leak_is_retried_with_the_retry_form() -> None:
    def script(call: Call) -> tuple[str, FinishReason]:
        if call.prompt_form is None:
            return PATIENCE_DE, FinishReason.STOP
        return "Danke", FinishReason.STOP

    engine, inner = make(script)
    result = translate(engine, "Thanks")
    assert [c.request_id for c in inner.calls] == ["r1", "r1" + RETRY_SUFFIX]
    assert inner.calls[1].prompt_form == "zero_shot"
    assert result.request_id == "r1" and result.text == "Danke"
    assert result.notes == {NOTE_KEY: "retried", f"{NOTE_KEY}.first": "leak,ratio"}
    assert result.tokens_out == len(PATIENCE_DE.split()) + 1  # the work of both runs
    assert engine.checks == {("de", "leak"): 1, ("de", "ratio"): 1}
    assert engine.outcomes == {("de", "retried"): 1}


def test_the_conversation_id_goes_to_the_run_and_its_retry() -> None:
    engine, inner = make(
        lambda c: (PATIENCE_DE if c.prompt_form is None else "Danke", FinishReason.STOP)
    )
    result = translate(engine, "Thanks", conversation_id="conv-3")
    assert result.notes[NOTE_KEY] == "retried"
    assert [(c.request_id, c.conversation_id) for c in inner.calls] == [
        ("r1", "conv-3"),
        ("r1" + RETRY_SUFFIX, "conv-3"),
    ]


def test_a_guard_stop_is_retried_and_flagged_when_the_retry_stops_there_too() -> None:
    engine, inner = make(lambda c: ("und " * 20, FinishReason.LENGTH), policy="flag")
    result = translate(engine, "I am waiting for you")
    assert len(inner.calls) == 2
    assert result.notes[NOTE_KEY] == "flagged"
    assert result.notes[FINISH_REASON_KEY] == GUARD_REASON
    assert "length_guard" in result.notes[f"{NOTE_KEY}.problems"]
    assert "loop" in result.notes[f"{NOTE_KEY}.first"]
    assert engine.outcomes == {("de", "flagged"): 1}


def test_a_stop_at_the_language_cap_is_not_the_guard() -> None:
    # the language's max_new_tokens (3) is tighter than the guard: a plain LENGTH, no retry
    engine, inner = make(lambda c: ("Ich warte auf", FinishReason.LENGTH))
    result = translate(engine, "I am waiting for you", max_new_tokens=3)
    assert len(inner.calls) == 1 and result.notes == {}


def test_the_better_of_two_suspects_is_flagged() -> None:
    def script(call: Call) -> tuple[str, FinishReason]:
        if call.prompt_form is None:
            return PATIENCE_DE, FinishReason.STOP  # leak + ratio
        return "Danke danke danke danke danke danke danke", FinishReason.STOP  # ratio + loop

    engine, _ = make(script, policy="flag")
    result = translate(engine, "Thanks")
    assert result.text.startswith("Danke danke")  # milder than a leak
    assert result.notes[f"{NOTE_KEY}.problems"] == "ratio,loop"
    assert result.notes[f"{NOTE_KEY}.first"] == "leak,ratio"


def test_without_retries_a_suspect_answer_is_flagged_at_once() -> None:
    engine, inner = make(lambda c: (PATIENCE_DE, FinishReason.STOP), retry=False, policy="flag")
    result = translate(engine, "Thanks")
    assert len(inner.calls) == 1 and result.text == PATIENCE_DE
    assert result.notes[NOTE_KEY] == "flagged" and result.notes[f"{NOTE_KEY}.retry"] == "off"


def test_a_failed_run_passes_through() -> None:
    engine, inner = make(lambda c: ("", FinishReason.EXPIRED))
    result = translate(engine, "Thanks")
    assert result.finish_reason is FinishReason.EXPIRED and len(inner.calls) == 1


def test_an_engine_without_a_retry_form_gets_no_retry() -> None:
    inner = ScriptedEngine(lambda c: (PATIENCE_DE, FinishReason.STOP))
    engine = FaithfulEngine(inner, caps=CAPS, retry_form=None)  # type: ignore[arg-type]
    assert not engine.retry
    assert translate(engine, "Thanks").notes[NOTE_KEY] == "withheld"


def test_counters_and_the_reply_metadata() -> None:
    metrics = WorkerMetrics(CollectorRegistry()).stages
    engine, _ = make(lambda c: ("und " * 20, FinishReason.LENGTH), policy="flag")
    engine.bind_metrics(metrics)
    result = translate(engine, "I am waiting for you")
    assert metrics.faithful_checks_total.labels(lang="de", check="length_guard")._value.get() == 1
    assert metrics.faithful_outcomes_total.labels(lang="de", outcome="flagged")._value.get() == 1
    # the reply keeps the guard's finer finish reason over the plain `length`
    assert FINISH_REASON_KEY == REPLIES_FINISH_REASON_KEY
    rec = ConsumedRecord(("tolk.requests.de", 0), 0, None, b"", "de", 0, REQUEST_R1)
    inflight = InFlight("r1", "de", RequestHandle("r1", lambda _rid: None), [rec], 0)
    reply = engine_reply(inflight, result, worker_id="w", model_version="scripted-1", now_ms=1)
    assert reply.metadata[REPLIES_FINISH_REASON_KEY] == GUARD_REASON
    assert reply.metadata[NOTE_KEY] == "flagged"


def test_a_suspect_answer_is_withheld_by_default_with_the_reason_and_the_candidate() -> None:
    def script(call: Call) -> tuple[str, FinishReason]:
        if call.prompt_form is None:
            return PATIENCE_DE, FinishReason.STOP  # leak + ratio
        return "Ich habe eine kleine Einlegen, wie es gibt.", FinishReason.STOP  # ratio

    metrics = WorkerMetrics(CollectorRegistry()).stages
    engine, inner = make(script)
    engine.bind_metrics(metrics)
    result = translate(engine, "Thanks")
    assert len(inner.calls) == 2  # retried first
    assert result.finish_reason is FinishReason.WITHHELD and result.text == ""
    assert result.error == "unfaithful translation withheld: ratio (retry: suspect too)"
    assert result.notes[NOTE_KEY] == "withheld"
    assert result.notes[CANDIDATE_KEY] == "Ich habe eine kleine Einlegen, wie es gibt."
    assert result.notes[f"{NOTE_KEY}.first"] == "leak,ratio"
    assert engine.outcomes == {("de", "withheld"): 1}
    assert metrics.faithful_outcomes_total.labels(lang="de", outcome="withheld")._value.get() == 1
    # not an engine failure: the worker neither runs it again nor dead-letters it; not cached
    assert not result.ok and not is_failed_run(result) and not is_cacheable(result)
    rec = ConsumedRecord(("tolk.requests.de", 0), 0, None, b"", "de", 0, REQUEST_R1)
    inflight = InFlight("r1", "de", RequestHandle("r1", lambda _rid: None), [rec], 0)
    reply = engine_reply(inflight, result, worker_id="w", model_version="scripted-1", now_ms=1)
    assert reply.status == "ERROR" and reply.text == ""
    assert (reply.error or "").startswith("unfaithful translation withheld: ratio")
    assert reply.metadata[CANDIDATE_KEY] == "Ich habe eine kleine Einlegen, wie es gibt."
    # through the Avro codec to the client: the reply says it was withheld and carries the text
    client_reply = TranslationReply.from_wire(read_result(write_result(reply)))
    assert not client_reply.ok and client_reply.status == "ERROR"
    assert client_reply.withheld == "Ich habe eine kleine Einlegen, wie es gibt."
    assert client_reply.metadata[NOTE_KEY] == "withheld"


def test_a_sent_reply_is_not_withheld_on_the_client() -> None:
    engine, _ = make(lambda c: ("und " * 20, FinishReason.LENGTH), policy="flag")
    result = translate(engine, "I am waiting for you")
    rec = ConsumedRecord(("tolk.requests.de", 0), 0, None, b"", "de", 0, REQUEST_R1)
    inflight = InFlight("r1", "de", RequestHandle("r1", lambda _rid: None), [rec], 0)
    reply = engine_reply(inflight, result, worker_id="w", model_version="scripted-1", now_ms=1)
    client_reply = TranslationReply.from_wire(read_result(write_result(reply)))
    assert client_reply.ok and client_reply.withheld is None
    assert client_reply.metadata[NOTE_KEY] == "flagged"


def test_a_clean_answer_is_never_withheld() -> None:
    engine, inner = make(lambda c: ("Danke", FinishReason.STOP))
    result = translate(engine, "Thanks")
    assert result.finish_reason is FinishReason.STOP and result.text == "Danke"
    assert result.notes == {} and len(inner.calls) == 1


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        make(lambda c: ("Danke", FinishReason.STOP), policy="drop")


def test_readers_of_replies_use_the_same_keys() -> None:
    # the client and replay read the outcome without importing this module
    from replay.report import WITHHELD_KEY

    assert WITHHELD_KEY == NOTE_KEY
    reply = TranslationReply.from_wire(
        WireResult(
            request_id="r",
            status="ERROR",
            text="",
            error=None,
            model_version="m",
            source_lang="en",
            target_lang="de",
            timings=ResultTimings(),
            tokens_in=0,
            tokens_out=0,
            cached_prefix_tokens=0,
            worker_id="w",
            completed_at=0,
            metadata={NOTE_KEY: "withheld", CANDIDATE_KEY: "Hallo"},
        )
    )
    assert reply.withheld == "Hallo"


def test_a_detector_that_raises_does_not_lose_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a check (a race time "4:41.30" once crashed the number check) must not leave
    the request unanswered: the answer goes out unchecked, counted as check_failed."""
    import workers.stages.faithful.stage as stage_mod

    def broken(*_a: object, **_k: object) -> object:
        raise ValueError("invalid literal for int() with base 10: '41.30'")

    monkeypatch.setattr(stage_mod, "check", broken)
    engine, inner = make(lambda c: ("Zeit 4:41.30", FinishReason.STOP))
    result = translate(engine, "time 4:41.30")
    assert result.ok and result.text == "Zeit 4:41.30" and len(inner.calls) == 1
    assert engine.checks == {("de", "check_failed"): 1} and engine.outcomes == {}


def test_a_dropped_name_is_retried_then_sent_flagged_never_withheld() -> None:
    # the names check is right 4 times in 5 (docs/PROMPTS.md): an answer that still lacks the
    # name after the retry goes out flagged, under the default withhold policy too
    source = "Please ask Cuddeback at the front desk."
    engine, inner = make(lambda c: ("Bitte fragen Sie an der Rezeption.", FinishReason.STOP))
    result = translate(engine, source)
    assert len(inner.calls) == 2 and inner.calls[1].prompt_form == "zero_shot"
    assert result.text == "Bitte fragen Sie an der Rezeption." and result.flagged
    assert result.notes[NOTE_KEY] == "flagged"
    assert result.notes[reply_metadata.FAITHFUL_PROBLEMS] == "name"
    assert engine.checks == {("de", "name"): 1} and engine.outcomes == {("de", "flagged"): 1}

    def fixed(call: Call) -> tuple[str, FinishReason]:  # the retry keeps the name
        ok = call.prompt_form == "zero_shot"
        text = "Bitte fragen Sie Cuddeback an der Rezeption." if ok else "Bitte fragen Sie hier."
        return text, FinishReason.STOP

    engine, _ = make(fixed)
    assert translate(engine, source).notes[NOTE_KEY] == "retried"


def test_a_dropped_name_with_a_withholding_problem_is_withheld() -> None:
    engine, _ = make(lambda c: ("Bitte fragen Sie an Schalter 7.", FinishReason.STOP))
    result = translate(engine, "Please ask Cuddeback at the front desk.")
    assert result.finish_reason is FinishReason.WITHHELD
    assert result.notes[reply_metadata.FAITHFUL_PROBLEMS] == "number,name"
