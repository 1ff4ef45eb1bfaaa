"""The access log's line format and its writer (issue 34: no ``logging``, no JSON encoder).

* Format: :func:`served_json_line` and :func:`json_line` write what ``json.dumps`` writes, for
  random values of every field's type (hypothesis; client text of any Unicode, floats past
  ``1e16``, ``NaN`` and infinities); the documented example lines of docs/observability.md come
  out byte for byte from their own values, in the documented field order, and the table of
  fields there names exactly the fields a served line has.
* :class:`LineWriter`: a line stays in the event loop's buffer until the flush interval, the
  size threshold or :meth:`~LineWriter.flush`; with no loop running it goes at once; a batch
  that would put the writer thread over its bound is dropped and counted; a write to a pipe
  nobody reads any more is counted as dropped, not raised.
* The app with a writer (``tokenfair sidecar``'s path) writes one line a request to it, with
  nothing on the ``tokenfair.access`` logger.
* A real ``tokenfair sidecar`` with a flush interval of a minute loses no line when it gets
  ``SIGTERM``: every request's line is on its stdout when it exits.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from loopback_support import free_ports
from repo_paths import REPO_ROOT
from sidecar_support import (
    CHAT,
    ClientFactory,
    completion_body,
    keyed_config,
    start,
    until_ready,
    wait_for,
)

from tokenfair.config import config_to_document
from tokenfair.server.accesslog import (
    ACCESS_LOGGER,
    FLUSH_CHARS,
    SERVED_FIELDS,
    UNADMITTED_FIELDS,
    LineWriter,
    UtcTimestamps,
    json_line,
    served_json_line,
    utc_timestamp,
)
from tokenfair.server.runtime_settings import SidecarSettings

TOKENFAIR = Path(sys.executable).with_name("tokenfair")


def dumps(fields: dict[str, Any]) -> str:
    return json.dumps(fields, separators=(",", ":"))


texts = st.text() | st.sampled_from(["tenant_chat_pro", "/v1/chat/completions", 'a"b\\c\n', "é…"])
maybe_texts = st.none() | texts
counts = st.integers(min_value=0, max_value=10**18)
floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.343, 1e16, 1e-7])
SERVED_VALUES = {
    "time": texts,
    "request_id": texts,
    "tenant": texts,
    "priority_class": texts,
    "method": texts,
    "route": maybe_texts,
    "model": maybe_texts,
    "status": st.integers(min_value=100, max_value=599),
    "reason": texts,
    "gate": texts,
    "prompt_tokens_estimated": counts,
    "completion_tokens_estimated": counts,
    "service_tokens_estimated": counts,
    "prompt_tokens": st.none() | counts,
    "completion_tokens": st.none() | counts,
    "service_tokens_settled": counts,
    "queue_wait_ms": floats,
    "ttft_ms": st.none() | floats,
    "e2e_ms": floats,
}


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries(SERVED_VALUES))
def test_a_served_line_is_what_json_writes(drawn: dict[str, Any]) -> None:
    fields = {name: drawn[name] for name in SERVED_FIELDS}
    assert served_json_line(*fields.values()) == dumps(fields)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        texts, st.none() | texts | counts | st.integers() | floats | st.booleans(), max_size=12
    )
)
def test_any_line_is_what_json_writes(fields: dict[str, Any]) -> None:
    assert json_line(fields) == dumps(fields)


def documented() -> tuple[list[str], str]:
    """The example lines of docs/observability.md's access log section, and the section."""
    text = (REPO_ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    section = text[text.index("## Access log") :]
    section = section[: section.index("\n## ", 1)]
    block = re.search(r"```json\n(.*?)```", section, re.DOTALL)
    assert block is not None
    return block.group(1).splitlines(), section


def test_the_documented_lines_come_out_byte_for_byte_in_the_documented_order() -> None:
    (served, unadmitted), _ = documented()
    served_fields = json.loads(served)
    assert tuple(served_fields) == SERVED_FIELDS
    assert served_json_line(*served_fields.values()) == served
    unadmitted_fields = json.loads(unadmitted)
    assert tuple(unadmitted_fields) == UNADMITTED_FIELDS
    assert json_line(unadmitted_fields) == unadmitted


def test_the_documented_table_names_every_field_of_a_line_in_order() -> None:
    _, section = documented()
    table = [line for line in section.splitlines() if line.startswith("| `")]
    named = [name for row in table for name in re.findall(r"`([a-z0-9_]+)`", row.split("|")[1])]
    assert tuple(named) == SERVED_FIELDS
    assert set(UNADMITTED_FIELDS) <= set(SERVED_FIELDS)


@pytest.mark.parametrize("now_s", [0.0, 1764625987.123, 1764625987.9999, 1764625988.0005])
def test_the_kept_second_changes_nothing_in_the_timestamp(now_s: float) -> None:
    timestamps = UtcTimestamps()
    for t in (now_s - 1.5, now_s, now_s + 0.25, now_s):
        assert timestamps(t) == utc_timestamp(t)


# -- the writer ---------------------------------------------------------------------------------


def written(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


@pytest.fixture
def out(tmp_path: Path) -> Any:
    path = tmp_path / "access.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    yield path, fd
    os.close(fd)


async def test_a_line_waits_in_the_buffer_until_its_flush(out: tuple[Path, int]) -> None:
    path, fd = out
    writer = LineWriter(fd, flush_interval_s=3600.0)
    writer.write('{"n":1}')
    writer.write('{"n":2}')
    # Handed to the thread only by the timer (an hour away) or a flush: nothing is written yet.
    assert writer.wait_written(0.0)
    assert written(path) == []
    writer.flush()
    assert writer.wait_written(10.0)
    assert written(path) == ['{"n":1}', '{"n":2}']
    assert writer.dropped == 0


async def test_the_flush_interval_hands_the_buffer_over(out: tuple[Path, int]) -> None:
    path, fd = out
    writer = LineWriter(fd, flush_interval_s=0.01)
    writer.write("one")
    assert await wait_for(lambda: written(path) == ["one"], budget_s=10.0)
    writer.write("two")  # a new timer for the next line
    assert await wait_for(lambda: written(path) == ["one", "two"], budget_s=10.0)


async def test_a_full_buffer_goes_at_once(out: tuple[Path, int]) -> None:
    path, fd = out
    writer = LineWriter(fd, flush_interval_s=3600.0)
    line = "x" * 1000
    count = FLUSH_CHARS // len(line) + 1
    for _ in range(count):
        writer.write(line)
    assert writer.wait_written(10.0)
    assert written(path) == [line] * count


def test_with_no_event_loop_a_line_goes_at_once(out: tuple[Path, int]) -> None:
    path, fd = out
    writer = LineWriter(fd, flush_interval_s=3600.0)
    writer.write("alone")
    assert writer.wait_written(10.0)
    assert written(path) == ["alone"]


async def test_a_batch_over_the_bound_is_dropped_and_counted(
    out: tuple[Path, int], caplog: pytest.LogCaptureFixture
) -> None:
    path, fd = out
    writer = LineWriter(fd, flush_interval_s=3600.0, max_pending=2)
    for n in range(3):
        writer.write(str(n))
    writer.flush()
    assert writer.dropped == 3
    assert "3 line(s) dropped" in caplog.text
    writer.write("kept")
    assert writer.close(10.0)
    assert written(path) == ["kept"]


def test_a_write_that_fails_is_counted_not_raised() -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # EPIPE from now on (Python ignores SIGPIPE)
    try:
        writer = LineWriter(write_end, flush_interval_s=3600.0)
        writer.write("lost")
        writer.write("lost too")
        assert writer.close(10.0)
        assert writer.dropped == 2
    finally:
        os.close(write_end)


async def test_the_app_with_a_writer_writes_its_lines_there_and_nothing_on_the_logger(
    aiohttp_client: ClientFactory, caplog: pytest.LogCaptureFixture, out: tuple[Path, int]
) -> None:
    path, fd = out
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    writer = LineWriter(fd, flush_interval_s=3600.0)
    clients = await start(aiohttp_client, keyed_config(), SidecarSettings(time_scale=0.01),
                          access_writer=writer)  # fmt: skip
    served = await clients.proxy.post(
        "/v1/completions", json=completion_body(10, 2), headers={"Authorization": CHAT}
    )
    assert served.status == 200
    await served.read()
    assert (await clients.proxy.get("/nowhere")).status == 404
    await clients.proxy.close()  # the app's teardown hands the buffer to the thread
    assert writer.wait_written(10.0)
    lines = [json.loads(line) for line in written(path)]
    assert [tuple(line) for line in lines] == [SERVED_FIELDS, UNADMITTED_FIELDS]
    assert lines[0]["request_id"] == served.headers["x-request-id"]
    assert (lines[0]["status"], lines[1]["status"]) == (200, 404)
    assert [r for r in caplog.records if r.name == ACCESS_LOGGER] == []


async def test_a_sidecar_stopped_by_sigterm_writes_every_line_first(tmp_path: Path) -> None:
    document = config_to_document(keyed_config())
    # A minute: no line is written by the timer while the test runs; all of them wait in the
    # buffer for the exit.
    document["sidecar"] = {"timeScale": 0.01, "accessLogFlushSeconds": 60}
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump(document), encoding="utf-8")
    proxy, admin = free_ports(2)
    stdout = tmp_path / "stdout"
    with stdout.open("wb") as sink:
        process = subprocess.Popen(
            [str(TOKENFAIR), "sidecar", "--config", str(config), "--listen", f"127.0.0.1:{proxy}",
             "--admin-listen", f"127.0.0.1:{admin}", "--log-level", "WARNING"],
            stdout=sink, stderr=subprocess.PIPE,
        )  # fmt: skip
    try:
        ids = []
        async with aiohttp.ClientSession() as session:
            await until_ready(process, f"http://127.0.0.1:{admin}", session)
            for _ in range(20):
                async with session.post(
                    f"http://127.0.0.1:{proxy}/v1/completions",
                    json=completion_body(10, 2),
                    headers={"Authorization": CHAT},
                ) as response:
                    assert response.status == 200
                    ids.append(response.headers["x-request-id"])
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        assert process.stderr is not None
        process.stderr.close()
    lines = [json.loads(line) for line in written(stdout) if line.startswith("{")]
    assert [line["request_id"] for line in lines] == ids
    assert all(tuple(line) == SERVED_FIELDS for line in lines)
