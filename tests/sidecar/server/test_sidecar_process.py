"""The sidecar as a real process (``tokenfair sidecar``) in front of a real stub upstream.

Behaviours: JSON passthrough with usage read from the response and settled (the tenant's key and
``x-tokenfair-*`` headers never reach the upstream); SSE streaming passed through byte for byte
with ``stream_options.include_usage`` added and the final usage chunk settled (and cut from what
the client, which did not ask for it, receives); upstream reset ->
502, refused -> 502, read timeout -> 504; a client leaving mid-stream aborts the upstream call;
graceful drain on SIGTERM (readiness 503, new requests 503, queued 503 + Retry-After, in-flight
finishes, records written, exit 0); the proxy listener's bounds (a connection over
``maxClientConnections`` answered 503 at once, with a long idle timeout so that nothing else can
close the held ones; idle and slow-header connections closed after
``clientIdleTimeoutSeconds``, in a sidecar of its own with a short one). After every fault the
books read from ``/status`` are zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import aiohttp
import pytest
import yaml
from aiohttp import web
from loopback_support import free_ports
from raw_upstream_support import connection_cut
from sidecar_support import CHAT, keyed_config, until_ready

from tokenfair.config import PolicyConfig, config_to_document
from tokenfair.records.codec import read_trace

TOKENFAIR = Path(sys.executable).with_name("tokenfair")
ZERO_BOOKS = {
    "queued_requests": 0,
    "queued_service_tokens": 0,
    "queued_kv_blocks": 0,
    "running_requests": 0,
    "resident_kv_blocks": 0,
}
STREAM_CHUNKS = 50
WAIT_S = 30.0
"""Upper bound for waiting on the sidecar's state (never reached when all is well)."""


# -- the stub upstream ------------------------------------------------------------------------


@dataclass
class Stub:
    """A small OpenAI-compatible server whose behaviour the request's ``model`` picks."""

    url: str = ""
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    sent: list[bytes] = field(default_factory=list)
    targets: list[str] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.targets.append(request.raw_path)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        model = body["model"]
        if model == "ok":
            return web.json_response(
                {"id": "x", "object": "chat.completion", "choices": [],
                 "usage": {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}},
                headers={"x-upstream": "stub"},
            )  # fmt: skip
        if model == "reset":
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if model == "slow":
            await asyncio.sleep(3)
            return web.json_response({})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if model == "endless":
            try:
                while True:
                    await response.write(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n')
                    await asyncio.sleep(0.02)
            except (asyncio.CancelledError, ConnectionResetError):
                self.aborted.set()
                raise
        gap_s = 0.02 if model == "slowstream" else 0.0
        for i in range(STREAM_CHUNKS):
            chunk = f'data: {{"choices":[{{"index":0,"delta":{{"content":"w{i} "}}}}]}}\n\n'
            self.sent.append(chunk.encode())
            await response.write(chunk.encode())
            if gap_s:
                await asyncio.sleep(gap_s)
        if body.get("stream_options", {}).get("include_usage"):
            usage = b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":50}}\n\n'
            self.sent.append(usage)
            await response.write(usage)
        self.sent.append(b"data: [DONE]\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    stub = Stub()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", stub.handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stub.url = f"http://127.0.0.1:{port}"
    yield stub
    await runner.cleanup()


# -- the sidecar process ----------------------------------------------------------------------


@dataclass
class SidecarProcess:
    process: subprocess.Popen[bytes]
    proxy: str
    admin: str
    records: Path

    async def status(self, session: aiohttp.ClientSession) -> dict[str, Any]:
        async with session.get(f"{self.admin}/status") as response:
            payload: dict[str, Any] = await response.json()
            return payload

    async def books_reach(self, session: aiohttp.ClientSession, field: str, value: int) -> None:
        """Wait (bounded by a generous deadline: a failure, not a speed) until ``/status``'s
        books show ``field`` at ``value``."""
        async with asyncio.timeout(WAIT_S):
            while (await self.status(session))["books"][field] != value:
                await asyncio.sleep(0.01)

    async def settled_books(self, session: aiohttp.ClientSession) -> dict[str, int]:
        """Books from /status once they are zero, or as they are after 5 s."""
        for _ in range(500):
            books: dict[str, int] = (await self.status(session))["books"]
            if books == ZERO_BOOKS:
                break
            await asyncio.sleep(0.01)
        return books


def start_sidecar(
    tmp_path: Path,
    upstream: str,
    drain_grace_s: float = 10.0,
    sidecar: dict[str, Any] | None = None,
    **policy: Any,
) -> SidecarProcess:
    policy = {"max_interactive_wait_ms": 60_000, **policy}  # see PATIENT_POLICY
    document = config_to_document(keyed_config(PolicyConfig(**policy)))
    section = {
        "upstreamReadTimeoutSeconds": 0.5,
        "upstreamConnectTimeoutSeconds": 1.0,
        **(sidecar or {}),
    }
    document["sidecar"] = section
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    proxy, admin = free_ports(2)
    records = tmp_path / "records.jsonl"
    process = subprocess.Popen(
        [str(TOKENFAIR), "sidecar", "--config", str(config),
         "--listen", f"127.0.0.1:{proxy}", "--admin-listen", f"127.0.0.1:{admin}",
         "--backend", "openai", "--upstream", upstream, "--engine-metrics", "off",
         *(() if "maxInFlight" in section else ("--max-in-flight", "1")),
         "--records", str(records), "--drain-grace", str(drain_grace_s), "--log-level", "WARNING"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    return SidecarProcess(
        process, f"http://127.0.0.1:{proxy}", f"http://127.0.0.1:{admin}", records
    )


def stop(sidecar: SidecarProcess) -> None:
    if sidecar.process.poll() is None:
        sidecar.process.send_signal(signal.SIGTERM)
        try:
            sidecar.process.wait(15)
        except subprocess.TimeoutExpired:
            sidecar.process.kill()
            sidecar.process.wait()
    for pipe in (sidecar.process.stdout, sidecar.process.stderr):
        if pipe is not None:
            pipe.close()


async def _running(tmp_path: Path, upstream: str, session: aiohttp.ClientSession, **options: Any
                   ) -> SidecarProcess:  # fmt: skip
    sidecar = start_sidecar(tmp_path, upstream, **options)
    try:
        await until_ready(sidecar.process, sidecar.admin, session)
    except BaseException:
        stop(sidecar)
        raise
    return sidecar


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
            **extra}  # fmt: skip


# -- tests ------------------------------------------------------------------------------------


async def test_json_stream_and_upstream_faults(stub: Stub, tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, stub.url, session)
        try:
            url = f"{sidecar.proxy}/v1/chat/completions"
            headers = {"Authorization": CHAT, "x-tokenfair-priority": "interactive"}
            async with session.post(url, json=chat("ok"), headers=headers) as response:
                assert response.status == 200
                assert response.headers["x-upstream"] == "stub"
                assert "x-ratelimit-remaining-tokens" in response.headers
                assert (await response.json())["usage"]["completion_tokens"] == 5
            forwarded = stub.headers[-1]
            assert "authorization" not in forwarded
            assert "x-tokenfair-priority" not in forwarded
            status = await sidecar.status(session)
            # Settled to the reported usage: 11 + 4 * 5 = 31 service tokens (the estimate was
            # "hi" -> ceil(2 / 4) + 4 = 5 prompt tokens + 4 * 50 = 205).
            assert status["tenants"]["tenant_chat_pro"]["served_service_tokens"] == 31

            async with session.post(
                url, json=chat("stream", stream=True), headers=headers
            ) as response:
                assert response.status == 200
                received = await response.read()
            assert stub.bodies[-1]["stream_options"] == {"include_usage": True}
            # The usage chunk the sidecar asked for is not the client's: cut from its stream.
            assert received == b"".join(c for c in stub.sent if b'"usage"' not in c)
            status = await sidecar.status(session)
            # 31 + the stream's usage chunk: 9 + 4 * 50 = 209.
            assert status["tenants"]["tenant_chat_pro"]["served_service_tokens"] == 31 + 209

            for model, code, reason in (("reset", 502, "upstream_error"),
                                        ("slow", 504, "upstream_timeout")):  # fmt: skip
                async with session.post(url, json=chat(model), headers=headers) as response:
                    assert response.status == code
                    assert (await response.json())["error"]["code"] == reason
                assert await sidecar.settled_books(session) == ZERO_BOOKS
            status = await sidecar.status(session)
            # The reset ran nothing and settles at 0; the timeout may have run upstream and
            # settles at the estimate, 205.
            assert status["tenants"]["tenant_chat_pro"]["served_service_tokens"] == 240 + 205

            # A client that leaves mid-stream: the upstream call is aborted, capacity freed.
            async with session.post(
                url, json=chat("endless", stream=True), headers=headers
            ) as response:
                assert response.status == 200
                await response.content.readany()
                response.close()
            await asyncio.wait_for(stub.aborted.wait(), 5)
            assert await sidecar.settled_books(session) == ZERO_BOOKS
            status = await sidecar.status(session)
            # Cut short without usage: the estimate, 205.
            assert status["tenants"]["tenant_chat_pro"]["served_service_tokens"] == 445 + 205
            counts = status["tenants"]["tenant_chat_pro"]["counts"]
            assert counts == {"admitted": 5, "served": 2, "backend_errors": 2, "cancelled": 1}
        finally:
            stop(sidecar)


async def test_request_target_reaches_the_upstream_as_sent(stub: Stub, tmp_path: Path) -> None:
    # Origin-form is forwarded byte for byte (query included, nothing re-encoded); absolute-form
    # (a client that talks to the sidecar as to a proxy) is forwarded as its path and query.
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, stub.url, session)
        try:
            host, port = sidecar.proxy.removeprefix("http://").rsplit(":", 1)
            body = json.dumps(chat("ok")).encode()
            # `%2F` in the query is what a re-encoding URL library turns into `/`.
            query = "?a=%20b&c=d%2Fe"
            for target in (f"/v1/chat/completions{query}",
                           f"http://{host}:{port}/v1/chat/completions{query}"):  # fmt: skip
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(
                    f"POST {target} HTTP/1.1\r\nHost: {host}\r\nAuthorization: {CHAT}\r\n"
                    f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                    "Connection: close\r\n\r\n".encode()
                    + body
                )
                status_line = await reader.readline()
                await reader.read()
                writer.close()
                await writer.wait_closed()
                assert status_line.startswith(b"HTTP/1.1 200"), status_line
            origin_form, absolute_form = stub.targets[-2:]
            assert origin_form == f"/v1/chat/completions{query}"
            # Absolute-form: its path and query (the query may come back re-encoded).
            path, _, forwarded_query = absolute_form.partition("?")
            assert path == "/v1/chat/completions"
            assert parse_qs(forwarded_query) == {"a": [" b"], "c": ["d/e"]}
        finally:
            stop(sidecar)


async def test_refused_upstream_is_502(tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, f"http://127.0.0.1:{free_ports(1)[0]}", session)
        try:
            async with session.post(
                f"{sidecar.proxy}/v1/chat/completions",
                json=chat("ok"),
                headers={"Authorization": CHAT},
            ) as response:
                assert response.status == 502
                assert (await response.json())["error"]["code"] == "upstream_error"
            assert await sidecar.settled_books(session) == ZERO_BOOKS
        finally:
            stop(sidecar)


async def test_sigterm_drains(stub: Stub, tmp_path: Path) -> None:
    async with aiohttp.ClientSession() as session:
        # Queued interactive requests may wait 60 s here, so only the drain can end the wait.
        sidecar = await _running(tmp_path, stub.url, session)
        try:
            url = f"{sidecar.proxy}/v1/chat/completions"
            headers = {"Authorization": CHAT}

            async def post(model: str) -> tuple[int, dict[str, str], bytes]:
                async with session.post(url, json=chat(model, stream=True), headers=headers) as r:
                    return r.status, dict(r.headers), await r.read()

            # 50 chunks 20 ms apart: the in-flight request runs ~1 s; the next one queues.
            in_flight = asyncio.create_task(post("slowstream"))
            await sidecar.books_reach(session, "running_requests", 1)
            queued = asyncio.create_task(post("stream"))
            await sidecar.books_reach(session, "queued_requests", 1)
            sidecar.process.send_signal(signal.SIGTERM)
            status, queued_headers, queued_body = await queued
            assert status == 503
            assert queued_headers["Retry-After"] == "1"
            assert json.loads(queued_body)["error"]["code"] == "draining"
            async with session.get(f"{sidecar.admin}/readyz") as response:
                assert response.status == 503
            async with session.post(url, json=chat("ok"), headers=headers) as response:
                assert response.status == 503
            status, _, body = await in_flight
            assert status == 200
            assert body.endswith(b"data: [DONE]\n\n")
            assert sidecar.process.wait(15) == 0
            records = read_trace(sidecar.records)
            assert len(records) == 2  # the refused-at-the-door request never reached admission
            lines = [json.loads(line) for line in sidecar.records.read_text().splitlines()]
            assert sorted((r["status_code"], r["reason"]) for r in lines) == [
                (200, "admitted"),
                (503, "draining"),
            ]
        finally:
            stop(sidecar)


async def test_drain_grace_bounds_the_shutdown(stub: Stub, tmp_path: Path) -> None:
    """Two endless streams outlive a 0.3 s grace: the sidecar cuts them (each client sees a
    truncated transfer), aborts their upstream calls, records each as ``503 drain_aborted``
    (not as a client that left) and exits 0 — within the documented grace + 1 s, checked here
    only against a generous bound (+ 5 s: a loaded machine must not fail it; the old drain's
    two waits of aiohttp's shutdown timeout, + 2 s, are measured in the report, not here)."""
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(
            tmp_path, stub.url, session, drain_grace_s=0.3, sidecar={"maxInFlight": 2}
        )
        try:
            url = f"{sidecar.proxy}/v1/chat/completions"
            async with contextlib.AsyncExitStack() as stack:
                responses = [
                    await stack.enter_async_context(
                        session.post(url, json=chat("endless", stream=True),
                                     headers={"Authorization": CHAT})
                    )
                    for _ in range(2)
                ]  # fmt: skip
                for response in responses:
                    assert response.status == 200
                    await response.content.readany()
                sidecar.process.send_signal(signal.SIGTERM)
                signalled = time.monotonic()
                for response in responses:
                    with pytest.raises(aiohttp.ClientPayloadError):
                        await response.content.read()
            assert sidecar.process.wait(15) == 0
            assert time.monotonic() - signalled < 0.3 + 1.0 + 5.0
            await asyncio.wait_for(stub.aborted.wait(), 5)
            lines = [json.loads(line) for line in sidecar.records.read_text().splitlines()]
            assert [(r["status_code"], r["reason"]) for r in lines] == [(503, "drain_aborted")] * 2
        finally:
            stop(sidecar)


async def test_a_drain_aborted_request_with_nothing_sent_gets_its_503(
    stub: Stub, tmp_path: Path
) -> None:
    """A non-streamed request still running when the grace runs out (its upstream takes 3 s)
    gets a real ``503 drain_aborted`` with ``Retry-After`` — what its record says — not a
    reset; a stream already under way next to it is still cut (an incomplete transfer)."""
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(
            tmp_path, stub.url, session, drain_grace_s=0.3, sidecar={"maxInFlight": 2}
        )
        try:
            url = f"{sidecar.proxy}/v1/chat/completions"
            headers = {"Authorization": CHAT}
            async with session.post(
                url, json=chat("endless", stream=True), headers=headers
            ) as streaming:
                assert streaming.status == 200
                await streaming.content.readany()
                slow = asyncio.create_task(session.post(url, json=chat("slow"), headers=headers))
                for _ in range(500):  # until the upstream has it (dispatched, nothing sent)
                    if len(stub.bodies) == 2:
                        break
                    await asyncio.sleep(0.01)
                assert len(stub.bodies) == 2
                sidecar.process.send_signal(signal.SIGTERM)
                with pytest.raises(aiohttp.ClientPayloadError):
                    await streaming.content.read()
                answer = await slow
                assert answer.status == 503
                assert (await answer.json())["error"]["code"] == "drain_aborted"
                assert int(answer.headers["Retry-After"]) >= 1
                assert answer.headers["x-request-id"]
            assert sidecar.process.wait(15) == 0
            lines = [json.loads(line) for line in sidecar.records.read_text().splitlines()]
            assert [(r["status_code"], r["reason"]) for r in lines] == [(503, "drain_aborted")] * 2
        finally:
            stop(sidecar)


async def test_a_connection_over_the_cap_is_answered_503_at_once(
    stub: Stub, tmp_path: Path
) -> None:
    """At most ``maxClientConnections`` open: one more is answered 503 and closed at once, and
    there is room again once one closes. The idle timeout is 60 s here, so that no stall of
    the machine can close the held connections before the surplus one arrives."""
    limits = {"maxClientConnections": 2, "clientIdleTimeoutSeconds": 60}
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, stub.url, session, sidecar=limits)
        try:
            host, port = sidecar.proxy.removeprefix("http://").rsplit(":", 1)
            held = [await asyncio.open_connection(host, int(port)) for _ in range(2)]
            # A third is over the cap (accepted after the two, in order): 503, closed before
            # anything is read.
            surplus_reader, surplus_writer = await asyncio.open_connection(host, int(port))
            async with asyncio.timeout(10):
                answer = await surplus_reader.read()
            surplus_writer.close()
            assert answer.startswith(b"HTTP/1.1 503"), answer
            assert b'"too_many_connections"' in answer
            # Half-closed, a held connection is closed by the sidecar: its EOF comes after the
            # sidecar stopped counting it.
            for reader, writer in held:
                writer.write_eof()
                async with asyncio.timeout(10):
                    assert await reader.read() == b""
                writer.close()
            # Room again: served.
            async with session.post(
                f"{sidecar.proxy}/v1/chat/completions",
                json=chat("ok"),
                headers={"Authorization": CHAT},
            ) as response:
                assert response.status == 200
            assert await sidecar.settled_books(session) == ZERO_BOOKS
            async with session.get(f"{sidecar.admin}/metrics") as response:
                assert "tokenfair_refused_connections_total 1.0" in await response.text()
        finally:
            stop(sidecar)


async def test_idle_and_slow_header_connections_are_closed(stub: Stub, tmp_path: Path) -> None:
    """A connection with no request under way — idle, or trickling a request's head — is
    closed after ``clientIdleTimeoutSeconds``. The 0.5 s timeout is what the test waits for,
    not a speed it needs (a stall only makes the close come later)."""
    limits = {"clientIdleTimeoutSeconds": 0.5}
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, stub.url, session, sidecar=limits)
        try:
            host, port = sidecar.proxy.removeprefix("http://").rsplit(":", 1)
            idle = await asyncio.open_connection(host, int(port))
            slow = await asyncio.open_connection(host, int(port))
            slow[1].write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
            # Both are closed by the sidecar (EOF) while the client still holds them.
            for reader, writer in (idle, slow):
                async with asyncio.timeout(30):
                    assert await reader.read() == b""
                writer.close()
            async with session.get(f"{sidecar.admin}/metrics") as response:
                assert "tokenfair_refused_connections_total 0.0" in await response.text()
        finally:
            stop(sidecar)


# -- signals and hostile connections (issue 28) ---------------------------------------------------


async def test_sighup_never_stops_the_sidecar(stub: Stub, tmp_path: Path) -> None:
    """SIGHUP (what logrotate's ``postrotate`` sends) mid-stream: the sidecar lives on, the
    stream under way ends whole, its record is written, and new requests are served."""
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, stub.url, session)
        try:
            url = f"{sidecar.proxy}/v1/chat/completions"
            headers = {"Authorization": CHAT}
            async with session.post(
                url, json=chat("slowstream", stream=True), headers=headers
            ) as streaming:
                assert streaming.status == 200
                await streaming.content.readany()  # under way: 50 events 20 ms apart
                sidecar.process.send_signal(signal.SIGHUP)
                sidecar.process.send_signal(signal.SIGHUP)  # twice: a handler, not a one-off
                body = await streaming.read()
            assert body.endswith(b"data: [DONE]\n\n")
            async with session.post(url, json=chat("ok"), headers=headers) as response:
                assert response.status == 200
            assert sidecar.process.poll() is None
            assert await sidecar.settled_books(session) == ZERO_BOOKS
            stop(sidecar)
            assert sidecar.process.returncode == 0  # drained on SIGTERM as ever
            lines = [json.loads(line) for line in sidecar.records.read_text().splitlines()]
            assert [(r["status_code"], r["reason"]) for r in lines] == [(200, "admitted")] * 2
        finally:
            stop(sidecar)


async def test_a_pipelining_client_that_never_reads_is_cut(stub: Stub, tmp_path: Path) -> None:
    """A client pipelines request after request (404s of long paths: answers aiohttp writes
    itself, after its handler) and reads none of the answers: once they fill its connection,
    the sidecar cuts it within 1.5 write timeouts (the 0.5 s here is what the test waits for,
    not a speed it needs), and a tenant is served meanwhile and after."""
    limits = {"clientWriteTimeoutSeconds": 0.5, "clientIdleTimeoutSeconds": 60}
    async with aiohttp.ClientSession() as session:
        sidecar = await _running(tmp_path, stub.url, session, sidecar=limits)
        try:
            host, port = sidecar.proxy.removeprefix("http://").rsplit(":", 1)
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect((host, int(port)))
            sock.setblocking(False)
            request = b"GET /" + b"x" * 8000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
            cut = False
            deadline = time.monotonic() + 120  # a failure, not a speed: cut in ~1 s
            try:
                while time.monotonic() < deadline and not cut:
                    try:
                        sock.send(request)
                    except BlockingIOError:
                        await asyncio.sleep(0.05)  # the sidecar is not reading: it may be stuck
                    except OSError:
                        cut = True
                    cut = cut or connection_cut(sock)
            finally:
                sock.close()
            assert cut, "the sidecar never cut a client that reads nothing"
            async with session.post(
                f"{sidecar.proxy}/v1/chat/completions",
                json=chat("ok"),
                headers={"Authorization": CHAT},
            ) as response:
                assert response.status == 200
            status = await sidecar.status(session)
            assert status["connections"]["write_timeouts"] >= 1
        finally:
            stop(sidecar)


FLOOD_PEERS = 20
FLOOD_PER_PEER = 50
"""1,000 anonymous sockets, from 127.0.0.2 to 127.0.0.21 (the bench opens 5,000)."""


async def test_anonymous_sockets_cannot_keep_a_tenant_out(stub: Stub, tmp_path: Path) -> None:
    """1,000 anonymous sockets from 20 peers — idle, or trickling a request head — against a cap
    of 300 connections, 150 of them for anonymous ones, 40 per peer: the flood gets at most its
    share, the rest is refused or evicted, and a tenant is served all along, on a keep-alive
    connection it held before and on new connections (each anonymous until its head arrives).
    Deadlines are generous: the test checks who is served, not how fast."""
    limits = {
        "maxClientConnections": 300,
        "maxUnauthenticatedConnections": 150,
        "maxUnauthenticatedConnectionsPerPeer": 40,
        "clientIdleTimeoutSeconds": 120,
    }
    async with contextlib.AsyncExitStack() as stack:
        session = await stack.enter_async_context(aiohttp.ClientSession())
        sidecar = await _running(tmp_path, stub.url, session, sidecar=limits)
        stack.callback(stop, sidecar)
        host, port = sidecar.proxy.removeprefix("http://").rsplit(":", 1)
        url = f"{sidecar.proxy}/v1/chat/completions"
        headers = {"Authorization": CHAT}
        async with session.post(url, json=chat("ok"), headers=headers) as response:
            assert response.status == 200  # the tenant's keep-alive connection, authenticated

        flood: list[asyncio.StreamWriter] = []

        def close_flood() -> None:
            for writer in flood:
                writer.close()

        stack.callback(close_flood)
        for index in range(FLOOD_PEERS * FLOOD_PER_PEER):
            peer = f"127.0.0.{2 + index % FLOOD_PEERS}"
            _, writer = await asyncio.open_connection(host, int(port), local_addr=(peer, 0))
            if index % 2:
                writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
            flood.append(writer)
        connections = (await sidecar.status(session))["connections"]
        assert connections["unauthenticated"] <= 150, connections
        assert connections["refused"] + connections["evicted"] >= 1000 - 150, connections

        # The connection held before the flood is served.
        async with session.post(url, json=chat("ok"), headers=headers) as response:
            assert response.status == 200
        # And so are new connections, each opened into the flood.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as fresh:
            for _ in range(20):
                async with asyncio.timeout(60):
                    async with fresh.post(url, json=chat("ok"), headers=headers) as response:
                        assert response.status == 200
        assert await sidecar.settled_books(session) == ZERO_BOOKS
