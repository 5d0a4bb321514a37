"""``backroom health``: ready once the metrics answer and the process has published on the bus."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server
from typer.testing import CliRunner

from backroom.bus.broker import free_port
from backroom.cli import app
from backroom.health import check, main, metrics_url


@pytest.fixture
def endpoint() -> Iterator[tuple[int, Counter]]:
    """A metrics endpoint of its own (the process-wide registry holds other tests' counts)."""
    registry = CollectorRegistry()
    bus = Counter(
        "backroom_bus_messages_total", "MQTT messages", ["direction", "role"], registry=registry
    )
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    yield port, bus
    server.shutdown()
    thread.join(5)


def test_ready_only_once_the_process_has_published(endpoint: tuple[int, Counter]) -> None:
    port, bus = endpoint
    bus.labels(direction="in", role="agent").inc(5)  # reading is not enough
    ok, why = check(port)
    assert not ok and "not on the bus" in why
    assert check(port, bus=False)[0]  # a runner or trainer: the endpoint is enough
    bus.labels(direction="out", role="agent").inc()
    assert check(port) == (True, "ready: 1 messages published")
    assert main(["--metrics-port", str(port), "-q"]) == 0
    result = CliRunner().invoke(app, ["health", "--metrics-port", str(port)])
    assert result.exit_code == 0, result.output


def test_not_ready_when_nothing_answers() -> None:
    port = free_port()
    ok, why = check(port)
    assert not ok and "does not answer" in why
    assert main(["--metrics-port", str(port), "-q"]) == 1
    assert CliRunner().invoke(app, ["health", "--metrics-port", str(port)]).exit_code == 1
    assert not check(None)[0]


def test_url_mode_wants_2xx(endpoint: tuple[int, Counter]) -> None:
    port, _ = endpoint
    assert check(url=f"http://127.0.0.1:{port}/metrics")[0]
    assert not check(url=f"http://127.0.0.1:{free_port()}/healthz")[0]


def test_metrics_url_follows_the_bind_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BACKROOM_METRICS_HOST", "0.0.0.0")
    assert metrics_url(9100) == "http://127.0.0.1:9100/metrics"
    monkeypatch.setenv("BACKROOM_METRICS_HOST", "10.0.0.7")
    assert metrics_url(9100) == "http://10.0.0.7:9100/metrics"
    monkeypatch.delenv("BACKROOM_METRICS_HOST")
    assert metrics_url(9100) == "http://127.0.0.1:9100/metrics"
    assert metrics_url(9100, "::1") == "http://[::1]:9100/metrics"
