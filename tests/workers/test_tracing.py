"""workers.tracing: one request's trace from the client through a worker and back.

The worker (fake engine, real broker) and the client share one OpenTelemetry tracer provider
with the SDK's in-memory exporter, so the test sees every span of the round trip.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from tests.kafka_fixtures import kafka_bootstrap, redis_url  # noqa: F401
from tests.workers.fakes import FakeEngine, create_prefixed_topics
from tests.workers.polling import wait_for
from workers.client import TranslationClient
from workers.settings import Settings
from workers.tracing import SPAN_NAMES, RequestTrace, _phases, traceparent_of
from workers.worker import Worker

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_traceparent_is_read_from_kafka_headers():
    assert traceparent_of([("x", b"1"), ("Traceparent", TRACEPARENT.encode())]) == TRACEPARENT
    assert traceparent_of([("x", b"1")]) is None and traceparent_of(None) is None


def test_phases_are_ordered_and_clamped():
    ms = 1_000_000
    req = RequestTrace(
        parent=None,
        lang="de",
        request_id="r",
        broker_ns=1000 * ms,
        taken_ns=1003 * ms,
        submitted_ns=1004 * ms,
        queue_s=0.010,
        prefill_s=0.020,
        decode_s=0.050,
        completed_ns=1100 * ms,
        produced_ns=1101 * ms,
    )
    phases = {name: (start, end) for name, start, end in _phases(req, 1110 * ms)}
    assert list(phases) == list(SPAN_NAMES)
    assert phases["consume"] == (1000 * ms, 1003 * ms)
    assert phases["queue_wait"] == (1004 * ms, 1014 * ms)
    assert phases["prefill"] == (1014 * ms, 1034 * ms)
    assert phases["decode"] == (1050 * ms, 1100 * ms)
    assert phases["produce"] == (1101 * ms, 1110 * ms)
    # durations longer than the time they fit in (clock steps) never run backwards
    req.queue_s, req.prefill_s, req.decode_s = 5.0, 5.0, 5.0
    for _name, start, end in _phases(req, 1110 * ms):
        assert start <= end


@pytest.mark.kafka
@pytest.mark.redis
def test_one_request_trace_has_five_worker_spans_under_the_client_span(
    kafka_bootstrap: str,  # noqa: F811
    redis_url: str,  # noqa: F811
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    prefix = f"tr{uuid.uuid4().hex[:10]}."
    create_prefixed_topics(kafka_bootstrap, prefix, ("de",))
    settings = Settings(
        bootstrap=kafka_bootstrap,
        redis_url=redis_url,
        group_id=f"tolk-trace-{uuid.uuid4().hex[:8]}",
        languages=("de",),
        topic_prefix=prefix,
        metrics_port=0,
        worker_id="w-trace",
    )
    worker = Worker(
        settings,
        FakeEngine(delay_s=0.02),
        registry=CollectorRegistry(),
        tracer_provider=provider,
    )
    thread = worker.run_in_thread()
    try:
        assert worker.assigned_event.wait(30)

        async def one() -> object:
            tracer = provider.get_tracer("test-client")
            async with TranslationClient(kafka_bootstrap, topic_prefix=prefix, tracer=tracer) as c:
                return await c.translate("Where is my parcel?", to="de", src="en", timeout=30)

        reply = asyncio.run(one())
        wait_for(lambda: len(exporter.get_finished_spans()) >= 7, 10, "seven spans")
        time.sleep(0.2)
    finally:
        worker.stop()
        thread.join(20)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    client = spans["tolk translate de"]
    request = spans["tolk.request"]
    assert request.parent is not None and request.parent.span_id == client.context.span_id
    assert request.context.trace_id == client.context.trace_id
    assert request.attributes["tolk.lang"] == "de" and request.attributes["tolk.status"] == "OK"
    children = [spans[name] for name in SPAN_NAMES]
    for child in children:
        assert child.parent is not None and child.parent.span_id == request.context.span_id
        assert child.context.trace_id == client.context.trace_id
        assert request.start_time <= child.start_time <= child.end_time <= request.end_time
    starts = [child.start_time for child in children]
    assert starts == sorted(starts)  # consume, queue wait, prefill, decode, produce
    assert spans["queue_wait"].end_time - spans["queue_wait"].start_time == 1_000_000  # 1 ms
    # the reply names the worker's request span
    assert f"{request.context.span_id:016x}" in str(getattr(reply, "trace_parent", ""))


def test_tracing_setting_picks_the_tracer():
    from workers.tracing import RequestTracer, request_tracer

    off = Settings(languages=("de",))
    assert request_tracer(off.tracing, off.worker_id) is None  # off by default
    on = Settings(languages=("de",), tracing="otlp", worker_id="w-otlp")
    otlp = request_tracer(on.tracing, on.worker_id)
    assert isinstance(otlp, RequestTracer)
    with pytest.raises(ValueError, match="tracing"):
        Settings(languages=("de",), tracing="jaeger")
