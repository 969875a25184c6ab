"""OpenTelemetry traces of one request: client -> worker -> reply, W3C trace context in headers.

The client (`workers.client.TranslationClient`) puts a W3C `traceparent` header on the request
record: the span a caller has open, or the client's own `tolk translate <lang>` span when it
was given a tracer. A worker with tracing on (`Settings.tracing`, `TOLK_TRACING`) continues that
trace: per reply it records one `tolk.request` span, child of the client's span, with five
children in the order a request lives through the worker:

| span | from | to |
|---|---|---|
| `consume` | the record's broker timestamp | the worker took it from the consumer |
| `queue_wait` | handed to the engine | admitted by its scheduler (fair-share queue wait) |
| `prefill` | admitted | admitted + the engine's prefill time for it |
| `decode` | completion - the engine's decode time | completion |
| `produce` | the reply handed to the producer | its delivery acknowledged by the broker |

The engine reports durations (`GenerationResult.timings`), not timestamps, and a request's
prefill and decode steps interleave with other requests' steps, so `prefill` is placed right
after admission and `decode` right before completion; the gap between them, if any, is time the
request waited between its steps. Spans are recorded when the reply's delivery is
acknowledged (spans with explicit start and end times), so the hot path only keeps a few
timestamps per request. The reply record carries the `tolk.request` span's `traceparent`
back, so the client sees which worker span answered it.

Off by default (`tracing="off"`): nothing is recorded, no header is read. `"otlp"` exports
through the OTLP/HTTP exporter (`pip install opentelemetry-exporter-otlp-proto-http`; its
standard `OTEL_EXPORTER_OTLP_*` variables say where); tests hand the worker a tracer provider
with the SDK's in-memory exporter. This module is the only one of the worker and the client
that imports OpenTelemetry. It imports nothing of the worker: the Kafka side makes a
`RequestTrace` from its records (`workers.kafka.records.request_trace`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Tracer, TracerProvider
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

__all__ = [
    "TRACEPARENT",
    "RequestTrace",
    "RequestTracer",
    "client_span",
    "inject_traceparent",
    "otlp_tracer_provider",
    "request_tracer",
    "traceparent_of",
]

TRACEPARENT = "traceparent"
SPAN_NAMES = ("consume", "queue_wait", "prefill", "decode", "produce")
_PROPAGATOR = TraceContextTextMapPropagator()


def traceparent_of(headers: Sequence[tuple[str, bytes | str | None]] | None) -> str | None:
    """The `traceparent` value of a Kafka record's headers, if any (decoded, stripped)."""
    for name, value in headers or ():
        if name.lower() == TRACEPARENT and value:
            text = value.decode("ascii", "replace") if isinstance(value, bytes) else value
            return text.strip()
    return None


def client_span(tracer: Tracer, lang: str) -> Any:
    """The client's span around one request and its reply (a context manager that makes it
    the current span, so `inject_traceparent` puts it on the request)."""
    return tracer.start_as_current_span(f"tolk translate {lang}", kind=SpanKind.CLIENT)


def inject_traceparent(context: Context | None = None) -> list[tuple[str, bytes]]:
    """Kafka headers carrying the span of `context` (default: the current one); [] when no
    span is active."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return [(k, v.encode("ascii")) for k, v in carrier.items() if k in (TRACEPARENT, "tracestate")]


@dataclass(slots=True)
class RequestTrace:
    """Timestamps (epoch ns) of one request through the worker; the durations come from the
    engine result."""

    parent: str | None  # the request's traceparent header
    lang: str
    request_id: str
    broker_ns: int  # the record's timestamp
    taken_ns: int  # the worker took it from the consumer
    submitted_ns: int = 0  # handed to the engine (0: never, a reply without the engine)
    queue_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    completed_ns: int = 0  # the engine's result arrived
    produced_ns: int = 0  # the reply went to the producer
    status: str = ""


class RequestTracer:
    """Records the spans of requests (see the module docstring) with one OpenTelemetry tracer."""

    def __init__(self, provider: TracerProvider) -> None:
        self._tracer: Tracer = provider.get_tracer("tolk.worker")

    def reply_headers(self, req: RequestTrace) -> tuple[Any, list[tuple[str, bytes]]]:
        """Start the request's `tolk.request` span (ended by `finish`); the headers that carry
        it on the reply."""
        parent = _PROPAGATOR.extract({TRACEPARENT: req.parent}) if req.parent else None
        span = self._tracer.start_span(
            "tolk.request",
            context=parent,
            kind=SpanKind.CONSUMER,
            start_time=req.broker_ns,
            attributes={"tolk.lang": req.lang, "tolk.request_id": req.request_id},
        )
        return span, inject_traceparent(trace.set_span_in_context(span))

    def finish(self, span: Any, req: RequestTrace, delivered_ns: int) -> None:
        """Record the five child spans and end the request span at `delivered_ns`."""
        ctx = trace.set_span_in_context(span)
        for name, start, end in _phases(req, delivered_ns):
            child = self._tracer.start_span(name, context=ctx, start_time=start)
            child.end(end_time=max(start, end))
        span.set_attribute("tolk.status", req.status)
        span.end(end_time=max(req.broker_ns, delivered_ns))


def _phases(req: RequestTrace, delivered_ns: int) -> list[tuple[str, int, int]]:
    """(name, start, end) of the five phases; a reply made without the engine (rejected,
    expired, from the store) has zero-length engine phases at the moment it was produced."""
    taken = max(req.broker_ns, req.taken_ns)
    produced = max(taken, req.produced_ns)
    if req.submitted_ns:
        submitted = max(taken, req.submitted_ns)
        completed = max(submitted, req.completed_ns or produced)
        admitted = min(completed, submitted + int(req.queue_s * 1e9))
        prefill_end = min(completed, admitted + int(req.prefill_s * 1e9))
        decode_start = max(prefill_end, completed - int(req.decode_s * 1e9))
    else:
        submitted = admitted = prefill_end = decode_start = completed = produced
    return [
        ("consume", req.broker_ns, taken),
        ("queue_wait", submitted, admitted),
        ("prefill", admitted, prefill_end),
        ("decode", decode_start, completed),
        ("produce", produced, max(produced, delivered_ns)),
    ]


def request_tracer(mode: str, worker_id: str, provider: Any = None) -> RequestTracer | None:
    """The worker's tracer: over `provider` when one is given (tests, embedding), else as
    `mode` (`Settings.tracing`) says ("off": None; "otlp": the OTLP/HTTP exporter)."""
    if provider is None:
        if mode == "off":
            return None
        provider = otlp_tracer_provider("tolk-worker", {"service.instance.id": worker_id})
    return RequestTracer(provider)


def otlp_tracer_provider(service_name: str, resource_attributes: Mapping[str, str]) -> Any:
    """A tracer provider exporting over OTLP/HTTP in batches (`tracing="otlp"`)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:  # an optional extra
        raise RuntimeError(
            "TOLK_TRACING=otlp needs the OTLP exporter: "
            "pip install opentelemetry-exporter-otlp-proto-http==1.45.2"
        ) from exc
    resource = Resource.create({"service.name": service_name, **resource_attributes})
    provider = SdkTracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider
