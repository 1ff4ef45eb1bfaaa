"""The operator's plain keep-alive GETs (``leanhttp.py``), against real HTTP servers.

Behaviours: a configuration with a proxy, a TLS server name or a hostname override gets no
getter (the client stays in charge); an ``http`` and an ``https`` host get one, the latter
verifying with the configured CA; a keep-alive connection the server dropped is replaced and the
GET sent once more; a server that keeps failing raises. (The key reads through it, and their
403 / 404 handling, are exercised on the real API server by the operator tests.)
"""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from tokenfair_operator.leanhttp import LeanGetter


def configuration(**changes: object) -> SimpleNamespace:
    base: dict[str, object] = {
        "host": "https://127.0.0.1:6443",
        "proxy": None,
        "tls_server_name": None,
        "assert_hostname": None,
        "verify_ssl": True,
        "ssl_ca_cert": None,
        "cert_file": None,
        "key_file": None,
    }
    return SimpleNamespace(**(base | changes))


def test_only_configurations_it_honours_get_a_getter() -> None:
    assert LeanGetter.from_configuration(None, 1.0) is None
    assert LeanGetter.from_configuration(configuration(proxy="http://proxy:3128"), 1.0) is None
    assert LeanGetter.from_configuration(configuration(tls_server_name="api"), 1.0) is None
    assert LeanGetter.from_configuration(configuration(host="https://h:1/prefix"), 1.0) is None
    getter = LeanGetter.from_configuration(configuration(), 1.0)
    assert getter is not None
    assert (getter.scheme, getter.host, getter.port) == ("https", "127.0.0.1", 6443)
    assert getter.context is not None
    plain = LeanGetter.from_configuration(configuration(host="http://localhost"), 1.0)
    assert plain is not None
    assert (plain.port, plain.context) == (80, None)


class DroppingHandler(http.server.BaseHTTPRequestHandler):
    """Answers with keep-alive, then drops every second connection after its answer."""

    protocol_version = "HTTP/1.1"
    served = 0

    def do_GET(self) -> None:
        type(self).served += 1
        body = f'{{"path": "{self.path}"}}'.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = type(self).served % 2 == 1  # silently: no Connection: close

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def dropping_server() -> Iterator[int]:
    DroppingHandler.served = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), DroppingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_a_dropped_keep_alive_connection_is_replaced(dropping_server: int) -> None:
    getter = LeanGetter.from_configuration(
        configuration(host=f"http://127.0.0.1:{dropping_server}"), 5.0
    )
    assert getter is not None
    try:
        for n in range(4):  # every second connection is dropped after its answer
            status, _, body = getter.get("/api/v1/x", [("resourceVersion", "0")], {})
            assert (status, body) == (200, b'{"path": "/api/v1/x?resourceVersion=0"}'), n
    finally:
        getter.close()
    assert DroppingHandler.served == 4


def test_a_server_that_is_gone_raises() -> None:
    getter = LeanGetter.from_configuration(configuration(host="http://127.0.0.1:9"), 1.0)
    assert getter is not None
    with pytest.raises(ConnectionRefusedError):
        getter.get("/", [], {})
