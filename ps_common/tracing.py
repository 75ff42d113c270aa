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

import atexit
import contextlib
import inspect
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'grpc-ps[otel]'"
TRACEPARENT = "traceparent"

_NULL = contextlib.nullcontext()
_tracer: Any = None
"""The SDK's tracer once :func:`configure` turned tracing on; None: off (the no-op path)."""
_provider: Any = None

EXPORT_TIMEOUT_SECONDS = 2.0
"""Longest one export may take, retries included, unless ``OTEL_EXPORTER_OTLP_TIMEOUT`` (or its
``_TRACES_`` twin) says otherwise: a collector that accepts connections and never answers holds the
exporter's own thread this long, never a step."""
PAUSE_SECONDS = 30.0
"""After a failed export, batches are dropped this long without a try (a dead collector costs nothing)."""
SHUTDOWN_SECONDS = 3.0
"""Longest the end-of-process flush (:func:`shutdown`) waits for the spans still queued."""


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
    # the sampler: OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG; the exit's flush is ours, bounded
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    exporter = BestEffortExporter(_exporter(endpoint), endpoint or "the OTEL_* collector")
    provider.add_span_processor(BatchSpanProcessor(exporter))
    _provider, _tracer = provider, provider.get_tracer("grpc-ps")
    trace.set_tracer_provider(provider)
    atexit.register(shutdown)
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

            return HttpExporter(endpoint=endpoint or None, timeout=_export_timeout())
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        insecure = True if endpoint.startswith("http://") else None
        return OTLPSpanExporter(endpoint=endpoint or None, insecure=insecure, timeout=_export_timeout())
    except ImportError as exc:
        raise TracingUnavailableError(
            f"The {kind} span exporter is not installed ({exc}); install it with: {INSTALL_HINT}"
        ) from exc


def _export_timeout() -> float | None:
    """:data:`EXPORT_TIMEOUT_SECONDS`, or None where ``OTEL_*`` sets the exporter's timeout (the SDK reads it)."""
    named = ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
    return None if any(os.environ.get(n, "").strip() for n in named) else EXPORT_TIMEOUT_SECONDS


class BestEffortExporter:
    """A span exporter that never makes tracing anyone's problem but its own thread's.

    A failed export (an error, a refusal, a deadline) logs one WARNING per process, naming the
    collector and why; then batches are dropped for :data:`PAUSE_SECONDS` without a try, so the batch
    processor's queue never fills (the SDK would log every span it drops) and the end-of-process flush
    drops what is left at once. The wrapped exporter's own log lines are kept out (the WARNING says it).

    Args:
        inner: the SDK's exporter (OTLP gRPC or HTTP, console).
        where: the collector, for the message.
    """

    def __init__(self, inner: Any, where: str) -> None:
        self.inner, self.where = inner, where
        self.paused_until = 0.0
        self.warned = False
        self.dropped = 0
        self._said: list[str] = []
        for cls in type(inner).__mro__:  # the exporter's modules log each failure; the WARNING says it once
            if cls.__module__.startswith("opentelemetry.exporter"):
                logging.getLogger(cls.__module__).addFilter(self._keep_out)
        logging.getLogger("opentelemetry.sdk._shared_internal").addFilter(self._keep_out)

    def _keep_out(self, record: logging.LogRecord) -> bool:
        if len(self._said) < 4:
            self._said.append(record.getMessage().split("\n", 1)[0][:300])
        return False

    def export(self, spans: Any) -> Any:
        """Export ``spans`` unless paused; a failure pauses exports and warns once."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        if time.monotonic() < self.paused_until:
            self.dropped += len(spans)
            return SpanExportResult.FAILURE
        self._said.clear()
        try:
            result = self.inner.export(spans)
            why = "" if result == SpanExportResult.SUCCESS else "; ".join(self._said) or "refused"
        except Exception as exc:  # an exporter's bug must not reach the batch processor's thread either
            result, why = SpanExportResult.FAILURE, f"{type(exc).__name__}: {exc}"
        if why:
            self.paused_until = time.monotonic() + PAUSE_SECONDS
            self.dropped += len(spans)
            if not self.warned:
                self.warned = True
                log.warning(
                    "tracing: spans could not be exported to %s (%s); they are dropped while it fails (tried again "
                    "every %.0f s), and training goes on",
                    self.where,
                    why,
                    PAUSE_SECONDS,
                )
        return result

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        if "timeout_millis" in inspect.getfullargspec(self.inner.shutdown).args:
            self.inner.shutdown(timeout_millis=timeout_millis)
        else:
            self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis))


def shutdown(within: float = SHUTDOWN_SECONDS) -> None:
    """Export the spans still queued and stop (at the process's end), waiting at most ``within``
    seconds: what is not out by then is dropped, with a WARNING. Idempotent."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is None:
        return
    flush = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
    try:
        flush.start()
    except RuntimeError:  # no new thread while the interpreter finalizes (an atexit call on 3.12+)
        provider.shutdown()
        return
    flush.join(within)
    if flush.is_alive():
        log.warning("tracing: the spans still queued were not exported within %.0f s; dropped", within)


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
