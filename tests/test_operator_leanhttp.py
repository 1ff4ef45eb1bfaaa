"""The operator's plain keep-alive GETs (``leanhttp.py``), against real HTTP servers.

Behaviours: a configuration with a proxy, a TLS server name or a hostname override gets no
getter (the client stays in charge); an ``http`` and an ``https`` host get one, the latter
verifying with the configured CA; a keep-alive connection the server dropped is replaced and the
GET sent once more; a server that keeps failing raises. Reads in bulk (``get_many``) are
pipelined: the next GET is written before the first is answered (the server checks), answers
come back in order whether sized or chunked, a 404 among them; a connection the server closes
mid-pipeline (``Connection: close``, or silently) is replaced and the unanswered GETs sent again
on it; an idle connection is reused. (The key reads through it, and their 403 / 404 handling,
are exercised on the real API server by the operator tests.)
"""

from __future__ import annotations

import http.server
import io
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import ClassVar

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


class PipelineHandler(http.server.BaseHTTPRequestHandler):
    """Answers ``/n`` with ``n`` (alternately by Content-Length and chunked, ``/missing`` with a
    404), records what it served on which connection, and answers ``close_at`` with
    ``Connection: close``. Its first answer on a connection waits until the next request is
    there already: a client that does not write ahead fails by the socket timeout."""

    protocol_version = "HTTP/1.1"
    served: ClassVar[list[tuple[int, str]]] = []
    connections = 0
    close_at = ""
    pipelined: ClassVar[list[bool]] = []

    def setup(self) -> None:
        super().setup()
        type(self).connections += 1
        self.number = type(self).connections
        self.answered = 0

    def do_GET(self) -> None:
        if self.answered == 0 and self.path != self.close_at:
            self.connection.settimeout(5.0)
            assert isinstance(self.rfile, io.BufferedReader)
            try:
                type(self).pipelined.append(bool(self.rfile.peek(1)))
            except TimeoutError:
                type(self).pipelined.append(False)
        self.answered += 1
        type(self).served.append((self.number, self.path))
        status = 404 if self.path == "/missing" else 200
        body = self.path.encode()
        self.send_response(status)
        if self.path == self.close_at:
            self.send_header("Connection", "close")
            self.close_connection = True
        if len(type(self).served) % 2:
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            half = len(body) // 2
            for part in (body[:half], body[half:]):
                if part:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def pipeline_server() -> Iterator[int]:
    PipelineHandler.served = []
    PipelineHandler.pipelined = []
    PipelineHandler.connections = 0
    PipelineHandler.close_at = ""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), PipelineHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_get_many_pipelines_its_gets_on_one_connection(pipeline_server: int) -> None:
    getter = LeanGetter.from_configuration(
        configuration(host=f"http://127.0.0.1:{pipeline_server}"), 10.0
    )
    assert getter is not None
    targets = [f"/{n}" for n in range(40)] + ["/missing", "/40?resourceVersion=0"]
    try:
        answers = getter.get_many(targets, {"Accept": "application/json"}, depth=8)
        again = getter.get_many(["/a", "/b"], {})  # the same keep-alive connection
    finally:
        getter.close()
    assert answers == [(200, t.encode()) for t in targets[:40]] + [
        (404, b"/missing"),
        (200, b"/40?resourceVersion=0"),
    ]
    assert again == [(200, b"/a"), (200, b"/b")]
    assert PipelineHandler.connections == 1
    assert PipelineHandler.pipelined == [True]  # the second GET was written before the first
    assert [path for _, path in PipelineHandler.served] == [*targets, "/a", "/b"]


def test_get_many_sends_again_what_a_closed_connection_left_unanswered(
    pipeline_server: int,
) -> None:
    PipelineHandler.close_at = "/3"  # answered with Connection: close; /4.. written already
    getter = LeanGetter.from_configuration(
        configuration(host=f"http://127.0.0.1:{pipeline_server}"), 10.0
    )
    assert getter is not None
    targets = [f"/{n}" for n in range(10)]
    try:
        answers = getter.get_many(targets, {}, depth=8)
    finally:
        getter.close()
    assert answers == [(200, t.encode()) for t in targets]
    assert PipelineHandler.connections == 2
    assert PipelineHandler.served == [(1, t) for t in targets[:4]] + [(2, t) for t in targets[4:]]


def test_get_many_replaces_a_silently_dropped_connection(dropping_server: int) -> None:
    getter = LeanGetter.from_configuration(
        configuration(host=f"http://127.0.0.1:{dropping_server}"), 5.0
    )
    assert getter is not None
    targets = [f"/api/v1/x{n}" for n in range(6)]
    try:
        answers = getter.get_many(targets, {}, depth=4)
    finally:
        getter.close()
    assert answers == [(200, f'{{"path": "{t}"}}'.encode()) for t in targets]


def test_get_many_from_a_server_that_is_gone_raises() -> None:
    getter = LeanGetter.from_configuration(configuration(host="http://127.0.0.1:9"), 1.0)
    assert getter is not None
    with pytest.raises(ConnectionRefusedError):
        getter.get_many(["/"], {})
