"""Distributed traces (OpenTelemetry, optional): one trace per generation, from the REST gateway through the edge
client and the gRPC stream to the verifier's sessions and verify rounds.

Tandem only *uses* the OpenTelemetry API; without the ``otel`` extra installed every call here is a no-op costing
nothing. A process exports its spans when it configures a provider: ``configure()`` (``tandem serve`` does, when
``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``--otlp-endpoint`` is set) with the OTLP gRPC exporter, or any provider an
application sets itself (the SDK inherits the application's). Context crosses the gRPC hop as W3C ``traceparent``
metadata on the session stream, and threads (the gateway's generation runs on a worker thread) as an explicit
parent captured where the generation was created.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Sequence

log = logging.getLogger("tandem.tracing")

try:  # the API only: spans are recorded when some provider is configured, else it is OpenTelemetry's no-op
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised where the extra is missing
    AVAILABLE = False


class _NoSpan:
    def set_attribute(self, key: str, value: Any) -> None:
        pass

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        pass

    def record_exception(self, exc: BaseException) -> None:
        pass

    def set_status_error(self, message: str) -> None:
        pass

    def end(self) -> None:
        pass


NO_SPAN = _NoSpan()


class _Span:
    """An OpenTelemetry span behind the few calls Tandem makes."""

    def __init__(self, span):
        self.span = span

    def set_attribute(self, key: str, value: Any) -> None:
        self.span.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        self.span.set_attributes(dict(attributes))

    def record_exception(self, exc: BaseException) -> None:
        self.span.record_exception(exc)
        self.set_status_error(f"{type(exc).__name__}: {exc}")

    def set_status_error(self, message: str) -> None:
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, message))

    def end(self) -> None:
        self.span.end()


Span = _Span | _NoSpan  # what ``start_span`` returns: a recorded span, or the no-op without OpenTelemetry


def current_context() -> Any:
    """The caller's trace context, to hand to work that runs on another thread (``start_span(parent=...)``)."""
    return otel_context.get_current() if AVAILABLE else None


def start_span(
    name: str, parent: Any = None, kind: str = "internal", attributes: Mapping[str, Any] | None = None
) -> _Span | _NoSpan:
    """A span under ``parent`` (a context from ``current_context``/``extract``, or a span); end it with ``end()``."""
    if not AVAILABLE:
        return _NoSpan()
    if isinstance(parent, _Span):
        parent = trace.set_span_in_context(parent.span)
    kinds = {"internal": trace.SpanKind.INTERNAL, "server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT}
    span = trace.get_tracer("tandem").start_span(
        name, context=parent, kind=kinds[kind], attributes=dict(attributes or {})
    )
    return _Span(span)


@contextmanager
def use(s: _Span | _NoSpan) -> Iterator[None]:
    """Make ``s`` the current span of this thread/task for the block (work started there hangs below it)."""
    if not isinstance(s, _Span):
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(s.span))
    try:
        yield
    finally:
        otel_context.detach(token)


@contextmanager
def span(
    name: str, parent: Any = None, kind: str = "internal", attributes: Mapping[str, Any] | None = None
) -> Iterator[_Span | _NoSpan]:
    s = start_span(name, parent, kind, attributes)
    try:
        yield s
    except BaseException as e:
        s.record_exception(e)
        raise
    finally:
        s.end()


def inject(parent: _Span | _NoSpan) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying ``parent`` (W3C traceparent/tracestate)."""
    if not isinstance(parent, _Span):
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(parent.span))
    return tuple(carrier.items())


def extract(metadata: Sequence[tuple[str, Any]] | None) -> Any:
    """The parent context a client sent in its metadata (None without tracing)."""
    if not AVAILABLE:
        return None
    return propagate.extract({k: v for k, v in (metadata or ()) if isinstance(v, str)})


def configure(service_name: str, endpoint: str | None = None) -> bool:
    """Export this process's spans over OTLP/gRPC to ``endpoint`` (default: ``OTEL_EXPORTER_OTLP_ENDPOINT``).
    Returns False, with a warning, when the ``otel`` extra is not installed."""
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        log.warning("tracing asked for, but the otel extra is not installed (pip install 'tandem[otel]')")
        return False
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(
        BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter())
    )
    trace.set_tracer_provider(provider)
    return True
