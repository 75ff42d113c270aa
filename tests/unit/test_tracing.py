"""ps_common.tracing's switch and its no-op path (the exporting path: tests/e2e/test_tracing.py)."""

from __future__ import annotations

import pytest

from ps_common import tracing


@pytest.mark.parametrize(
    ("endpoint", "environ", "on"),
    [
        ("", {}, False),
        ("http://127.0.0.1:4317", {}, True),
        ("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True),
        ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, True),
        ("", {"OTEL_TRACES_EXPORTER": "console"}, True),
        ("", {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False),
        ("http://127.0.0.1:4317", {"OTEL_SDK_DISABLED": "true"}, False),
        ("", {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}, False),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_named(endpoint, environ, on) -> None:
    assert tracing.wanted(endpoint, environ) is on


def test_off_every_call_is_the_shared_no_op() -> None:
    assert not tracing.enabled()
    assert tracing.span("step", rank=0) is tracing.span("push_pull")
    assert tracing.server_span("ps.v1.ParameterService/PushPull", (("traceparent", "00-ab-cd-01"),)) is tracing.span(
        "x"
    )
    assert tracing.start("push_pull") is None
    assert tracing.headers() == () and tracing.traceparent() == ""
    with tracing.current(None), tracing.span("step") as s:
        assert s is None
    tracing.end(None)
    tracing.check_installed("")  # not wanted: nothing is looked up
