"""``tokenfair simulate`` as a user runs it: the installed console script in a subprocess.

Behaviours under test:

* ``--format json`` prints the lesson's report shape (``comparison.<policy>`` with its keys and
  per-tenant rows), one entry per ``--policy`` (repeatable), in the order given;
* ``--set`` changes a policy key (``maxBatchWaitMs``) and a tenant field (``weight``) for real;
* ``--records`` writes one JSONL line per request per policy with the lesson's outcome fields;
* ``--plot`` writes a PNG;
* ``--trace`` replays a JSONL trace against ``--tenants`` (TenantQuota manifests);
* the streamed replay (a trace in order is read once per policy, decisions folded as they come)
  reports exactly what the in-memory functions (``simulate``, ``summarize``,
  ``fairness_report``) give, for a trace in order and one shuffled, with recorded usage and
  without, arrivals spread out or all at once;
* ``fold`` (the per-decision loop of a replay, the two tallies' steps inline) gives what
  ``SummaryTally.add`` and ``FairnessTally.add`` give, for decisions inside and outside the
  window, of configured and unknown tenants, refused at every gate, an open window too, and
  writes and keeps what it is given; and ``SummaryTally.summary`` (each TTFT sorted once, runs
  merged) gives the figures ``percentile`` gives over each tenant's and each class's list;
* bad inputs exit 2 with one line on stderr naming the field: a bad ``--set`` key, a trace with
  an unknown tenant, a trace line with a bad field, ``--trace`` without ``--tenants``, a
  ``--records`` path that cannot be written.
"""

from __future__ import annotations

import json
import os
import random
import resource
import subprocess
import sys
import threading
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest

from tokenfair.commands.simulate import fold
from tokenfair.config import PolicyConfig, TenantConfig, build_config, load_config
from tokenfair.core import Decision
from tokenfair.core.cost import CostModel
from tokenfair.records.codec import encode_decision, read_trace
from tokenfair.sim.fairness import (
    FairnessTally,
    decision_size,
    fairness_report,
    fairness_to_json,
)
from tokenfair.sim.report import SummaryTally, percentile, summarize
from tokenfair.sim.simulator import simulate

TOKENFAIR = Path(sys.executable).parent / "tokenfair"
LESSON_POLICIES = ["request_count_no_admission", "service_token_drr_with_admission"]
SUMMARY_KEYS = {
    "total_requests",
    "admitted_requests",
    "shed_429_requests",
    "interactive_p50_ttft_ms",
    "interactive_p99_ttft_ms",
    "batch_p99_ttft_ms",
    "peak_kv_occupancy_ratio",
    "shed_reasons",
    "tenants",
}
TENANT_KEYS = {
    "submitted",
    "admitted",
    "shed_429",
    "admitted_service_tokens",
    "p50_ttft_ms",
    "p99_ttft_ms",
}
LESSON_OUTCOME_FIELDS = {
    "request_id",
    "tenant_id",
    "priority_class",
    "status_code",
    "reason",
    "service_tokens",
    "ttft_ms",
    "queue_wait_ms",
    "kv_occupancy_ratio",
}


def tokenfair(*args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TOKENFAIR), "simulate", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def report(*args: str | Path, cwd: Path) -> dict[str, Any]:
    done = tokenfair(*args, "--format", "json", cwd=cwd)
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_json_report_has_the_lesson_shape(tmp_path: Path) -> None:
    result = report("--scenario", "noisy-neighbor", cwd=tmp_path)
    assert result["experiment"] == "multi-tenant-service-token-drr-and-admission-control"
    assert result["decode_weight"] == 4
    # Default: the lesson's two policies, then ours.
    assert list(result["comparison"]) == [*LESSON_POLICIES, "tokenfair"]
    for summary in result["comparison"].values():
        assert set(summary) == SUMMARY_KEYS
        assert summary["total_requests"] == 18 + 24 + 18
        assert summary["admitted_requests"] + summary["shed_429_requests"] == 60
        assert sum(summary["shed_reasons"].values()) == summary["shed_429_requests"]
        assert set(summary["tenants"]) == {
            "tenant_batch_rag",
            "tenant_chat_pro",
            "tenant_ide_assist",
        }
        for row in summary["tenants"].values():
            assert set(row) == TENANT_KEYS
    ours = result["comparison"]["tokenfair"]
    # Everything admitted: 18 * (3200 + 4*350), 24 * (280 + 4*90), 18 * (420 + 4*60).
    assert {t: row["admitted_service_tokens"] for t, row in ours["tenants"].items()} == {
        "tenant_batch_rag": 18 * 4600,
        "tenant_chat_pro": 24 * 640,
        "tenant_ide_assist": 18 * 660,
    }
    assert ours["shed_reasons"] == {}


def test_policy_is_repeatable_and_keeps_its_order(tmp_path: Path) -> None:
    result = report(
        "--scenario",
        "noisy-neighbor",
        "--policy",
        "tokenfair",
        "--policy",
        "service_token_drr_with_admission",
        cwd=tmp_path,
    )
    assert list(result["comparison"]) == ["tokenfair", "service_token_drr_with_admission"]


def test_set_policy_key_takes_effect(tmp_path: Path) -> None:
    # The starvation scenario lets batch work wait up to its own limit (far above 5 s); with a
    # 5 s limit more batch work is refused, every refusal names the 5 s limit it was judged by,
    # and every batch start is within it.
    records = tmp_path / "records.jsonl"
    args = ["--scenario", "starvation", "--policy", "tokenfair"]
    default = report(*args, cwd=tmp_path)["comparison"]["tokenfair"]
    limited = report(*args, "--set", "maxBatchWaitMs=5000", "--records", records, cwd=tmp_path)
    shortened = limited["comparison"]["tokenfair"]
    batch_admitted = shortened["tenants"]["tenant_batch_rag"]["admitted"]
    assert batch_admitted < default["tenants"]["tenant_batch_rag"]["admitted"]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    batch = [r for r in rows if r["priority_class"] == "batch"]
    assert max(r["queue_wait_ms"] for r in batch if r["status_code"] == 200) <= 5000
    refused = [r for r in batch if r["status_code"] == 429]
    assert refused
    assert {r["observed"]["max_wait_ms"] for r in refused} == {5000}


TENANTS_YAML = """\
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata:
  name: batch-rag
spec:
  tenantId: tenant_batch_rag
  weight: 1
  burstServiceTokens: 1000000
  sustainedServiceTokensPerSecond: 1000000
  priorityClass: batch
---
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata:
  name: batch-etl
spec:
  tenantId: tenant_batch_etl
  weight: 1
  burstServiceTokens: 1000000
  sustainedServiceTokensPerSecond: 1000000
  priorityClass: batch
"""


def write_trace(tmp_path: Path, lines: list[dict[str, object]]) -> tuple[Path, Path]:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS_YAML, encoding="utf-8")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return trace, tenants


def backlog() -> list[dict[str, object]]:
    """Two batch tenants, 12 requests each at t=0 of 800 + 4 * 100 = 1200 service tokens."""
    return [
        {
            "request_id": f"{tenant}-{i:02d}",
            "tenant_id": f"tenant_batch_{tenant}",
            "arrival_ms": 0,
            "prefill_tokens": 800,
            "decode_tokens": 100,
            "priority_class": "batch",
        }
        for tenant in ("etl", "rag")
        for i in range(12)
    ]


def first_dispatches(records: Path, count: int) -> list[str]:
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    admitted = sorted((r for r in rows if r["status_code"] == 200), key=lambda r: r["dispatch_ms"])
    return [r["tenant_id"].removeprefix("tenant_batch_") for r in admitted[:count]]


def test_trace_with_tenant_manifests_and_a_weight_override(tmp_path: Path) -> None:
    trace, tenants = write_trace(tmp_path, backlog())
    records = tmp_path / "records.jsonl"
    common: list[str | Path] = [
        *("--trace", trace, "--tenants", tenants),
        *("--policy", "tokenfair", "--records", records),
    ]
    result = report(*common, cwd=tmp_path)["comparison"]["tokenfair"]
    assert result["admitted_requests"] == 24
    assert set(result["tenants"]) == {"tenant_batch_etl", "tenant_batch_rag"}
    # Equal weights, quantum 1200 each: one 1200-token request per turn, etl first (it arrived
    # first in (arrival_ms, request_id) order).
    assert first_dispatches(records, 6) == ["etl", "rag"] * 3
    report(*common, "--set", "tenants.tenant_batch_rag.weight=2", cwd=tmp_path)
    # rag's quantum is now 2400: two requests per turn against etl's one.
    assert first_dispatches(records, 6) == ["etl", "rag", "rag"] * 2


def spread_with_usage() -> list[dict[str, object]]:
    """Both tenants, arrivals every 0-3 ms (ties included), about half with recorded usage."""
    rng = random.Random(7)
    lines: list[dict[str, object]] = []
    arrival_ms = 0.0
    for i in range(120):
        arrival_ms += rng.choice((0, 0.5, 1, 3))
        line: dict[str, object] = {
            "request_id": f"q{i:03d}",
            "tenant_id": rng.choice(("tenant_batch_etl", "tenant_batch_rag")),
            "arrival_ms": arrival_ms,
            "prefill_tokens": rng.randint(100, 900),
            "decode_tokens": rng.randint(10, 200),
            "priority_class": "batch",
        }
        if i % 2:
            line["actual_decode_tokens"] = rng.randint(0, 250)
        lines.append(line)
    return lines


@pytest.mark.parametrize("shuffled", [False, True])
@pytest.mark.parametrize("make_lines", [backlog, spread_with_usage])
def test_streamed_report_is_the_in_memory_report(
    tmp_path: Path, shuffled: bool, make_lines: Any
) -> None:
    lines = make_lines()
    if shuffled:
        random.Random(3).shuffle(lines)
    trace, tenants = write_trace(tmp_path, lines)
    policies = ["service_token_drr_with_admission", "tokenfair"]
    result = report(
        *("--trace", trace, "--tenants", tenants),
        *("--policy", policies[0]),
        *("--policy", policies[1]),
        cwd=tmp_path,
    )
    config = load_config(tenants)
    cost = CostModel.from_policy(config.policy)
    records = read_trace(trace)
    actual = {
        r.request.request_id: cost.service_tokens(*used)
        for r in records
        if (used := r.actual_tokens()) is not None
    }
    actual_kv = {
        r.request.request_id: cost.kv_blocks(*used)
        for r in records
        if (used := r.actual_tokens()) is not None
    }
    for policy in policies:
        decisions = simulate(config, [r.request for r in records], policy, actual, actual_kv)
        assert result["comparison"][policy] == summarize(decisions)
        expected = fairness_report(decisions, config, actual_service_tokens=actual)
        assert result["fairness"][policy] == json.loads(json.dumps(fairness_to_json(expected)))


def test_records_one_line_per_request_per_policy(tmp_path: Path) -> None:
    records = tmp_path / "out.jsonl"
    report("--scenario", "noisy-neighbor", "--records", records, cwd=tmp_path)
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == 3 * 60
    for policy in [*LESSON_POLICIES, "tokenfair"]:
        mine = [r for r in rows if r["policy"] == policy]
        assert len(mine) == len({r["request_id"] for r in mine}) == 60
    for row in rows:
        assert set(row) >= LESSON_OUTCOME_FIELDS
        assert (row["status_code"] == 200) == (row["reason"] == "admitted")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    picture = tmp_path / "out.png"
    done = tokenfair("--scenario", "noisy-neighbor", "--plot", picture, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def bad_run(tmp_path: Path, *args: str | Path) -> str:
    done = tokenfair(*args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("tokenfair simulate: error: ")
    return lines[0]


def test_bad_set_key(tmp_path: Path) -> None:
    line = bad_run(tmp_path, "--scenario", "noisy-neighbor", "--set", "maxBatchWait=5000")
    assert "--set maxBatchWait: unknown parameter" in line


def test_bad_set_value(tmp_path: Path) -> None:
    line = bad_run(
        tmp_path, "--scenario", "noisy-neighbor", "--set", "tenants.tenant_batch_rag.weight=-2"
    )
    assert "tenants.tenant_batch_rag.weight: must be > 0" in line


def test_trace_with_an_unknown_tenant(tmp_path: Path) -> None:
    lines = backlog()
    lines[3] = {**lines[3], "tenant_id": "tenant_nobody"}
    trace, tenants = write_trace(tmp_path, lines)
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants)
    assert f"{trace}:4: tenant_id 'tenant_nobody' is not in the tenants file" in line


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("arrival_ms", -1, "arrival_ms must be a number >= 0 and <= 1e+15"),
        ("decode_tokens", 1.5, "decode_tokens must be an integer >= 0"),
        ("priority_class", "realtime", "priority_class must be one of interactive, batch"),
        ("surprise", 1, "unknown field(s) surprise"),
    ],
)
def test_trace_line_with_a_bad_field(
    tmp_path: Path, field: str, value: object, message: str
) -> None:
    lines = backlog()
    lines[1] = {**lines[1], field: value}
    trace, tenants = write_trace(tmp_path, lines)
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants)
    assert f"{trace}:2: {message}" in line


def test_records_path_that_cannot_be_written(tmp_path: Path) -> None:
    target = tmp_path / "missing" / "records.jsonl"
    line = bad_run(tmp_path, "--scenario", "noisy-neighbor", "--records", target)
    assert f"--records {target}: cannot write (No such file or directory)" in line


def test_records_of_a_trace_bad_late_leave_the_file_as_it_was(tmp_path: Path) -> None:
    # The first replay reads and validates in one pass and writes records as it goes: they go
    # to a file aside, and the target is replaced only when every replay has finished.
    lines = spread_with_usage()
    lines[110] = {**lines[110], "decode_tokens": -5}
    trace, tenants = write_trace(tmp_path, lines)
    records = tmp_path / "records.jsonl"
    records.write_text("earlier records\n", encoding="utf-8")
    records.chmod(0o600)
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants, "--records", records)
    assert f"{trace}:111: decode_tokens must be an integer >= 0" in line
    assert records.read_text(encoding="utf-8") == "earlier records\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "records.jsonl",
        "tenants.yaml",
        "trace.jsonl",
    ]
    # A good run replaces it, keeping its permissions, and leaves nothing aside.
    lines[110] = {**lines[110], "decode_tokens": 5}
    trace.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    report("--trace", trace, "--tenants", tenants, "--records", records, cwd=tmp_path)
    assert len(records.read_text(encoding="utf-8").splitlines()) == 3 * len(lines)
    assert records.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "records.jsonl",
        "tenants.yaml",
        "trace.jsonl",
    ]


def test_records_of_a_trace_out_of_order_are_those_of_the_sorted_trace(tmp_path: Path) -> None:
    # The first replay stops at the first line out of order (its records so far are dropped)
    # and every policy replays the trace sorted.
    lines = spread_with_usage()
    lines[80], lines[81] = lines[81], lines[80]
    if lines[80]["arrival_ms"] == lines[81]["arrival_ms"]:  # keep it out of order for sure
        lines[80], lines[90] = lines[90], lines[80]
    out_of_order = tmp_path / "shuffled"
    in_order = tmp_path / "sorted"
    for folder, rows in (
        (out_of_order, lines),
        (in_order, sorted(lines, key=lambda r: (r["arrival_ms"], r["request_id"]))),
    ):
        folder.mkdir()
        trace, tenants = write_trace(folder, rows)
        report("--trace", trace, "--tenants", tenants, "--records", folder / "r.jsonl", cwd=folder)
    assert (out_of_order / "r.jsonl").read_bytes() == (in_order / "r.jsonl").read_bytes()


def test_records_into_a_pipe_are_written_in_place(tmp_path: Path) -> None:
    # A target that cannot be replaced (a FIFO) is written in place, the trace validated first:
    # a bad line sends nothing down the pipe, which is not even opened.
    trace, tenants = write_trace(tmp_path, spread_with_usage())
    regular = tmp_path / "regular.jsonl"
    report("--trace", trace, "--tenants", tenants, "--records", regular, cwd=tmp_path)
    fifo = tmp_path / "records.fifo"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()))
    reader.start()
    report("--trace", trace, "--tenants", tenants, "--records", fifo, cwd=tmp_path)
    reader.join(timeout=60)
    assert received == [regular.read_bytes()]
    lines = spread_with_usage()
    lines[100] = {**lines[100], "arrival_ms": -1}
    trace.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    # No reader: the command must not even open the pipe (it would wait for one).
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants, "--records", fifo)
    assert f"{trace}:101: arrival_ms must be a number >= 0 and <= 1e+15" in line


def test_a_repeated_id_the_replay_meets_first_is_reported_as_the_reader_does(
    tmp_path: Path,
) -> None:
    # The one pass checks repeated ids at the end of the file; here the replay meets the second
    # `a` while the first is still queued, and the error is still the reader's, at its line.
    lines = [{**backlog()[0], "request_id": "a", "arrival_ms": t} for t in (0, 1)]
    lines.append({**backlog()[1], "surprise": 1})  # a later bad line does not hide it
    trace, tenants = write_trace(tmp_path, lines)
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants)
    assert line == f"tokenfair simulate: error: {trace}:2: duplicate request_id 'a'"


def test_records_through_a_link_are_written_where_it_points(tmp_path: Path) -> None:
    trace, tenants = write_trace(tmp_path, backlog())
    target = tmp_path / "real.jsonl"
    target.write_text("old\n", encoding="utf-8")
    link = tmp_path / "link.jsonl"
    link.symlink_to(target)
    report("--trace", trace, "--tenants", tenants, "--records", link, cwd=tmp_path)
    assert link.is_symlink()
    assert len(target.read_text(encoding="utf-8").splitlines()) == 3 * 24
    # An open descriptor named by /dev/fd (a link too) is written through, as a shell's `3>f`.
    out = tmp_path / "fd.jsonl"
    with out.open("wb") as handle:
        done = subprocess.run(
            [str(TOKENFAIR), "simulate", "--trace", str(trace), "--tenants", str(tenants),
             "--records", f"/dev/fd/{handle.fileno()}"],
            pass_fds=(handle.fileno(),), capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert out.read_bytes() == target.read_bytes()


def test_records_with_a_second_name_are_written_in_place(tmp_path: Path) -> None:
    # A hard link: renaming over one name would split them; both names see the records.
    trace, tenants = write_trace(tmp_path, backlog())
    records = tmp_path / "records.jsonl"
    records.write_text("old\n", encoding="utf-8")
    other = tmp_path / "other-name.jsonl"
    other.hardlink_to(records)
    report("--trace", trace, "--tenants", tenants, "--records", records, cwd=tmp_path)
    assert records.stat().st_ino == other.stat().st_ino
    assert len(other.read_text(encoding="utf-8").splitlines()) == 3 * 24


def test_a_write_that_fails_leaves_no_file_aside(tmp_path: Path) -> None:
    # The file size limit stops the records midway: one line on stderr, exit 1, the target as
    # it was, and nothing left aside (closing the file aside fails too: it is removed anyway).
    trace, tenants = write_trace(tmp_path, spread_with_usage() * 1)
    records = tmp_path / "records.jsonl"
    records.write_text("earlier\n", encoding="utf-8")
    limit = 4096

    def small_files() -> None:
        resource.setrlimit(
            resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1])
        )

    done = subprocess.run(
        [str(TOKENFAIR), "simulate", "--trace", str(trace), "--tenants", str(tenants),
         "--records", str(records), "--format", "json"],
        preexec_fn=small_files, capture_output=True, text=True, check=False, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("tokenfair simulate: error: ")
    assert "File too large" in done.stderr
    assert records.read_text(encoding="utf-8") == "earlier\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "records.jsonl",
        "tenants.yaml",
        "trace.jsonl",
    ]


def test_records_in_place_when_no_file_aside_can_be_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A folder that refuses the new name (here: every os.open for writing refuses; the reads
    # open their files with os.open too): the records are written in place, the trace
    # validated before FILE is truncated.
    from tokenfair.cli import main

    real_open = os.open

    def refuse(path: str, flags: int, *args: int, **kwargs: object) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):  # the command's only one: the file aside
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refuse)
    lines = backlog()
    lines[7] = {**lines[7], "decode_tokens": -1}
    trace, tenants = write_trace(tmp_path, lines)
    records = tmp_path / "records.jsonl"
    records.write_text("earlier\n", encoding="utf-8")
    args = ["simulate", "--trace", str(trace), "--tenants", str(tenants), "--no-progress"]
    assert main([*args, "--records", str(records)]) == 2
    assert f"{trace}:8: decode_tokens must be an integer >= 0" in capsys.readouterr().err
    assert records.read_text(encoding="utf-8") == "earlier\n"
    lines[7] = {**lines[7], "decode_tokens": 100}
    trace.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    assert main([*args, "--records", str(records)]) == 0
    assert len(records.read_text(encoding="utf-8").splitlines()) == 3 * 24
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "records.jsonl",
        "tenants.yaml",
        "trace.jsonl",
    ]


def test_a_plot_that_fails_keeps_the_records(tmp_path: Path) -> None:
    trace, tenants = write_trace(tmp_path, backlog())
    records = tmp_path / "records.jsonl"
    done = tokenfair(
        *("--trace", trace, "--tenants", tenants, "--records", records),
        *("--plot", tmp_path / "missing" / "plot.png"),
        cwd=tmp_path,
    )
    assert done.returncode != 0
    assert len(records.read_text(encoding="utf-8").splitlines()) == 3 * 24


def test_a_bad_trace_is_reported_before_a_records_path_that_cannot_be_written(
    tmp_path: Path,
) -> None:
    lines = backlog()
    lines[5] = {**lines[5], "decode_tokens": -1}
    trace, tenants = write_trace(tmp_path, lines)
    target = tmp_path / "missing" / "records.jsonl"
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants, "--records", target)
    assert f"{trace}:6: decode_tokens must be an integer >= 0" in line


def test_trace_without_tenants(tmp_path: Path) -> None:
    trace, _ = write_trace(tmp_path, backlog())
    assert "--trace needs --tenants" in bad_run(tmp_path, "--trace", trace)


def test_bad_tenants_file(tmp_path: Path) -> None:
    trace, tenants = write_trace(tmp_path, backlog())
    tenants.write_text(TENANTS_YAML.replace("weight: 1\n", "weight: 0\n", 1), encoding="utf-8")
    line = bad_run(tmp_path, "--trace", trace, "--tenants", tenants)
    assert "TenantQuota 'batch-rag': spec.weight: must be > 0" in line


def fold_cases() -> list[tuple[list[tuple[Decision, int | None]], tuple[float, float | None]]]:
    rng = random.Random(11)
    decisions: list[tuple[Decision, int | None]] = []
    for number in range(400):
        tenant_id = rng.choice(["tenant_batch_etl", "tenant_batch_rag", "tenant_chat_pro", "ghost"])
        status, reason, gate = rng.choice(
            [
                (200, "admitted", "dispatch"),
                (200, "admitted", "dispatch"),
                (429, "shed_kv_watermark", "admission"),
                (429, "shed_queue_timeout", "queue"),
                (429, "shed_kv_watermark", "dispatch"),
                (499, "cancelled", "queue"),
                (502, "admitted", "dispatch"),
            ]
        )
        arrival_ms = rng.uniform(0.0, 1200.0)
        dispatch_ms = arrival_ms + rng.uniform(0.0, 300.0) if gate == "dispatch" else None
        decision = Decision(
            f"d{number:04d}",
            tenant_id,
            rng.choice(["interactive", "batch"]),
            status,
            reason,
            gate,
            rng.randint(1, 5000),
            arrival_ms,
            rng.random(),
            0.0,
            rng.uniform(0.0, 900.0),
            dispatch_ms,
            actual_service_tokens=rng.choice([None, rng.randint(0, 9000)]),
        )
        decisions.append((decision, rng.choice([None, rng.randint(0, 9000)])))
    return [(decisions, (100.0, 1000.0)), (decisions, (0.0, 1200.0)), (decisions, (500.0, None))]


@pytest.mark.parametrize("case", range(3))
def test_fold_counts_writes_and_keeps_every_decision(case: int) -> None:
    config = build_config(
        PolicyConfig(),
        [
            TenantConfig("tenant_chat_pro", 2.0, 48000, 180000.0, "interactive"),
            TenantConfig("tenant_batch_rag", 1.0, 28000, 60000.0, "batch"),
            TenantConfig("tenant_batch_etl", 1.0, 28000, 60000.0, "batch"),
        ],
    )
    decisions, window = fold_cases()[case]
    summary, fairness = SummaryTally(), FairnessTally(config, window)
    for decision, actual in decisions:
        summary.add(decision)
        fairness.add(decision, decision_size(decision, actual))
    folded_summary, folded_fairness = SummaryTally(), FairnessTally(config, window)
    written = BytesIO()
    kept: list[Decision] = []
    fold(decisions, folded_summary, folded_fairness, written, "p", kept)
    assert folded_summary.summary() == summary.summary()
    assert folded_fairness.report() == fairness.report()
    assert written.getvalue() == b"".join(encode_decision(d, "p") for d, _ in decisions)
    assert kept == [d for d, _ in decisions]


def test_summary_reads_each_percentile_off_every_ttft_sorted_once() -> None:
    # `SummaryTally.summary` sorts each tenant's TTFTs of each class once and merges the
    # runs (issue 17, third pass): the same figures as `percentile` over each whole list.
    decisions = [d for d, _ in fold_cases()[0][0]]
    tally = SummaryTally()
    for decision in decisions:
        tally.add(decision)
    ok = [d for d in decisions if d.status_code == 200]
    tenants = sorted({d.tenant_id for d in decisions})
    expected_tenants = {}
    for tenant_id in tenants:
        ttfts = [d.ttft_ms for d in ok if d.tenant_id == tenant_id]
        expected_tenants[tenant_id] = {
            "submitted": sum(d.tenant_id == tenant_id for d in decisions),
            "admitted": len(ttfts),
            "shed_429": sum(d.tenant_id == tenant_id and d.status_code == 429 for d in decisions),
            "admitted_service_tokens": sum(
                d.service_tokens for d in ok if d.tenant_id == tenant_id
            ),
            "p50_ttft_ms": percentile(ttfts, 50),
            "p99_ttft_ms": percentile(ttfts, 99),
        }
    interactive = [d.ttft_ms for d in ok if d.priority_class == "interactive"]
    batch = [d.ttft_ms for d in ok if d.priority_class == "batch"]
    summary = tally.summary()
    assert summary["tenants"] == expected_tenants
    assert (
        summary["admitted_requests"],
        summary["interactive_p50_ttft_ms"],
        summary["interactive_p99_ttft_ms"],
        summary["batch_p99_ttft_ms"],
    ) == (
        len(ok),
        percentile(interactive, 50),
        percentile(interactive, 99),
        percentile(batch, 99),
    )
    assert SummaryTally().summary()["batch_p99_ttft_ms"] == 0.0
