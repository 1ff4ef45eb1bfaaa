"""``Reason`` (``core/reasons.py``): every outcome reason, with its status, gate and counter.

Behaviours under test: each member's fields are well-formed and no two share a value; a member
is its wire string everywhere a record or a log line is written (``str``, f-strings, ``json``,
msgspec, the record encoder, the access log's string encoder), so records are the same bytes
whether a member or the string is held; the old constants are the members; the generated
blocks of ``docs/records.md`` and ``docs/sidecar.md`` are what the enum makes now (and a stale
block is caught); the sidecar's table of answers in ``docs/sidecar.md`` and the literal codes
of the server's error answers agree with the members' statuses; the sidecar counts each
reason a record can end with in the counter (and under the label) its member names, except
the two outcomes whose reason alone would mislead (an upstream's own 5xx relayed to a served
request, a request served beside the books in shadow mode), which is why the counting reads the
status and the dispatch beside the reason;
``tokenfair reasons`` writes the blocks, says when they were up to date, names ``--write`` on a
file it cannot read, and lists every member as JSON.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import msgspec
import pytest
from repo_paths import REPO_ROOT

from tokenfair.cli import main
from tokenfair.core import Decision, Request, jobs, scheduler
from tokenfair.core.reasons import (
    BLOCKS,
    COUNTERS,
    GATES,
    Reason,
    begin_marker,
    end_marker,
    markdown_table,
    reasons_counted_in,
    update,
)
from tokenfair.records.codec import encode_decision
from tokenfair.server import connections, engine_state, errors, lifecycle, proxy
from tokenfair.server.accesslog import json_line
from tokenfair.server.backends import base

DOCS = REPO_ROOT / "docs"
SERVER = REPO_ROOT / "sidecar" / "tokenfair" / "server"
BY_VALUE = {reason.value: reason for reason in Reason}
STATUSES = {0, 200, 400, 401, 404, 408, 413, 415, 417, 429, 499, 500, 502, 503, 504}


def test_members_are_well_formed_and_distinct() -> None:
    # A repeated value would make a silent alias, not a member: every name must be its own.
    assert len(Reason.__members__) == len(list(Reason))
    for reason in Reason:
        assert re.fullmatch(r"[a-z]+(_[a-z0-9]+)*", reason.value), reason
        assert reason.name == reason.value.upper(), reason
        assert reason.status in STATUSES, reason
        assert reason.gates, reason
        assert set(reason.gates) <= set(GATES), reason
        assert reason.counter in COUNTERS, reason
        assert reason.meaning, reason
        assert "\n" not in reason.meaning, reason
        assert "|" not in reason.meaning, reason


def test_a_member_encodes_as_its_string() -> None:
    for reason in Reason:
        plain = reason.value
        assert type(plain) is str
        assert reason == plain
        assert hash(reason) == hash(plain)
        assert str(reason) == f"{reason}" == "{}".format(reason) == plain  # noqa: UP032
        # Printed in a container (the simulate report's shed tallies), it reads as the string.
        assert repr(reason) == repr(plain)
        assert str({reason: 1}) == str({plain: 1})
        assert json.dumps({reason: reason}) == json.dumps({plain: plain})
        assert msgspec.json.encode({reason: reason}) == msgspec.json.encode({plain: plain})
        assert json_line({"reason": reason}) == json_line({"reason": plain})
        records = []
        for value in (reason, plain):
            made = Decision("r1", "t", "batch", reason.status, value, reason.gates[0], 7, 1.0)
            records.append(encode_decision(made, "tokenfair"))
        assert records[0] == records[1]
        assert json.loads(records[0])["reason"] == plain


def test_the_old_constants_are_the_members() -> None:
    assert jobs.ADMITTED is Reason.ADMITTED
    assert jobs.CANCELLED is Reason.CANCELLED
    assert jobs.SHED_TENANT_KV_SHARE is Reason.SHED_TENANT_KV_SHARE
    assert scheduler.OVER_KV_CAPACITY is Reason.REQUEST_OVER_KV_CAPACITY
    assert scheduler.OVER_TENANT_BURST is Reason.REQUEST_OVER_TENANT_BURST
    assert errors.INTERNAL_ERROR is Reason.INTERNAL_ERROR
    assert lifecycle.DRAINING is Reason.DRAINING
    assert lifecycle.DRAIN_ABORTED is Reason.DRAIN_ABORTED
    assert proxy.BODY_TOO_COMPLEX is Reason.BODY_TOO_COMPLEX
    assert proxy.CLIENT_WRITE_TIMEOUT is Reason.CLIENT_WRITE_TIMEOUT
    assert engine_state.ROUTE_NOT_SERVED is Reason.ROUTE_NOT_SERVED
    assert base.BAD_USAGE is Reason.UPSTREAM_BAD_USAGE
    assert set(base.CLIENT_MESSAGES) <= set(Reason)
    # The connection cap's canned answer (bytes, written before any handler runs).
    refusal = Reason.TOO_MANY_CONNECTIONS
    assert connections.CAP_ANSWER.startswith(b"HTTP/1.1 %d " % refusal.status)
    assert b'"code":"%s"' % refusal.value.encode() in connections.CAP_ANSWER


def test_the_docs_blocks_are_the_enums() -> None:
    found = set()
    for name in ("records.md", "sidecar.md"):
        text = (DOCS / name).read_text(encoding="utf-8")
        found |= {block for block in BLOCKS if begin_marker(block) in text}
        assert update(text) == text, f"docs/{name} is stale: run tokenfair reasons --write"
    assert found == set(BLOCKS)


def test_a_stale_block_is_caught() -> None:
    current = f"{begin_marker('reasons')}\n{markdown_table()}{end_marker('reasons')}\n"
    assert update(current) == current
    # A member added to the enum without regenerating: the docs lack its row.
    stale = current.replace(f"| `{Reason.QUEUE_FULL.value}` |", "| `queue_almost_full` |")
    assert update(stale) != stale
    assert update(stale) == current
    with pytest.raises(ValueError, match=r"reasons: .* has no"):
        update(begin_marker("reasons") + "\n| a row |\n")


def test_refused_label_values() -> None:
    refused = reasons_counted_in("refused")
    assert Reason.SHED_QUEUE_TIMEOUT in refused
    assert Reason.DRAINING in refused
    # A refusal is never dispatched: the core's gates' (and a drain's) 400/429/503.
    for reason in refused:
        assert reason.status in (400, 429, 503), reason
        assert set(reason.gates) <= {"admission", "queue", "dispatch", "drain"}, reason
    for reason in reasons_counted_in("backend_errors"):
        assert reason.status >= 500 or reason.gates == ("upstream",), reason
    with pytest.raises(ValueError, match="counter: 'nope'"):
        reasons_counted_in("nope")


def _answer_table() -> dict[str, int]:
    """``docs/sidecar.md``'s "status | code | when" table: each code (or tokenfair_reason)
    and the status it is answered with."""
    text = (DOCS / "sidecar.md").read_text(encoding="utf-8")
    start = text.index("| status | `code` | when |")
    rows: dict[str, int] = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        status, code = (cell.strip() for cell in line.split("|")[1:3])
        names = re.findall(r"`([a-z_]+)`", code)
        match = re.search(r"tokenfair_reason: ([a-z_]+)", code)
        rows[match.group(1) if match else names[0]] = int(status)
    return rows


def test_the_sidecars_answers_table_agrees() -> None:
    table = _answer_table()
    for code, status in table.items():
        assert BY_VALUE[code].status == status, code
    # Every reason the sidecar answers with an error is in the table; the 499s are clients
    # that went away (no answer), `upstream_aborted` a stream cut after its 200.
    answered = {
        reason.value
        for reason in Reason
        if reason.status >= 400 and reason.status != 499 and reason is not Reason.UPSTREAM_ABORTED
    }
    assert answered == set(table)


_CODE_ARGUMENT = {"error_response": (0, 2), "_invalid": (1, 3), "UpstreamError": (0, 1)}
"""Callee name -> (index of the status argument, index of the code argument)."""


def _code(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "Reason"
    ):
        return Reason[node.attr].value
    return None  # a name or an expression: its value is not known here


def test_the_servers_literal_error_codes_are_members() -> None:
    checked = 0
    for path in sorted(SERVER.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call):
                continue
            callee = node.func
            name = callee.id if isinstance(callee, ast.Name) else getattr(callee, "attr", "")
            if name not in _CODE_ARGUMENT:
                continue
            status_at, code_at = _CODE_ARGUMENT[name]
            if len(node.args) <= code_at:
                continue
            code = _code(node.args[code_at])
            status = node.args[status_at]
            if code is None or not isinstance(status, ast.Constant):
                continue
            where = f"{path.relative_to(REPO_ROOT)}:{node.lineno}"
            assert code in BY_VALUE, where
            assert BY_VALUE[code].status == status.value, where
            checked += 1
    assert checked >= 20  # the scan sees the answers (it would pass vacuously otherwise)


def test_the_command_writes_and_checks_the_blocks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"# t\n\n{begin_marker('reasons')}\n| old |\n{end_marker('reasons')}\n")
    assert main(["reasons", "--write", str(doc)]) == 0
    assert f"| `{Reason.SHED_QUEUE_TIMEOUT.value}` | 429 | queue |" in doc.read_text()
    assert main(["reasons", "--write", str(doc)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{doc}: regenerated", f"{doc}: up to date"]
    assert main(["reasons", "--write", str(tmp_path / "missing.md")]) == 2
    assert "--write" in capsys.readouterr().err
    assert main(["reasons", "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["reason"] for row in rows] == [reason.value for reason in Reason]
    assert rows[0]["status"] == next(iter(Reason)).status


def test_the_sidecar_counts_each_reason_where_its_member_says() -> None:
    # Each reason a record can end with, through the sidecar's outcome counting: it lands in
    # the counter (and, for refusals and backend errors, under the label) `Reason.counter` says.
    from sidecar_support import keyed_config

    from tokenfair.core.cost import CostModel
    from tokenfair.server import Sidecar, make_backend
    from tokenfair.server.runtime_settings import SidecarSettings

    settings = SidecarSettings()
    sidecar = Sidecar(settings, keyed_config(), make_backend(settings, CostModel()))
    recorded = [
        r for r in Reason if r.counter in ("admitted", "refused", "cancelled", "backend_errors")
    ]
    for number, reason in enumerate(recorded):
        request = Request(f"r{number}", "tenant_chat_pro", 0.0, 10, 10, "interactive")
        # Decided before dispatch: the core's queue and admission gates, a drain at the door.
        never_dispatched = reason.gates[0] in ("admission", "queue") or reason is Reason.DRAINING
        decision = Decision(
            request.request_id, request.tenant_id, "interactive", reason.status, reason,
            reason.gates[0], 30, 0.0, dispatch_ms=None if never_dispatched else 0.0,
        )  # fmt: skip
        sidecar.outcomes.completed(request, decision, status_code=reason.status, reason=reason)
    (series,) = sidecar.metrics.series.values()
    assert set(series.refused) == {r.value for r in reasons_counted_in("refused")}
    assert set(series.backend_errors) == {r.value for r in reasons_counted_in("backend_errors")}
    assert series.cancelled == len(reasons_counted_in("cancelled"))
    counts = sidecar.outcomes.tenant_counts["tenant_chat_pro"]
    assert counts["served"] == len(reasons_counted_in("admitted"))


def test_two_outcomes_the_reason_alone_would_count_wrong() -> None:
    # Why the sidecar's counting is not `Reason.counter` alone: (1) a request the upstream
    # answered with its own 5xx is recorded `admitted` (the answer is the upstream's, relayed)
    # and counted a backend error, under the code `admitted`; (2) a request refused in shadow
    # mode and served anyway keeps the refusal's reason (`refused` by its member) and is counted
    # served, and as a would-be refusal. Counting by the member would call (1) served and (2)
    # refused.
    from sidecar_support import keyed_config

    from tokenfair.core.cost import CostModel
    from tokenfair.server import Sidecar, make_backend
    from tokenfair.server.runtime_settings import SidecarSettings

    settings = SidecarSettings()
    sidecar = Sidecar(settings, keyed_config(), make_backend(settings, CostModel()))
    relayed = Request("r1", "tenant_chat_pro", 0.0, 10, 10, "interactive")
    decision = Decision(
        relayed.request_id, relayed.tenant_id, "interactive", 200, Reason.ADMITTED,
        "dispatch", 30, 0.0, dispatch_ms=0.0,
    )  # fmt: skip
    sidecar.outcomes.completed(relayed, decision, status_code=503, reason=Reason.ADMITTED)
    assert Reason.ADMITTED.counter == "admitted"
    (series,) = sidecar.metrics.series.values()
    assert series.backend_errors == {"admitted": 1}
    counts = sidecar.outcomes.tenant_counts["tenant_chat_pro"]
    assert (counts["backend_errors"], counts["served"]) == (1, 0)

    beside = Request("r2", "tenant_chat_pro", 0.0, 10, 10, "interactive")
    decision = Decision(
        beside.request_id, beside.tenant_id, "interactive", 200, Reason.QUEUE_FULL,
        "admission", 30, 0.0, dispatch_ms=0.0, would_refuse=True,
    )  # fmt: skip
    sidecar.outcomes.completed(beside, decision, status_code=200, reason=Reason.QUEUE_FULL)
    assert Reason.QUEUE_FULL.counter == "refused"
    assert series.refused == {}
    assert series.would_refuse == {"queue_full": 1}
    assert (counts["served"], counts["refused"], counts["would_refuse"]) == (1, 0, 1)
