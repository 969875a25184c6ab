"""`CachingEngine` (workers/stages/cache/stage.py): hits, single flight, what is cached, metrics.

Against the fake engine of tests/workers/fakes.py and an in-memory L2; the Redis outage under
load is in test_cache_outage.py, the replay figures in bench/cache.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.workers.fakes import FAIL_MARKER, FakeEngine, fake_translation
from tests.workers.polling import wait_for
from tests.workers.test_worker_fake_engine import make_rig, request_bytes
from workers.engine.types import FinishReason, GenerationResult, RequestHandle, TranslationRequest
from workers.metrics import WorkerMetrics
from workers.serving.pipeline import ServingOptions, build_served_engine
from workers.settings import Settings
from workers.stages.cache.redis_l2 import InMemoryTranslationCache
from workers.stages.cache.stage import CachingEngine, engine_fingerprint
from workers.stages.protected.stage import ProtectedSpansEngine

LANGS = ("en", "de", "fr", "es", "it")


def caching(
    inner: Any = None, l2: InMemoryTranslationCache | None = None, **kw: Any
) -> CachingEngine:
    engine = CachingEngine(
        inner if inner is not None else FakeEngine(),
        l1_capacity=kw.pop("l1_capacity", 1000),
        l1_shares={lang: 1.0 for lang in LANGS},
        l2=l2 if l2 is not None else InMemoryTranslationCache(),
        prompt_set_version="p1",
        **kw,
    )
    engine.start()
    return engine


def submit(engine: CachingEngine, rid: str, text: str = "Vielen Dank.", **kw: Any) -> RequestHandle:
    args: dict[str, Any] = {"source_lang": "de", "target_lang": "en", **kw}
    return engine.submit_translation(TranslationRequest(request_id=rid, text=text, **args))


@pytest.fixture
def engine() -> Any:
    e = caching()
    yield e
    e.stop()


def test_a_repeat_is_answered_from_l1_at_once(engine: CachingEngine) -> None:
    first = submit(engine, "r1").result(5)
    assert first.finish_reason is FinishReason.STOP and first.notes["tolk.cache"] == "miss"
    assert first.text == fake_translation("Vielen Dank.", "en") and first.tokens_out > 0

    handle = submit(engine, "r2", text="  Vielen   Dank. ")  # same after normalization
    assert handle.done()  # resolved before submit returned: no engine round trip
    hit = handle.result(0)
    assert hit.request_id == "r2" and hit.text == first.text
    assert hit.finish_reason is FinishReason.STOP and hit.notes == {"tolk.cache": "l1"}
    assert hit.tokens_out == 0 and hit.tokens_in == 0
    assert 0 < hit.timings.total_s < 0.1  # the look-up, measured (microseconds when idle)
    assert engine.inner.submitted == ["r1"]
    assert engine.counts[("en", "miss")] == 1 and engine.counts[("en", "l1")] == 1


def test_another_worker_finds_it_in_l2_and_keeps_it_in_its_l1() -> None:
    shared = InMemoryTranslationCache()
    one, two = caching(l2=shared), caching(l2=shared)
    try:
        submit(one, "a1").result(5)
        assert one.flush_l2_writes()
        assert len(shared.data) == 1
        hit = submit(two, "b1").result(0)
        assert hit.notes == {"tolk.cache": "l2"} and hit.text.startswith("[en]")
        assert submit(two, "b2").result(0).notes == {"tolk.cache": "l1"}
        assert two.inner.submitted == []
    finally:
        one.stop()
        two.stop()


def test_concurrent_identical_requests_run_once_and_all_get_the_answer(
    engine: CachingEngine,
) -> None:
    engine.inner.hold()
    handles: list[RequestHandle] = []
    lock = threading.Lock()

    def client(i: int) -> None:
        h = submit(engine, f"c{i}", text="Ja, bitte.")
        with lock:
            handles.append(h)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(engine.inner.submitted) == 1  # one run for 40 requests
    assert not any(h.done() for h in handles)
    engine.inner.release()
    results = {h.request_id: h.result(5) for h in handles}
    assert len(results) == 40
    assert {r.text for r in results.values()} == {fake_translation("Ja, bitte.", "en")}
    assert all(r.finish_reason is FinishReason.STOP for r in results.values())
    assert all(rid == r.request_id for rid, r in results.items())
    how = sorted(r.notes["tolk.cache"] for r in results.values())
    assert how == ["joined"] * 39 + ["miss"]
    assert (
        sum(r.tokens_out for r in results.values()) == results[engine.inner.submitted[0]].tokens_out
    )  # counted once
    assert submit(engine, "after").result(5).notes["tolk.cache"] == "miss"  # other text
    assert submit(engine, "again", text="Ja, bitte.").result(0).notes == {"tolk.cache": "l1"}


def test_an_error_is_not_cached_and_reaches_every_participant(engine: CachingEngine) -> None:
    engine.inner.hold()
    text = f"kaputt {FAIL_MARKER}"
    a, b = submit(engine, "e1", text=text), submit(engine, "e2", text=text)
    engine.inner.release()
    assert a.result(5).finish_reason is FinishReason.ERROR
    assert b.result(5).finish_reason is FinishReason.ERROR  # the worker retries each
    assert submit(engine, "e3", text=text).result(5).finish_reason is FinishReason.ERROR
    assert engine.inner.submitted == ["e1", "e3"]


def test_a_joined_request_outlives_the_expired_one_that_ran(engine: CachingEngine) -> None:
    engine.inner.hold()
    leader = submit(engine, "short", deadline=time.monotonic() + 0.05)
    joined = submit(engine, "long", deadline=None)
    time.sleep(0.1)
    engine.inner.release()
    assert leader.result(5).finish_reason is FinishReason.EXPIRED
    late = joined.result(5)
    assert late.finish_reason is FinishReason.STOP and late.notes["tolk.cache"] == "miss"
    assert engine.inner.submitted == ["short", "long"]  # it flew again, on its own id


def test_cancel_detaches_one_participant_and_the_last_cancels_the_run(
    engine: CachingEngine,
) -> None:
    engine.inner.hold()
    a, b = submit(engine, "a"), submit(engine, "b")
    a.cancel()
    assert a.result(1).finish_reason is FinishReason.CANCELLED
    assert not b.done()
    engine.inner.release()
    assert b.result(5).finish_reason is FinishReason.STOP  # the run went on for b

    engine.inner.hold()
    c, d = submit(engine, "c", text="Okay."), submit(engine, "d", text="Okay.")
    c.cancel()
    d.cancel()
    wait_for(lambda: engine.inner.pending() == 0, what="the orphaned run cancelled")
    assert d.result(1).finish_reason is FinishReason.CANCELLED
    engine.inner.release()
    assert submit(engine, "e", text="Okay.").result(5).notes["tolk.cache"] == "miss"


def test_the_conversation_id_goes_to_the_run_and_is_not_in_the_key(
    engine: CachingEngine,
) -> None:
    engine.inner.hold()
    leader = submit(engine, "x1", deadline=time.monotonic() + 0.05, conversation_id="c1")
    joined = submit(engine, "x2", conversation_id="c2")  # shares x1's run
    time.sleep(0.1)
    engine.inner.release()
    assert leader.result(5).finish_reason is FinishReason.EXPIRED
    assert joined.result(5).notes["tolk.cache"] == "miss"  # flew again, on its own id
    hit = submit(engine, "x3", conversation_id="c3").result(5)
    assert hit.notes["tolk.cache"] == "l1"  # another conversation, the same entry
    assert engine.inner.conversations == {"x1": "c1", "x2": "c2"}
    long = "ein Satz, der zu lang ist für den Cache " * 60
    submit(engine, "x4", text=long, conversation_id="c4").result(5)
    assert engine.inner.conversations["x4"] == "c4"  # the bypass passes it on too


class NotingEngine(FakeEngine):
    """Marks every result as a stage would (notes for the reply, declared fields for code)."""

    def __init__(self, notes: dict[str, str], **fields: Any) -> None:
        super().__init__()
        self.notes = notes
        self.fields = fields

    def _finish(self, job: Any) -> GenerationResult:
        result = super()._finish(job)
        return dataclasses.replace(result, notes=dict(self.notes), **self.fields)


@pytest.mark.parametrize(
    "notes, fields",
    [
        ({"tolk.protected_spans": "flagged"}, {"spans": "flagged", "flagged": True}),
        ({"tolk.faithful": "retried"}, {"faithful": "retried", "retries": 1}),
    ],
)
def test_flagged_or_retried_translations_are_not_cached(
    notes: dict[str, str], fields: dict[str, Any]
) -> None:
    engine = caching(NotingEngine(notes, **fields))
    try:
        first = submit(engine, "f1").result(5)
        assert first.notes == {**notes, "tolk.cache": "miss"}  # the flag stays on the reply
        assert submit(engine, "f2").result(5).notes["tolk.cache"] == "miss"
        assert engine.inner.submitted == ["f1", "f2"]
        assert engine.flush_l2_writes() and engine.l2 is not None
        assert engine.l2.store.data == {}  # type: ignore[attr-defined]
    finally:
        engine.stop()


def test_long_texts_bypass_the_cache() -> None:
    engine = caching(max_text_chars=20)
    try:
        text = "ein sehr langer Satz, der nicht gecacht wird"
        for rid in ("l1", "l2"):
            result = submit(engine, rid, text=text).result(5)
            assert "tolk.cache" not in result.notes
        assert engine.inner.submitted == ["l1", "l2"]
        assert engine.counts[("en", "bypass")] == 2
    finally:
        engine.stop()


def test_the_fingerprint_names_model_stages_and_variant() -> None:
    inner = ProtectedSpansEngine(FakeEngine(model_version="gemma3-270m"))
    assert engine_fingerprint(inner.model_version, [inner, inner.inner], "arm=B") == (
        "gemma3-270m|ProtectedSpansEngine>FakeEngine|arm=B"
    )
    # as the builder composes `tolk worker --protect-spans --arm B`: the stages below the cache
    options = ServingOptions.of(
        Settings(arm="B"), protect_spans=True, cache=True, cache_variant="quantize=int8",
        cache_l2=InMemoryTranslationCache(),
    )  # fmt: skip
    served = build_served_engine(FakeEngine(model_version="gemma3-270m"), options)
    assert served.stage("cache").fingerprint == (
        "gemma3-270m|ProtectedSpansEngine>FaithfulEngine>FakeEngine|arm=B,quantize=int8"
    )


def test_two_arms_never_share_entries() -> None:
    shared = InMemoryTranslationCache()
    settings = Settings(metrics_port=0)
    a, b = (
        build_served_engine(
            FakeEngine(),
            ServingOptions.of(
                settings.replace(arm=arm), faithful=False, cache=True, cache_l2=shared
            ),
        ).stage("cache")
        for arm in ("A", "B")
    )
    for e in (a, b):
        e.start()
    try:
        submit(a, "x").result(5)
        assert a.flush_l2_writes()
        assert submit(b, "y").result(5).notes["tolk.cache"] == "miss"
    finally:
        a.stop()
        b.stop()


def test_engines_on_other_prompt_forms_never_share_entries() -> None:
    """An `EngineConfig.prompt_form` override changes the translations: it is in the key."""
    shared = InMemoryTranslationCache()

    def on_form(form: str) -> CachingEngine:
        return caching(FakeEngine(), l2=shared, prompt_form=form)

    engines = a, b, a_again = on_form("support8"), on_form("zero_shot"), on_form("support8")
    try:
        submit(a, "x").result(5)
        assert a.flush_l2_writes()
        assert submit(b, "y").result(5).notes["tolk.cache"] == "miss"
        assert submit(a_again, "z").result(5).notes["tolk.cache"] == "l2"
    finally:
        for e in engines:
            e.stop()


def test_counts_go_into_the_worker_metrics() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry).stages
    engine = caching(l1_capacity=5)  # one entry per language
    engine.bind_metrics(metrics)
    try:
        engine.inner.hold()
        a, b = submit(engine, "m1", text="Ja."), submit(engine, "m2", text="Ja.")
        engine.inner.release()
        a.result(5), b.result(5)
        submit(engine, "m3", text="Ja.").result(0)
        submit(engine, "m4", text="Nein.").result(5)  # evicts "Ja." (one entry for en)

        def sample(name: str, **labels: str) -> float:
            return registry.get_sample_value(f"tolk_{name}", labels) or 0.0

        assert sample("cache_misses_total", lang="en") == 2
        assert sample("cache_joined_total", lang="en") == 1
        assert sample("cache_hits_total", lang="en", tier="l1") == 1
        assert sample("cache_evictions_total", lang="en") == 1
        assert sample("cache_hit_seconds_count", lang="en") == 1
        assert sample("cache_hit_seconds_bucket", lang="en", le="0.005") == 1
        assert sample("cache_l2_up") == 1
    finally:
        engine.stop()


def test_through_the_worker_the_reply_says_it_came_from_the_cache() -> None:
    rig = make_rig(engine=caching())
    try:
        for i in range(10):
            rig.send(request_bytes(f"p1-{i}", text=f"Satz {i % 5}"), "de", key=f"k{i}".encode())
        wait_for(lambda: rig.reply_count() == 10, what="first pass answered")
        for i in range(10):
            rig.send(request_bytes(f"p2-{i}", text=f"Satz {i % 5}"), "de", key=f"k{i}".encode())
        wait_for(lambda: rig.reply_count() == 20, what="second pass answered")
        replies = rig.replies()
        second = [replies[f"p2-{i}"] for i in range(10)]
        assert all(r["status"] == "OK" for r in replies.values())
        assert {r["metadata"]["tolk.cache"] for r in second} == {"l1"}
        assert all(r["tokens_out"] == 0 and r["prefill_ms"] == 0 for r in map(_timings, second))
        for i in range(10):
            assert replies[f"p2-{i}"]["text"] == fake_translation(f"Satz {i % 5}", "de")
        assert len(rig.engine.inner.submitted) <= 10  # hits never reached the engine
        assert rig.metric("tolk_cache_hits_total", lang="de", tier="l1") == 10
    finally:
        rig.worker.stop()
        rig.thread.join(10)


def _timings(reply: dict[str, Any]) -> dict[str, Any]:
    return {"tokens_out": reply["tokens_out"], **reply["timings"]}


class RecordingWorker:
    """Stands in for `Worker` in the CLI test: keeps the engine it was given."""

    engines: list[Any] = []

    def __init__(self, settings: Settings, engine: Any) -> None:
        self.metrics = WorkerMetrics(CollectorRegistry())
        RecordingWorker.engines.append(engine)

    def run(self) -> None:
        pass


@pytest.mark.parametrize(
    "args, env, cached",
    [
        ([], {}, True),  # on by default
        (["--no-cache"], {}, False),
        ([], {"TOLK_CACHE": "0"}, False),
        (["--cache"], {"TOLK_CACHE": "0"}, True),  # the flag wins over the variable
        (["--arm", "B", "--no-cache"], {}, False),  # per arm: this arm's workers go without
    ],
)
def test_tolk_worker_puts_the_cache_outermost_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch, args: list[str], env: dict[str, str], cached: bool
) -> None:
    from typer.testing import CliRunner

    import workers.cli as cli
    import workers.serving.fair_engine as fair_engine
    import workers.worker as worker_module

    monkeypatch.setattr(cli, "_check_broker_or_exit", lambda settings: None)
    monkeypatch.setattr(fair_engine, "build_fair_engine", lambda *a, **k: FakeEngine())
    monkeypatch.setattr(worker_module, "Worker", RecordingWorker)
    monkeypatch.delenv("TOLK_CACHE", raising=False)
    RecordingWorker.engines = []
    result = CliRunner().invoke(
        cli.app, ["worker", "--no-faithful", "--metrics-port", "0", *args], env=env
    )
    assert result.exit_code == 0, result.output
    (served,) = RecordingWorker.engines
    assert isinstance(served.entry, CachingEngine) is cached
    if cached:
        assert isinstance(served.entry.inner, FakeEngine)
