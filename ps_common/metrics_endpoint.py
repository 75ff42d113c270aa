"""The ``/metrics`` HTTP endpoint shards and workers both serve (prometheus-client's WSGI server)."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` HTTP server; :meth:`close` stops it."""

    url: str
    port: int
    _server: WSGIServer
    _thread: threading.Thread

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=5)
        self._server.server_close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsEndpoint:
    """Serve ``registry`` as Prometheus text on ``http://host:port/metrics`` in a daemon thread.

    Args:
        registry: what to expose.
        host: address to bind (the process's ``--host``).
        port: TCP port; 0 picks a free one (read it back from ``.port``).

    Raises:
        RuntimeError: the address could not be bound.
    """
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise RuntimeError(
            f"Could not serve metrics on {host}:{port} ({exc.strerror or exc}); "
            "pass --metrics-port 0 for a free port or -1 to turn metrics off."
        ) from exc
    bound = server.server_port
    dial = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)
    netloc = f"[{dial}]:{bound}" if ":" in dial else f"{dial}:{bound}"
    log.info("metrics on http://%s/metrics", netloc)
    return MetricsEndpoint(url=f"http://{netloc}/metrics", port=bound, _server=server, _thread=thread)
