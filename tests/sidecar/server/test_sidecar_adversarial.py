"""A standing adversarial suite: hypothesis-generated bodies and headers against a real
``tokenfair sidecar`` process on loopback, with both backends; for ``openai``, in front of a
misbehaving upstream that picks a fault per request (the body's ``model``).

After every generated request, the invariants of issue 11:

* no 5xx from the sidecar, except ``502``/``504`` when the upstream misbehaved;
* exactly one record per request that reached admission (the answer carries ``x-request-id``),
  with the outcome the client saw: its status, or ``502 upstream_aborted`` when the client's
  transfer broke off after a ``200``; none for a request refused before admission;
* the books (queued requests, tokens and KV, running requests, resident KV) back to zero;
* the process's RSS within :data:`RSS_GROWTH_BOUND_MIB` of its first reading (taken once the
  sidecar is ready). The generated bodies include large ones (up to the ``maxBodyBytes`` of
  1 MiB, and just over it), and :func:`test_large_bodies_do_not_accumulate` sends
  :data:`LARGE_BODIES` bodies of 1 MiB to each sidecar: a leak of the bodies (or of what is
  parsed from them) would pass the bound several times over, while allocator noise (freed
  1 MiB buffers glibc keeps) stays well under it.

The sidecars and the upstream are started once per test; ``max_examples`` keeps the file under
a minute on a busy 2-core machine (``deadline=None``: a loaded machine is slow, not wrong).
Examples are derandomized (the same on every run: a failure reproduces), and each sidecar's
stderr goes to a file under ``tmp_path`` (shown when the sidecar fails to start).
"""

from __future__ import annotations

import contextlib
import gzip
import http.client
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from loopback_support import free_ports
from sidecar_support import KEYS, keyed_config

from tokenfair.config import config_to_document

TOKENFAIR = Path(sys.executable).with_name("tokenfair")
RSS_GROWTH_BOUND_MIB = 64
"""RSS growth allowed over the sidecar's first reading (measured: ~1 MiB after 200 bodies of
1 MiB; a leak of them would be 200 MiB)."""
MAX_BODY_BYTES = 1 << 20
LARGE_BODIES = 200
"""1 MiB bodies of :func:`test_large_bodies_do_not_accumulate`: 200 MiB if they leaked."""
KEY = f"Bearer {KEYS['tenant_chat_pro']}"
ZERO_BOOKS = {
    "queued_requests": 0,
    "queued_service_tokens": 0,
    "queued_kv_blocks": 0,
    "running_requests": 0,
    "resident_kv_blocks": 0,
}
EXAMPLES = 150

# -- the misbehaving upstream ----------------------------------------------------------------------

USAGE = b'"usage":{"prompt_tokens":9,"completion_tokens":3,"total_tokens":12}'
OK_JSON = b'{"id":"x","object":"chat.completion","choices":[],' + USAGE + b"}"


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _json_reply(body: bytes, *headers: str) -> bytes:
    extra = "".join(f"{h}\r\n" for h in headers)
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{extra}"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: close\r\n\r\n"
)
SSE_EVENT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"w"}}]}\n\n'
FAULTS: dict[str, bytes | None] = {
    "ok": _json_reply(OK_JSON),
    "stream": SSE_HEAD
    + _chunk(SSE_EVENT)
    + _chunk(b'data: {"id":"c","choices":[],' + USAGE + b"}\n\n")
    + _chunk(b"data: [DONE]\n\n")
    + b"0\r\n\r\n",
    "cut": SSE_HEAD + _chunk(SSE_EVENT) * 3,  # then the connection closes mid-stream
    "bad_usage": _json_reply(
        b'{"choices":[],"usage":{"prompt_tokens":-5,"completion_tokens":1e400}}'
    ),
    "gzip": _json_reply(gzip.compress(OK_JSON), "Content-Encoding: gzip"),
    "huge_header": b"HTTP/1.1 200 OK\r\nx-pad: " + b"v" * (100 << 10) + b"\r\n",
    "garbage": b"NOT HTTP AT ALL\r\n\r\n",
    "reset": None,  # closed with a reset before answering
    "slow": b"",  # never answers: the sidecar's read timeout (0.3 s here)
}
UPSTREAM_FAULTS = frozenset({"cut", "huge_header", "garbage", "reset", "slow"})


class _FaultHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(5)
        data = b""
        while b"\r\n\r\n" not in data:
            more = sock.recv(65536)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            more = sock.recv(65536)
            if not more:
                return
            body += more
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            model = None
        reply = FAULTS.get(model if isinstance(model, str) else "", FAULTS["ok"])
        if reply is None:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        elif reply == b"":
            time.sleep(1.0)
        else:
            # The sidecar may drop the connection mid-reply (a head too large): what it should do.
            with contextlib.suppress(OSError):
                sock.sendall(reply)


@pytest.fixture(scope="module")
def faulty_upstream() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _FaultHandler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# -- the sidecar process ---------------------------------------------------------------------------


@dataclass
class Sidecar:
    process: subprocess.Popen[bytes]
    port: int
    admin_port: int
    records: Path
    stderr: Path
    read_records: int = 0
    rss_at_start_mib: float = 0.0

    def get(self, path: str) -> Any:
        connection = http.client.HTTPConnection("127.0.0.1", self.admin_port, timeout=10)
        try:
            connection.request("GET", path)
            return json.loads(connection.getresponse().read())
        finally:
            connection.close()

    def books(self) -> dict[str, int]:
        """The books once zero, or as they are after 5 s (KV is held a few scaled ms)."""
        deadline = time.monotonic() + 5
        while True:
            books: dict[str, int] = self.get("/status")["books"]
            if books == ZERO_BOOKS or time.monotonic() > deadline:
                return books
            time.sleep(0.005)

    def new_records(self, count: int) -> list[dict[str, Any]]:
        """The records written since the last call, once there are ``count`` (or after 5 s:
        then whatever there is, for the assertion to show)."""
        deadline = time.monotonic() + 5
        while True:
            lines = self.complete_lines()
            fresh = lines[self.read_records :]
            if len(fresh) >= count or time.monotonic() > deadline:
                break
            time.sleep(0.005)
        if count == 0:
            time.sleep(0.02)  # a stray record would be written within the request's turn
            lines = self.complete_lines()
            fresh = lines[self.read_records :]
        self.read_records += len(fresh)
        return [json.loads(line) for line in fresh]

    def complete_lines(self) -> list[str]:
        """The records file's whole lines (one being written has no newline yet: left out)."""
        text = self.records.read_text() if self.records.exists() else ""
        return text.split("\n")[:-1]

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def assert_rss_bounded(self) -> None:
        growth = self.rss_mib() - self.rss_at_start_mib
        assert growth < RSS_GROWTH_BOUND_MIB, (
            f"RSS grew {growth:.1f} MiB over its first reading of {self.rss_at_start_mib:.1f} MiB"
        )


def _start(
    tmp_path: Path, backend: list[str], upstream_read_timeout_s: float = 0.3
) -> Iterator[Sidecar]:
    document = config_to_document(keyed_config())
    document["sidecar"] = {
        "upstreamReadTimeoutSeconds": upstream_read_timeout_s,
        "maxBodyBytes": MAX_BODY_BYTES,
        "clientBodyTimeoutSeconds": 2,
    }
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    port, admin_port = free_ports(2)
    records = tmp_path / "records.jsonl"
    stderr = tmp_path / "sidecar.stderr"
    with stderr.open("wb") as errors:  # a file, not a pipe: nobody reads it while it runs
        process = subprocess.Popen(
            [str(TOKENFAIR), "sidecar", "--config", str(config), "--listen", f"127.0.0.1:{port}",
             "--admin-listen", f"127.0.0.1:{admin_port}", "--time-scale", "0.001",
             "--records", str(records), "--log-level", "WARNING", *backend],
            stdout=subprocess.DEVNULL, stderr=errors,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    sidecar = Sidecar(process, port, admin_port, records, stderr)
    try:
        for _ in range(400):
            assert process.poll() is None, stderr.read_text(errors="replace")
            try:
                sidecar.get("/status")
                break
            except (OSError, ValueError):
                time.sleep(0.05)
        else:
            raise AssertionError(
                "the sidecar did not become ready in 20 s:\n" + stderr.read_text(errors="replace")
            )
        sidecar.rss_at_start_mib = sidecar.rss_mib()
        yield sidecar
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def costmodel_sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    yield from _start(tmp_path, [])


@pytest.fixture
def openai_sidecar(tmp_path: Path, faulty_upstream: str) -> Iterator[Sidecar]:
    yield from _start(tmp_path, ["--backend", "openai", "--upstream", faulty_upstream,
                                 "--engine-metrics", "off"])  # fmt: skip


# -- generated requests ----------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)  # fmt: skip
odd_numbers = st.one_of(
    st.integers(-5, 10),
    st.integers(min_value=10**6, max_value=10**20),
    st.floats(allow_nan=False),
    st.text(max_size=3),
    st.booleans(),
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "tool", "system"])},
        optional={
            "content": st.text(max_size=50) | json_values,
            "name": st.text(max_size=10) | json_values,
            "tool_calls": json_values,
        },
    )
    | json_values,
    max_size=4,
)


def openai_like(models: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries(
        {"model": models},
        optional={
            "messages": messages,
            "prompt": st.text(max_size=80) | json_values,
            "max_tokens": odd_numbers,
            "max_completion_tokens": odd_numbers,
            "n": odd_numbers,
            "best_of": odd_numbers,
            "stream": st.booleans() | json_values,
            "stream_options": json_values,
            "tools": json_values,
            "response_format": json_values,
            "tool_choice": json_values,
            "extra": json_values,
        },
    )


def valid_chat(models: st.SearchStrategy[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A request every check passes (so that it reaches admission and the upstream)."""
    return st.fixed_dictionaries(
        {
            "model": models,
            "messages": st.lists(
                st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=40)}),
                min_size=1, max_size=3,
            ),
            "max_tokens": st.integers(1, 64),
            "stream": st.booleans(),
        },
        optional={"n": st.integers(1, 3), "stream_options": st.just({"include_usage": True})},
    )  # fmt: skip


def bodies(models: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    valid = valid_chat(models).map(lambda body: json.dumps(body).encode())
    as_json = openai_like(models).map(lambda body: json.dumps(body).encode())
    deep = st.integers(1, 200).map(lambda depth: b'{"model":"ok","x":' + b"[" * depth
                                   + b"]" * depth + b"}")  # fmt: skip
    return st.one_of(valid, valid, valid, as_json, as_json, st.binary(max_size=64), json_values.map(
        lambda value: json.dumps(value).encode()), deep, large_bodies(models))  # fmt: skip


class LargeBody(bytes):
    """A body whose repr is short (hypothesis shows a failing example's arguments)."""

    def __repr__(self) -> str:
        return f"large_body({self[:40]!r}..., {len(self)} bytes)"


def large_body(model: str, size: int) -> bytes:
    """A valid chat body of ``size`` bytes (at least ~100), padded in ``user`` (a field the
    estimate does not read: the request is admitted and reaches the upstream whole)."""
    head = b'{"model":' + json.dumps(model).encode()
    head += b',"max_tokens":1,"messages":[{"role":"user","content":"hi"}],"user":"'
    return LargeBody(head + b"x" * max(0, size - len(head) - 2) + b'"}')


def large_bodies(models: st.SearchStrategy[str]) -> st.SearchStrategy[bytes]:
    """Bodies up to ``maxBodyBytes`` and just over it (a 413)."""
    sizes = st.integers(MAX_BODY_BYTES // 2, MAX_BODY_BYTES + 1024)
    return st.builds(large_body, models, sizes)


header_names = st.text(
    "abcdefghijklmnopqrstuvwxyz-0123456789", min_size=1, max_size=12
).filter(lambda name: name not in {"content-length", "transfer-encoding", "host",
                                   "connection", "authorization", "upgrade"})  # fmt: skip
"""Header names the client library itself sets or frames with are left out; ``expect`` is not
(an ``Expect`` the sidecar does not support is its 417, ``100-continue`` its ``100``)."""
header_values = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
hostile_headers = st.dictionaries(
    header_names
    | st.sampled_from(["x-tokenfair-priority", "content-encoding", "x-request-id", "te", "expect"]),
    header_values | st.just("100-continue"),
    max_size=4,
)
keys = st.sampled_from([KEY, KEY, KEY, "Bearer sk-wrong", ""])


@dataclass
class Seen:
    status: int
    request_id: str | None
    broken: bool  # the transfer broke off after the status line


def send(sidecar: Sidecar, path: str, body: bytes, headers: dict[str, str], key: str) -> Seen:
    connection = http.client.HTTPConnection("127.0.0.1", sidecar.port, timeout=30)
    try:
        all_headers = {**headers, "Content-Type": "application/json"}
        if key:
            all_headers["Authorization"] = key
        try:
            connection.request("POST", path, body=body, headers=all_headers)
        except (BrokenPipeError, ConnectionResetError):
            # With an `Expect` header the sidecar answers before reading the body (417, or its
            # 401/413/503 instead of `100 Continue`) and closes: a client still sending a large
            # body breaks off. Nothing was admitted; read the answer if it is still there.
            if not any(name.lower() == "expect" for name in headers):
                raise
            try:
                response = connection.getresponse()
            except (http.client.HTTPException, ConnectionError):
                event("answered before the body was sent; the answer was lost with the reset")
                return Seen(0, None, broken=False)
            return Seen(response.status, response.getheader("x-request-id"), broken=False)
        response = connection.getresponse()
        broken = False
        try:
            response.read()
        except (http.client.IncompleteRead, ConnectionError):
            broken = True
        return Seen(response.status, response.getheader("x-request-id"), broken)
    finally:
        connection.close()


def check_invariants(sidecar: Sidecar, seen: Seen, upstream_fault: bool) -> None:
    event(f"status {seen.status}{' broken' if seen.broken else ''}")  # --hypothesis-show-statistics
    allowed_5xx = {502, 504} if upstream_fault else set()
    assert seen.status < 500 or seen.status in allowed_5xx, seen
    records = sidecar.new_records(1 if seen.request_id else 0)
    if seen.request_id is None:
        assert records == [], records  # refused before admission: no record
    else:
        assert [r["request_id"] for r in records] == [seen.request_id]
        record = records[0]
        if seen.broken:
            assert (record["status_code"], record["reason"]) == (502, "upstream_aborted")
        else:
            assert record["status_code"] == seen.status, (record, seen)
    assert sidecar.books() == ZERO_BOOKS


PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions"])
SUITE = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@SUITE
@given(path=PATHS, body=bodies(st.text(max_size=5)), headers=hostile_headers, key=keys)
def test_costmodel_sidecar_under_hostile_requests(
    costmodel_sidecar: Sidecar, path: str, body: bytes, headers: dict[str, str], key: str
) -> None:
    seen = send(costmodel_sidecar, path, body, headers, key)
    check_invariants(costmodel_sidecar, seen, upstream_fault=False)
    costmodel_sidecar.assert_rss_bounded()


@SUITE
@given(path=PATHS, body=bodies(st.sampled_from(sorted(FAULTS))), headers=hostile_headers, key=keys)
def test_openai_sidecar_under_hostile_requests_and_a_faulty_upstream(
    openai_sidecar: Sidecar, path: str, body: bytes, headers: dict[str, str], key: str
) -> None:
    try:
        model = json.loads(body).get("model")
    except (ValueError, AttributeError):
        model = None
    seen = send(openai_sidecar, path, body, headers, key)
    check_invariants(openai_sidecar, seen, upstream_fault=model in UPSTREAM_FAULTS)
    openai_sidecar.assert_rss_bounded()


@SUITE
@given(
    path=PATHS,
    body=valid_chat(st.sampled_from(sorted(FAULTS))).map(lambda b: json.dumps(b).encode()),
    headers=st.dictionaries(header_names, header_values, max_size=2),
)
def test_openai_sidecar_with_valid_requests_and_every_upstream_fault(
    openai_sidecar: Sidecar, path: str, body: bytes, headers: dict[str, str]
) -> None:
    """Requests that pass every check of the sidecar, so each reaches the upstream's fault."""
    model = json.loads(body)["model"]
    event(f"fault {model}")
    seen = send(openai_sidecar, path, body, headers, KEY)
    check_invariants(openai_sidecar, seen, upstream_fault=model in UPSTREAM_FAULTS)
    openai_sidecar.assert_rss_bounded()


@pytest.mark.parametrize("backend", ["costmodel", "openai"])
def test_large_bodies_do_not_accumulate(tmp_path: Path, faulty_upstream: str, backend: str) -> None:
    """:data:`LARGE_BODIES` valid bodies of 1 MiB each, one after another (served, or refused
    by a gate): the RSS stays within :data:`RSS_GROWTH_BOUND_MIB` of its first reading. No
    fault of the upstream is asked for here, so its read timeout is long (the 0.3 s of the
    other tests, there for the ``slow`` fault, is a 504 when a loaded machine takes longer to
    move a 1 MiB body to the upstream and its answer back)."""
    flags = [] if backend == "costmodel" else [
        "--backend", "openai", "--upstream", faulty_upstream, "--engine-metrics", "off"
    ]  # fmt: skip
    for sidecar in _start(tmp_path, flags, upstream_read_timeout_s=30):
        for index in range(LARGE_BODIES):
            body = large_body("ok", MAX_BODY_BYTES - index)
            seen = send(sidecar, "/v1/chat/completions", body, {}, KEY)
            assert seen.status < 500, seen
        assert sidecar.books() == ZERO_BOOKS
        sidecar.assert_rss_bounded()
