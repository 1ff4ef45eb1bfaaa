"""Issue 11's leftovers (#14), over real HTTP on loopback and real YAML files.

Behaviours: ``Expect: 100-continue`` is answered ``100 Continue`` only after the key and the
announced size passed (a bad key is a ``401``, an oversized ``Content-Length`` a ``413``, an
unknown expectation a ``417``, each without a ``100`` and with the connection closed); a config
whose ``sidecar:`` section says ``backend: openai`` without ``upstreamUrl`` is accepted when
``--upstream`` gives it (flags apply before the cross-field check) and refused naming the
upstream when nothing does; a request aiohttp cannot parse is logged as one ``INFO`` line, no
``ERROR`` and no traceback (and no line at all under ``--log-level WARNING``); ``Expect`` on
any other route is answered ``404`` at once, never ``100 Continue``; a config ``version`` over
256 characters, or not a string, is refused naming the field (``null`` is ``""``, an integer of
any size its text).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from aiohttp import web
from sidecar_support import KEYS, ClientFactory, keyed_config, start

from tokenfair.cli import build_parser
from tokenfair.commands.sidecar import settings_for
from tokenfair.config import (
    MAX_VERSION_CHARS,
    ConfigError,
    build_config,
    config_to_document,
    parse_documents,
)
from tokenfair.core.cost import CostModel
from tokenfair.server import create_app, load_sidecar_file, make_backend
from tokenfair.server.runner import quiet_malformed_requests
from tokenfair.server.runtime_settings import SidecarSettings

pytestmark = pytest.mark.virtual_time

KEY = KEYS["tenant_chat_pro"]
BODY = b'{"model":"m","prompt":"hi","max_tokens":2}'


async def exchange_expecting(port: int, key: str, length: int, expect: str = "100-continue"
                             ) -> tuple[bytes, bytes]:  # fmt: skip
    """Send a head with ``Expect``, wait for the sidecar's first answer; if it is ``100
    Continue``, send ``BODY`` and read the final answer. Returns (first line, final head)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
            f"Expect: {expect}\r\n\r\n".encode()
        )
        await writer.drain()
        async with asyncio.timeout(10):
            first = await reader.readuntil(b"\r\n\r\n")
            if not first.startswith(b"HTTP/1.1 100"):
                return first.split(b"\r\n")[0], first + await reader.read()
            writer.write(BODY)
            await writer.drain()
            final = await reader.readuntil(b"\r\n\r\n")
            return first.split(b"\r\n")[0], final
    finally:
        writer.close()


async def test_100_continue_only_after_auth_and_size(aiohttp_client: ClientFactory) -> None:
    settings = SidecarSettings(time_scale=0.01, max_body_bytes=1024)
    clients = await start(aiohttp_client, keyed_config(), settings)
    port = clients.proxy.port
    assert port is not None
    first, final = await exchange_expecting(port, KEY, len(BODY))
    assert first == b"HTTP/1.1 100 Continue"
    assert final.startswith(b"HTTP/1.1 200")
    for key, length, expect, status in [
        ("sk-wrong", len(BODY), "100-continue", b"401"),
        (KEY, 4096, "100-continue", b"413"),
        (KEY, len(BODY), "something-else", b"417"),
    ]:
        first, final = await exchange_expecting(port, key, length, expect)
        assert first == b"HTTP/1.1 " + status + (
            b" Unauthorized" if status == b"401" else
            b" Request Entity Too Large" if status == b"413" else b" Expectation Failed"
        )  # fmt: skip
        assert b"100 Continue" not in final
        assert b"connection: close" in final.lower()


async def test_417_is_counted_as_an_invalid_request(aiohttp_client: ClientFactory) -> None:
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    port = clients.proxy.port
    assert port is not None
    first, _ = await exchange_expecting(port, KEY, len(BODY), "something-else")
    assert first.startswith(b"HTTP/1.1 417")
    metrics = await (await clients.admin.get("/metrics")).text()
    assert 'tokenfair_invalid_requests_total{status="417"} 1.0' in metrics


@pytest.mark.parametrize(
    "head",
    [
        b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n",
        b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n",
        b"PUT /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n",
    ],
    ids=["unknown-path", "get", "put"],
)
async def test_no_100_continue_on_other_routes(aiohttp_client: ClientFactory, head: bytes) -> None:
    # aiohttp's default expect handler would send `100 Continue` for a request with nowhere to
    # go: its 404 is the answer, at once, and the connection closes.
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01))
    reader, writer = await asyncio.open_connection("127.0.0.1", clients.proxy.port)
    try:
        writer.write(head + b"Expect: 100-continue\r\n\r\n")
        await writer.drain()
        async with asyncio.timeout(10):
            answer = await reader.read()  # the sidecar closes: read to the end
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 404"), answer[:80]
    assert b"100 Continue" not in answer
    assert b'"not_found"' in answer


def write_config(tmp_path: Path, section: dict[str, object]) -> Path:
    document = config_to_document(keyed_config())
    document["sidecar"] = section
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump(document), encoding="utf-8")
    return path


def test_backend_openai_in_the_file_takes_its_upstream_from_the_flag(tmp_path: Path) -> None:
    path = write_config(tmp_path, {"backend": "openai"})
    parser = build_parser({"sidecar"})
    loaded = load_sidecar_file(path)
    args = parser.parse_args(["sidecar", "--config", str(path), "--upstream", "http://h:8000"])
    settings = settings_for(args, loaded.section)
    assert (settings.backend, settings.upstream_url) == ("openai", "http://h:8000")
    # Nothing gives the upstream: refused, naming it.
    args = parser.parse_args(["sidecar", "--config", str(path)])
    with pytest.raises(ConfigError, match="upstream URL"):
        settings_for(args, loaded.section)
    # A bad URL from the flag is refused like one from the file.
    args = parser.parse_args(["sidecar", "--config", str(path), "--upstream", "ftp://h"])
    with pytest.raises(ConfigError, match="upstreamUrl"):
        settings_for(args, loaded.section)


async def send_malformed(port: int) -> None:
    for malformed in (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(malformed)
        async with asyncio.timeout(10):
            answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.0 400") or answer.startswith(b"HTTP/1.1 400")
    await asyncio.sleep(0.05)


@pytest.fixture
def malformed_log_filter() -> Iterator[None]:
    """:func:`quiet_malformed_requests` for one test: the filter it installs on aiohttp's
    (process-wide) server logger is removed afterwards."""
    server_log = logging.getLogger("aiohttp.server")
    before = list(server_log.filters)
    quiet_malformed_requests()
    try:
        yield
    finally:
        for added in [f for f in server_log.filters if f not in before]:
            server_log.removeFilter(added)


class _Collect(logging.Handler):
    """Keeps every record it is handed (level NOTSET, like the handler of ``--log-level``: the
    logger's own level is what filters)."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.usefixtures("malformed_log_filter")
@pytest.mark.parametrize("level", [logging.DEBUG, logging.WARNING], ids=["debug", "warning"])
async def test_a_malformed_request_is_one_info_line(level: int) -> None:
    settings = SidecarSettings(time_scale=0.01)
    config = keyed_config()
    app = create_app(settings, config, make_backend(settings, CostModel.from_policy(config.policy)))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server_log = logging.getLogger("aiohttp.server")
    collect, old_level = _Collect(), server_log.level
    server_log.addHandler(collect)
    server_log.setLevel(level)  # as `--log-level` sets it (aiohttp logs these at ERROR)
    try:
        await send_malformed(runner.addresses[0][1])
    finally:
        server_log.removeHandler(collect)
        server_log.setLevel(old_level)
        await runner.cleanup()
    if level > logging.INFO:  # --log-level WARNING: the INFO line is not logged at all
        assert collect.records == []
        return
    assert len(collect.records) == 2
    for record in collect.records:
        assert record.levelno == logging.INFO
        assert record.exc_info is None
        assert record.getMessage().startswith("malformed request from 127.0.0.1 (400 ")
        assert "\n" not in record.getMessage()


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("v" * (MAX_VERSION_CHARS + 1), f"at most {MAX_VERSION_CHARS} characters"),
        (["a"], "must be a string"),
        ({"a": 1}, "must be a string"),
        (10**MAX_VERSION_CHARS, f"integer of over {MAX_VERSION_CHARS} digits"),
        (10**5000, f"integer of over {MAX_VERSION_CHARS} digits"),
        (True, "must be a string"),
    ],
    ids=["long-string", "list", "mapping", "int-257-digits", "int-5001-digits", "bool"],
)
def test_a_config_version_is_bounded(version: object, message: str) -> None:
    document = config_to_document(keyed_config())
    document["version"] = version
    with pytest.raises(ConfigError, match="version") as raised:
        parse_documents([document], "cfg.yaml")
    assert message in str(raised.value)


def test_a_config_version_within_the_bound_is_kept() -> None:
    config = keyed_config()
    for version, kept in (
        ("a" * MAX_VERSION_CHARS, "a" * MAX_VERSION_CHARS),
        (3, "3"),
        (None, ""),  # `version:` left empty, as older documents have it
        (10**30, str(10**30)),  # an unquoted long number: its text, whatever its size
        (10**255, str(10**255)),  # 256 digits: within the bound
    ):
        document = config_to_document(build_config(config.policy, config.tenants))
        document["version"] = version
        assert parse_documents([document], "cfg.yaml").version == kept
