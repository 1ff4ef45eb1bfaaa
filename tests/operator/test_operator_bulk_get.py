"""The operator's plain keep-alive GETs (``bulk_get.py``), against real HTTP servers.

Behaviours: a configuration with a proxy, a TLS server name or a hostname override gets no
getter (the client stays in charge); an ``http`` and an ``https`` host get one, the latter
verifying with the configured CA; a keep-alive connection the server dropped is replaced and the
GET sent once more; a server that keeps failing raises. Reads in bulk (``get_many``) are
pipelined: the next GET is written before the first is answered (the server checks), answers
come back in order whether sized or chunked, a 404 among them; a connection the server closes
mid-pipeline (``Connection: close``, or silently) is replaced and the unanswered GETs sent again
on it; an idle connection is reused, unless idle for over ``IDLE_CLOSE_S`` (an injected clock);
idle connections all closed by the server (its idle timeout, a restart) are replaced, not
raised; interim ``1xx`` answers are skipped; a malformed answer raises ``ProtocolError`` and
any failure drops its connection. The key reads through it (``KubeApi.key_hashes_many``, on a
recording server): at the resourceVersion asked (``fresh_version``'s, ``0``, none), the rest
of a chunk by quorum after a 504, and an answer for another Secret raises. (Their 403 / 404
handling on the real API server is exercised by the operator tests.)
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import socket
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import ClassVar

import pytest
from kubernetes import client
from kubernetes.client import ApiException

from tokenfair_operator.bulk_get import IDLE_CLOSE_S, LeanGetter, ProtocolError, _Pipe
from tokenfair_operator.kube import KubeApi
from tokenfair_operator.render import KeyLookup, KeyProblem


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


def http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """A threading HTTP server on a free loopback port for the fixtures: its port, then shut."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def dropping_server() -> Iterator[int]:
    DroppingHandler.served = 0
    yield from http_server(DroppingHandler)


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
    yield from http_server(PipelineHandler)


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


class RawServer:
    """A loopback HTTP/1.1 server over raw sockets: each connection's requests are answered in
    turn by ``answer(target)`` (bytes written as given: interim answers, malformed heads);
    records ``(connection number, request line)``; :meth:`drop_connections` closes every
    connection, as an API server's idle timeout or restart does."""

    def __init__(self, answer: Callable[[str], bytes]) -> None:
        self.answer = answer
        self.requests: list[tuple[int, str]] = []
        self.connections: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(connection)
            number = len(self.connections)
            threading.Thread(target=self._serve, args=(connection, number), daemon=True).start()

    def _serve(self, connection: socket.socket, number: int) -> None:
        buffer = b""
        with connection:
            while True:
                while b"\r\n\r\n" not in buffer:
                    try:
                        data = connection.recv(1 << 16)
                    except OSError:
                        return
                    if not data:
                        return
                    buffer += data
                head, _, buffer = buffer.partition(b"\r\n\r\n")
                line = head.split(b"\r\n")[0].decode()
                self.requests.append((number, line))
                try:
                    connection.sendall(self.answer(line.split(" ")[1]))
                except OSError:
                    return

    def drop_connections(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.drop_connections()


@contextlib.contextmanager
def raw_server(answer: Callable[[str], bytes]) -> Iterator[RawServer]:
    server = RawServer(answer)
    try:
        yield server
    finally:
        server.close()


def ok(body: bytes, *, status: str = "200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(body), body)


def test_get_many_goes_on_when_every_idle_connection_was_closed() -> None:
    """Two calls at once leave two idle connections; the server closes both (its idle timeout,
    a restart); the next call replaces them instead of raising."""
    both_asked = threading.Barrier(2, timeout=10)

    def answer(target: str) -> bytes:
        if target.startswith("/hold"):
            both_asked.wait()  # two calls, two connections
        return ok(target.encode())

    with raw_server(answer) as server:
        getter = LeanGetter("http", "127.0.0.1", server.port, None, 10.0)
        try:
            calls = [
                threading.Thread(target=getter.get_many, args=([f"/hold{n}", "/x"], {}))
                for n in range(2)
            ]
            for call in calls:
                call.start()
            for call in calls:
                call.join()
            assert len(getter._idle) == 2
            server.drop_connections()
            assert getter.get_many(["/a", "/b"], {}) == [(200, b"/a"), (200, b"/b")]
            assert len(getter._idle) == len(getter._pipes) == 1  # the dead ones dropped
            assert getter.get_many(["/c"], {}) == [(200, b"/c")]
        finally:
            getter.close()
    assert [n for n, line in server.requests if line.startswith("GET /a ")] == [3]
    assert len(server.connections) == 3


def test_an_idle_connection_is_closed_after_a_minute() -> None:
    now = [1000.0]
    with raw_server(lambda target: ok(target.encode())) as server:
        getter = LeanGetter("http", "127.0.0.1", server.port, None, 10.0, clock=lambda: now[0])
        try:
            getter.get_many(["/1"], {})
            now[0] += IDLE_CLOSE_S  # idle a minute: still reused
            getter.get_many(["/2"], {})
            now[0] += IDLE_CLOSE_S + 0.1  # idle longer: closed, a new one opened
            getter.get_many(["/3"], {})
            assert len(getter._pipes) == len(getter._idle) == 1
        finally:
            getter.close()
    assert [n for n, _ in server.requests] == [1, 1, 2]
    assert IDLE_CLOSE_S < 90  # kube-apiserver's IdleTimeout


def test_interim_answers_are_skipped() -> None:
    def answer(target: str) -> bytes:
        hints = b"HTTP/1.1 103 Early Hints\r\nLink: </x>; rel=preload\r\n\r\n"
        return hints + b"HTTP/1.1 100 Continue\r\n\r\n" + ok(target.encode())

    with raw_server(answer) as server:
        getter = LeanGetter("http", "127.0.0.1", server.port, None, 10.0)
        try:
            targets = [f"/{n}" for n in range(20)]
            assert getter.get_many(targets, {}, depth=4) == [(200, t.encode()) for t in targets]
        finally:
            getter.close()


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2x\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: -2\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\n{}",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    ],
)
def test_a_malformed_answer_raises_a_protocol_error_and_drops_the_connection(
    head: bytes,
) -> None:
    with raw_server(lambda target: head) as server:
        getter = LeanGetter("http", "127.0.0.1", server.port, None, 10.0)
        try:
            with pytest.raises(ProtocolError):
                getter.get_many(["/a", "/b"], {})
            assert (getter._pipes, getter._idle) == ([], [])
        finally:
            getter.close()
    assert len(server.connections) == 2  # a new connection failing twice: given up


def test_any_failure_drops_the_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: object) -> tuple[int, bytes, bool]:
        raise RuntimeError("a parser fault")

    with raw_server(lambda target: ok(b"{}")) as server:
        getter = LeanGetter("http", "127.0.0.1", server.port, None, 10.0)
        monkeypatch.setattr(_Pipe, "answer", broken)
        try:
            with pytest.raises(RuntimeError):
                getter.get_many(["/a"], {})
            assert (getter._pipes, getter._idle) == ([], [])
        finally:
            getter.close()


VERSION_NOW = "4242"


class FakeSecrets:
    """What the API server answers the key reads: the LIST of fresh_version (at
    :data:`VERSION_NOW`) and Secrets ``ns/<name>`` with key ``sk-<name>``. ``behind``: Secrets
    the watch cache has not reached at VERSION_NOW (the first such read answers 504, a later
    one at that version 500: a client that waits its turn after a 504 fails); ``wrong``:
    answered with another Secret's body; ``hints``: each answer after a ``103``."""

    def __init__(self) -> None:
        self.behind: set[str] = set()
        self.wrong: set[str] = set()
        self.hints = False
        self.waited = False

    def __call__(self, target: str) -> bytes:
        path, _, query = target.partition("?")
        hint = b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n" if self.hints else b""
        if path.endswith("/tenantquotas"):
            return hint + ok(json.dumps({"metadata": {"resourceVersion": VERSION_NOW}}).encode())
        name = path.rsplit("/", 1)[1]
        if name in self.behind and query == f"resourceVersion={VERSION_NOW}":
            if self.waited:
                return ok(b"{}", status="500 Internal Server Error")
            self.waited = True
            return ok(b'{"reason": "Timeout"}', status="504 Gateway Timeout")
        if name == "missing":
            return hint + ok(b"{}", status="404 Not Found")
        shown = f"{name}-other" if name in self.wrong else name
        secret = {
            "metadata": {"name": shown, "namespace": "ns"},
            "data": {"k": base64.b64encode(f"sk-{shown}".encode()).decode()},
        }
        return hint + ok(json.dumps(secret).encode())


def digest(name: str) -> tuple[str]:
    return (hashlib.sha256(f"sk-{name}".encode()).hexdigest(),)


@pytest.fixture
def secrets_server() -> Iterator[tuple[KubeApi, FakeSecrets, RawServer]]:
    answers = FakeSecrets()
    with raw_server(answers) as server:
        api = KubeApi(
            client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{server.port}"))
        )
        assert api._lean is not None
        try:
            yield api, answers, server
        finally:
            api._lean.close()


def secret_lines(server: RawServer) -> list[str]:
    return [line for _, line in server.requests if "/secrets/" in line]


def test_key_reads_carry_the_asked_resource_version(
    secrets_server: tuple[KubeApi, FakeSecrets, RawServer],
) -> None:
    """The resync's reads are at the version fresh_version read (a watch cache that lags
    cannot answer them from before it); a pass's at ``0``; a quorum read at none."""
    api, _, server = secrets_server
    names = ["a", "b", "missing", "c"]
    secrets = [("ns", name) for name in names]
    version = api.fresh_version("ns", "a")
    assert version == VERSION_NOW
    server.requests.clear()
    expected = [digest("a"), digest("b"), KeyProblem("KeySecretNotFound", ""), digest("c")]

    def same(found: list[KeyLookup]) -> bool:
        return [getattr(f, "reason", f) for f in found] == [
            getattr(e, "reason", e) for e in expected
        ]

    assert same(api.key_hashes_many(secrets, version))
    base = "GET /api/v1/namespaces/ns/secrets"
    assert secret_lines(server) == [
        f"{base}/{n}?resourceVersion={VERSION_NOW} HTTP/1.1" for n in names
    ]
    server.requests.clear()
    assert same(api.key_hashes_many(secrets))
    assert secret_lines(server) == [
        *(f"{base}/{n}?resourceVersion=0 HTTP/1.1" for n in names),
        f"{base}/missing HTTP/1.1",  # a 404 of the watch cache asked again of etcd
    ]
    server.requests.clear()
    assert same(api.key_hashes_many(secrets, ""))
    assert secret_lines(server) == [f"{base}/{n} HTTP/1.1" for n in names]


def test_after_a_504_the_rest_is_read_by_quorum(
    secrets_server: tuple[KubeApi, FakeSecrets, RawServer],
) -> None:
    api, answers, server = secrets_server
    names = [f"s{n}" for n in range(6)]
    answers.behind = set(names[2:])
    found = api.key_hashes_many([("ns", name) for name in names], VERSION_NOW)
    assert found == [digest(name) for name in names]
    quorum = sorted(line.split()[1] for line in secret_lines(server) if "?" not in line)
    assert quorum == [f"/api/v1/namespaces/ns/secrets/{name}" for name in names[2:]]


def test_an_answer_for_another_secret_raises(
    secrets_server: tuple[KubeApi, FakeSecrets, RawServer],
) -> None:
    api, answers, _ = secrets_server
    answers.hints = True  # skipped: the answers stay in step
    assert api.key_hashes_many([("ns", "a"), ("ns", "b")]) == [digest("a"), digest("b")]
    answers.wrong = {"b"}
    with pytest.raises(ApiException) as raised:
        api.key_hashes_many([("ns", "a"), ("ns", "b")])
    assert raised.value.status == 0
    assert "ns/b-other" in str(raised.value.reason)


def test_a_malformed_answer_to_a_key_read_is_an_api_exception() -> None:
    with raw_server(lambda target: b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n") as server:
        api = KubeApi(
            client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{server.port}"))
        )
        assert api._lean is not None
        try:
            with pytest.raises(ApiException) as raised:
                api.key_hashes_many([("ns", "a")])
        finally:
            api._lean.close()
    assert raised.value.status == 0
