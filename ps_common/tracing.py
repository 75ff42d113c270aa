"""OpenTelemetry traces of a training step, off by default (docs/operations.md#tracing-opentelemetry).

A process turns tracing on once, at start, with :func:`configure` (``--otel-endpoint URL`` or the
standard ``OTEL_*`` variables, :func:`wanted`). Until then, and whenever it stays off, every
function here is the no-op path: :func:`span` answers one shared null context manager,
:func:`headers` an empty tuple, and no ``opentelemetry`` module is imported. On, spans go to an
OTLP exporter (gRPC, or http/protobuf per ``OTEL_EXPORTER_OTLP_PROTOCOL``; ``console`` per
``OTEL_TRACES_EXPORTER``) through a batch processor; the sampler is the SDK's, from
``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG`` (default: parent-based, always on).

The context crosses processes as a W3C ``traceparent``: in gRPC metadata (:func:`headers` on the
worker's calls, :func:`server_span` on the shard), and in ``PushHeader.traceparent`` for a call on a
data connection, which has no metadata.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'grpc-ps[otel]'"
TRACEPARENT = "traceparent"

_NULL = contextlib.nullcontext()
_tracer: Any = None
"""The SDK's tracer once :func:`configure` turned tracing on; None: off (the no-op path)."""
_provider: Any = None


class TracingUnavailableError(RuntimeError):
    """Tracing was asked for but the ``opentelemetry`` packages are not installed."""


def wanted(endpoint: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process traces: ``endpoint`` (``--otel-endpoint``) given, or an OTLP endpoint or
    a traces exporter other than ``none`` named in ``OTEL_*``; never with ``OTEL_SDK_DISABLED=true``."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return bool(endpoint)
    named = env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    return bool(endpoint or exporter or named)


def check_installed(endpoint: str) -> None:
    """Fail before anything starts when :func:`wanted` but the SDK is missing (imports nothing).

    Raises:
        TracingUnavailableError: naming ``pip install 'grpc-ps[otel]'``.
    """
    import importlib.util

    if not wanted(endpoint):
        return
    try:
        found = importlib.util.find_spec("opentelemetry.sdk") is not None
    except ImportError:  # no opentelemetry package at all
        found = False
    if not found:
        raise TracingUnavailableError(
            f"Tracing was asked for (--otel-endpoint or OTEL_*) but OpenTelemetry is not installed; "
            f"install it with: {INSTALL_HINT}"
        )


def enabled() -> bool:
    """Tracing is on in this process."""
    return _tracer is not None


def configure(endpoint: str, service: str, attributes: Mapping[str, Any] | None = None) -> bool:
    """Turn tracing on for this process when :func:`wanted` says so; otherwise import nothing.

    Args:
        endpoint: ``--otel-endpoint`` (``http://HOST:4317``; "" : the ``OTEL_*`` variables').
        service: ``service.name`` unless ``OTEL_SERVICE_NAME`` says otherwise.
        attributes: more resource attributes (``ps.shard_index``, ``ps.rank``).

    Returns:
        Whether tracing is on.

    Raises:
        TracingUnavailableError: wanted, but ``opentelemetry-sdk`` or the exporter is missing
            (the message names ``pip install 'grpc-ps[otel]'``).
    """
    global _tracer, _provider
    if not wanted(endpoint):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingUnavailableError(
            f"Tracing was asked for (--otel-endpoint or OTEL_*) but OpenTelemetry is not installed ({exc}); "
            f"install it with: {INSTALL_HINT}"
        ) from exc
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or service, **(attributes or {})})
    provider = TracerProvider(resource=resource)  # the sampler: OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG
    provider.add_span_processor(BatchSpanProcessor(_exporter(endpoint)))
    _provider, _tracer = provider, provider.get_tracer("grpc-ps")
    trace.set_tracer_provider(provider)
    log.info("tracing on: %s, service %s", endpoint or "OTEL_* settings", resource.attributes.get("service.name"))
    return True


def _exporter(endpoint: str) -> Any:
    """The span exporter ``OTEL_TRACES_EXPORTER`` names (``otlp`` by default; ``console``)."""
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    try:
        if kind == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter()
        if kind != "otlp":
            raise ValueError(f"OTEL_TRACES_EXPORTER={kind!r} is not supported here; use otlp, console or none.")
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        if (protocol or "grpc").strip() == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

            return HttpExporter(endpoint=endpoint or None)
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = True if endpoint.startswith("http://") else None
        return OTLPSpanExporter(endpoint=endpoint or None, insecure=insecure)
    except ImportError as exc:
        raise TracingUnavailableError(
            f"The {kind} span exporter is not installed ({exc}); install it with: {INSTALL_HINT}"
        ) from exc


def shutdown() -> None:
    """Export the spans still queued and stop (at the process's end; bounded by the SDK's timeouts)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[Any]:
    """A span named ``name`` around a block, child of the current one (off: a shared no-op)."""
    if _tracer is None:
        return _NULL
    return _tracer.start_as_current_span(name, attributes=_clean(attributes))


def start(name: str, **attributes: Any) -> Any:
    """A span that ends later, by :func:`end` (a PushPull begun during backward); None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, attributes=_clean(attributes))


def current(started: Any, end: bool = True) -> contextlib.AbstractContextManager[Any]:
    """Make ``started`` (a span of :func:`start`, or None) the current span around a block, and
    ``end`` it there (failed with the block's exception, if any)."""
    if started is None:
        return _NULL
    from opentelemetry import trace

    return trace.use_span(started, end_on_exit=end)


def run_in_context(pool: Any, fn: Any, *args: Any) -> Any:
    """``pool.submit(fn, *args)``, run in a copy of this thread's context when tracing is on (so
    that spans and ``traceparent`` made on the pool's thread follow the caller's span)."""
    if _tracer is None:
        return pool.submit(fn, *args)
    import contextvars

    return pool.submit(contextvars.copy_context().run, fn, *args)


def end(started: Any, error: BaseException | None = None) -> None:
    """End a span of :func:`start` (None: nothing), marked failed with ``error``."""
    if started is not None:
        if error is not None:
            started.record_exception(error)
            from opentelemetry.trace import Status, StatusCode

            started.set_status(Status(StatusCode.ERROR, str(error)))
        started.end()


def traceparent(started: Any = None) -> str:
    """The W3C ``traceparent`` of ``started`` (None: the current span); "" when off or unsampled."""
    if _tracer is None:
        return ""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    context = trace.set_span_in_context(started) if started is not None else None
    TraceContextTextMapPropagator().inject(carrier, context=context)
    return carrier.get(TRACEPARENT, "")


def headers(started: Any = None) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying :func:`traceparent` (empty when off)."""
    if _tracer is None:
        return ()
    value = traceparent(started)
    return ((TRACEPARENT, value),) if value else ()


def server_span(
    method: str, parent: str | Sequence[tuple[str, Any]] | None, **attributes: Any
) -> contextlib.AbstractContextManager[Any]:
    """The shard's span of one call of ``method``, child of the caller's span: ``parent`` is its
    ``traceparent`` or the call's metadata (where it is looked up). Off: the shared no-op."""
    if _tracer is None:
        return _NULL
    return _server_span(method, parent, attributes)


@contextlib.contextmanager
def _server_span(method: str, parent: str | Sequence[tuple[str, Any]] | None, attributes: Any) -> Iterator[Any]:
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    value = parent if isinstance(parent, str) else next((str(v) for k, v in parent or () if k == TRACEPARENT), "")
    context = TraceContextTextMapPropagator().extract({TRACEPARENT: value}) if value else None
    attrs = {"rpc.system": "grpc", "rpc.method": method.rsplit("/", 1)[-1], **_clean(attributes)}
    with _tracer.start_as_current_span(method, context=context, kind=SpanKind.SERVER, attributes=attrs) as s:
        yield s


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes named ``ps.NAME`` (an attribute given as ``ps_name`` or ``name``)."""
    return {(k if "." in k else "ps." + k.removeprefix("ps_")): v for k, v in attributes.items() if v is not None}
