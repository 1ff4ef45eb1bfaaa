"""The ``tokenfair`` command's common surface, as a user runs it (the console script, real files).

Behaviours under test:

* ``tokenfair --version`` prints ``tokenfair <version>``, the installed distribution's version
  (its metadata), and exits 0;
* one ``--format`` vocabulary: every subcommand with ``--format`` offers ``table`` and ``json``;
  ``text`` (calibrate's old name) is still accepted by each, with a deprecation warning on stderr,
  and gives exactly the ``table`` output; an unknown format exits 2 naming ``--format``;
* progress bars: on a pseudo-terminal (``pty``) ``simulate``, ``trace generate`` and
  ``calibrate`` draw a tqdm bar on stderr, and stdout still holds the report alone; on a pipe,
  or with ``--no-progress`` on a terminal, stderr stays empty (and no bar is wanted under
  ``CI=true``); a hidden bar adds nothing to the replay loop (``Bar.iterate`` returns the
  iterable itself) and a shown one is updated every ``UPDATE_EVERY`` items, not per item;
* ``--plot``: the PNG has a title, a legend naming every tenant (one with no admitted request
  too) read back from the figure and from the PNG's text, panels of a row share their limits;
  refused service is drawn (hatched bars); the fairness row gives Jain per lane against the fluid
  reference and against the windowed share;
* ``simulate --tenants`` and ``trace generate --tenants`` read the sidecar's own config file
  (``examples/sidecar-standalone.yaml``) as it is; a ``sidecar:`` section that is not a mapping
  is still an error naming it, and a misspelled policy field is still refused;
* the end of a command: ``simulate`` and ``report`` leave the process without the interpreter's
  teardown, their output whole: a report written to a file is the one ``main`` prints
  in-process; a reader gone before the report is written (as ``| head`` goes) ends it with 0 and no
  traceback; a full
  disk (``/dev/full``) is one line on stderr and exit 1, in either format.
"""

from __future__ import annotations

import argparse
import fcntl
import importlib.metadata
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import zlib
from pathlib import Path
from typing import Any

import pytest
from repo_paths import REPO_ROOT

from tokenfair.cli import build_parser
from tokenfair.commands import progress
from tokenfair.core import Decision
from tokenfair.sim.fairness import fairness_report
from tokenfair.sim.plot import plot_report
from tokenfair.sim.scenarios import SCENARIOS
from tokenfair.sim.simulator import simulate

REPO = REPO_ROOT
EXAMPLE = REPO / "examples" / "sidecar-standalone.yaml"
TOKENFAIR = str(Path(sys.executable).parent / "tokenfair")
TENANTS_YAML = """\
apiVersion: tokenfair.io/v1alpha1
kind: TokenfairConfig
tenants:
- {tenantId: tenant_chat_pro, weight: 2, burstServiceTokens: 48000,
   sustainedServiceTokensPerSecond: 180000, priorityClass: interactive}
- {tenantId: tenant_ide_assist, weight: 1.5, burstServiceTokens: 36000,
   sustainedServiceTokensPerSecond: 140000, priorityClass: interactive}
- {tenantId: tenant_batch_rag, weight: 1, burstServiceTokens: 28000,
   sustainedServiceTokensPerSecond: 60000, priorityClass: batch}
"""


def run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TOKENFAIR, *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def on_terminal(*args: str | Path, cwd: Path) -> tuple[int, str, bytes]:
    """Run ``tokenfair ARGS`` with stderr on a pseudo-terminal (80 columns) and stdout on a
    pipe: its exit code, its stdout and everything it wrote to the terminal."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "TQDM_DISABLE")}
    with subprocess.Popen(
        [TOKENFAIR, *map(str, args)],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=slave,
        env=env,
    ) as process:
        os.close(slave)
        terminal = bytearray()
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every end of the terminal's slave side is closed
                break
            if not chunk:
                break
            terminal += chunk
        assert process.stdout is not None
        stdout = process.stdout.read().decode()
        code = process.wait(timeout=120)
    os.close(master)
    return code, stdout, bytes(terminal)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    done = run(
        *("trace", "generate", "--requests", "3000", "--seed", "3", "--observe"),
        *("--out", path),
    )
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture
def tenants(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML, encoding="utf-8")
    return path


# --- --version ------------------------------------------------------------------------------


def test_version_is_the_installed_distributions() -> None:
    done = run("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"tokenfair {importlib.metadata.version('tokenfair')}\n"
    assert done.stderr == ""
    assert "--version" in run("--help").stdout


# --- --format -------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser, dest: str) -> dict[str, Any]:
    (action,) = (a for a in parser._actions if a.dest == dest)
    assert isinstance(action, argparse._SubParsersAction)
    return dict(action.choices)


def _format_actions() -> dict[str, Any]:
    found = {}
    for name, sub in _subparsers(build_parser(), "command").items():
        nested = [a for a in sub._actions if a.dest == "trace_command"]
        parsers = _subparsers(sub, "trace_command").values() if nested else [sub]
        for each in parsers:
            for action in each._actions:
                if action.dest == "format":
                    found[name] = action
    return found


def test_every_format_flag_offers_table_and_json() -> None:
    actions = _format_actions()
    assert set(actions) == {"simulate", "loadgen", "calibrate", "report", "reasons"}
    for name, action in actions.items():
        assert action.default == "table", name
        assert action.metavar == "{table,json}", name
        assert set(action.choices) == {"table", "json", "text"}, name


def test_text_is_a_deprecated_alias_of_table(trace: Path, tenants: Path, tmp_path: Path) -> None:
    table = run("calibrate", "--records", trace, "--format", "table")
    text = run("calibrate", "--records", trace, "--format", "text")
    default = run("calibrate", "--records", trace)
    assert table.returncode == text.returncode == default.returncode == 0, text.stderr
    assert text.stdout == table.stdout == default.stdout
    assert "apply with:" in table.stdout
    assert table.stderr == ""
    assert text.stderr == (
        "tokenfair calibrate: warning: --format text is deprecated; use --format table\n"
    )
    simulated = run(
        *("simulate", "--trace", trace, "--tenants", tenants, "--policy", "tokenfair"),
        *("--format", "text"),
    )
    assert simulated.returncode == 0, simulated.stderr
    assert simulated.stdout.startswith("tokenfair: admitted ")
    assert "deprecated; use --format table" in simulated.stderr
    records = tmp_path / "out.jsonl"
    run("simulate", "--scenario", "noisy-neighbor", "--records", records)
    reported = run("report", "--records", records, "--format", "text")
    assert reported.returncode == 0, reported.stderr
    assert reported.stdout == run("report", "--records", records).stdout


@pytest.mark.parametrize("command", ["simulate", "calibrate", "report"])
def test_unknown_format_exits_2_naming_the_flag(command: str, trace: Path) -> None:
    source = ["--scenario", "noisy-neighbor"] if command == "simulate" else ["--records", trace]
    done = run(command, *source, "--format", "xml")
    assert done.returncode == 2
    assert "--format" in done.stderr
    assert "invalid choice: 'xml'" in done.stderr


# --- progress bars --------------------------------------------------------------------------


def test_simulate_draws_a_bar_on_a_terminal_only(trace: Path, tenants: Path) -> None:
    args = ("simulate", "--trace", trace, "--tenants", tenants, "--policy", "tokenfair")
    code, stdout, terminal = on_terminal(*args, "--format", "json", cwd=trace.parent)
    assert code == 0, terminal
    # The report on stdout is untouched by the bar.
    assert json.loads(stdout)["comparison"]["tokenfair"]["total_requests"] == 3000
    assert b"simulate tokenfair (1/1)" in terminal
    assert b"/3.00k" in terminal  # tqdm's count of the requests, "N/3.00k"
    # Not on a pipe ...
    piped = run(*args, "--format", "json")
    assert piped.returncode == 0
    assert piped.stderr == ""
    assert piped.stdout == stdout
    # ... nor with --no-progress on a terminal.
    code, quiet, terminal = on_terminal(
        *args, "--format", "json", "--no-progress", cwd=trace.parent
    )
    assert code == 0
    assert terminal == b""
    assert quiet == stdout


def test_trace_generate_and_calibrate_draw_bars_on_a_terminal(tmp_path: Path) -> None:
    out = tmp_path / "t.jsonl"
    generate = ("trace", "generate", "--requests", "2500", "--observe", "--seed", "5")
    code, stdout, terminal = on_terminal(*generate, "--out", out, cwd=tmp_path)
    assert code == 0, terminal
    assert stdout == ""
    assert b"trace generate" in terminal
    assert len(out.read_text().splitlines()) == 2500
    code, stdout, terminal = on_terminal("calibrate", "--records", out, cwd=tmp_path)
    assert code == 0, terminal
    assert b"calibrate:" in terminal
    assert b"fitting" in terminal
    assert "apply with:" in stdout
    # On a pipe: nothing but the report.
    done = run("calibrate", "--records", out)
    assert done.stderr == ""
    assert done.stdout == stdout


def test_a_hidden_bar_costs_nothing_and_a_shown_one_updates_in_batches() -> None:
    items = iter(range(10))
    assert progress.Bar().iterate(items) is items  # no wrapper in the loop

    class Counter:
        def __init__(self) -> None:
            self.updates: list[int] = []

        def update(self, count: int) -> None:
            self.updates.append(count)

        def close(self) -> None:
            pass

    counter = Counter()
    bar = progress.Bar(counter)
    assert list(bar.iterate(range(2 * progress.UPDATE_EVERY + 5))) == list(
        range(2 * progress.UPDATE_EVERY + 5)
    )
    assert counter.updates == [progress.UPDATE_EVERY, progress.UPDATE_EVERY, 5]


def test_no_bar_is_wanted_off_a_terminal_or_with_no_progress(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    parser = build_parser(("simulate",))
    args = parser.parse_args(["simulate", "--scenario", "noisy-neighbor"])
    assert args.progress is True
    assert progress.wanted(args) is False  # pytest's stderr is not a terminal
    assert progress.bar(args, "x").shown is False

    class Terminal:
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.delenv("CI", raising=False)
    assert progress.wanted(args) is True
    monkeypatch.setenv("CI", "false")
    assert progress.wanted(args) is True
    monkeypatch.setenv("CI", "true")  # a CI job's log, even on a pseudo-terminal
    assert progress.wanted(args) is False
    monkeypatch.delenv("CI")
    quiet = parser.parse_args(["simulate", "--scenario", "noisy-neighbor", "--no-progress"])
    assert progress.wanted(quiet) is False


# --- --plot ---------------------------------------------------------------------------------


def png_text(path: Path) -> dict[str, str]:
    """The tEXt / zTXt / iTXt chunks of a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks: dict[str, str] = {}
    offset = 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        body = data[offset + 8 : offset + 8 + length]
        offset += 12 + length
        if kind == b"tEXt":
            key, _, value = body.partition(b"\0")
            chunks[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"zTXt":
            key, _, rest = body.partition(b"\0")
            chunks[key.decode("latin-1")] = zlib.decompress(rest[1:]).decode("latin-1")
        elif kind == b"iTXt":
            key, _, rest = body.partition(b"\0")
            compressed, rest = rest[0], rest[2:]
            _, _, rest = rest.partition(b"\0")  # language tag
            _, _, text = rest.partition(b"\0")  # translated keyword
            chunks[key.decode("latin-1")] = (zlib.decompress(text) if compressed else text).decode(
                "utf-8"
            )
    return chunks


def _decision(request_id: str, tenant: str, status: int, ttft_ms: float) -> Decision:
    return Decision(
        request_id=request_id,
        tenant_id=tenant,
        priority_class="batch" if tenant == "batch" else "interactive",
        status_code=status,
        reason="admitted" if status == 200 else "shed_kv_watermark",
        gate="dispatch" if status == 200 else "admission",
        arrival_ms=0.0,
        service_tokens=1000 if tenant == "batch" else 100,
        ttft_ms=ttft_ms,
    )


def test_plot_shows_every_tenant_on_shared_axes(tmp_path: Path) -> None:
    # "batch" is refused everywhere in policy "strict" (no CDF line there); "quiet" only
    # appears in policy "open"; "a" and "b" have identical TTFTs (their lines coincide).
    results = {
        "strict": [
            *(_decision(f"a{i}", "a", 200, 50.0 + i) for i in range(5)),
            *(_decision(f"b{i}", "b", 200, 50.0 + i) for i in range(5)),
            *(_decision(f"x{i}", "batch", 429, 0.0) for i in range(3)),
        ],
        "open": [
            *(_decision(f"a{i}", "a", 200, 500.0 + 100 * i) for i in range(5)),
            *(_decision(f"x{i}", "batch", 200, 3000.0 + i) for i in range(3)),
            _decision("q0", "quiet", 200, 5.0),
        ],
    }
    picture = tmp_path / "plot.png"
    summary = plot_report(results, picture, title="two policies")
    assert summary.title == "two policies"
    assert summary.legend_tenants == ("a", "b", "batch", "quiet")
    assert len(set(summary.ttft_xlims)) == 1  # one shared TTFT axis for the row
    assert len(set(summary.service_ylims)) == 1
    low, high = summary.service_ylims[0]
    assert low == 0
    assert high >= 3 * 1000  # the refused batch tokens (3 x 1000) are drawn, stacked
    text = png_text(picture)
    assert text["Title"] == "two policies"
    assert text["Description"] == "tenants: a, b, batch, quiet"


def test_plot_fairness_row_shows_both_references(tmp_path: Path) -> None:
    config, requests = SCENARIOS["starvation"]()
    decisions = simulate(config, requests, "service_token_drr_with_admission")
    report = fairness_report(decisions, config)
    summary = plot_report({"lesson": decisions}, tmp_path / "plot.png", {"lesson": report})
    fluid, windowed = report.fluid_jain_by_lane, report.jain_by_lane
    assert fluid["interactive"] is not None
    assert windowed["interactive"] is not None
    assert summary.fairness_titles == (
        f"Jain vs fluid reference: interactive {fluid['interactive']:.3f}, batch 1.000; "
        f"vs windowed share: interactive {windowed['interactive']:.3f}, batch 1.000",
    )
    # The row's shared axis reaches the highest of served, fluid and windowed bars.
    highest = max(
        max(t.served_service_tokens, t.fluid_reference_service_tokens, t.fair_share_service_tokens)
        for t in report.tenants.values()
    )
    assert summary.fairness_ylims[0][1] >= highest


def test_simulate_plot_names_every_tenant(tmp_path: Path) -> None:
    picture = tmp_path / "out.png"
    done = run("simulate", "--scenario", "noisy-neighbor", "--plot", picture)
    assert done.returncode == 0, done.stderr
    text = png_text(picture)
    assert text["Title"] == "tokenfair simulate --scenario noisy-neighbor: 60 requests"
    assert text["Description"] == "tenants: tenant_batch_rag, tenant_chat_pro, tenant_ide_assist"


def test_plot_to_an_unwritable_path_names_the_flag(tmp_path: Path) -> None:
    done = run("simulate", "--scenario", "noisy-neighbor", "--plot", tmp_path / "no" / "x.png")
    assert done.returncode == 2
    assert done.stderr.startswith("tokenfair simulate: error: --plot ")


# --- --tenants: the sidecar's own config file -----------------------------------------------


def test_simulate_accepts_the_sidecars_config_file(trace: Path, tenants: Path) -> None:
    args = ("simulate", "--trace", trace, "--policy", "tokenfair", "--format", "json")
    mine = run(*args, "--tenants", EXAMPLE)
    assert mine.returncode == 0, mine.stderr
    assert mine.stderr == ""
    report = json.loads(mine.stdout)
    assert set(report["comparison"]["tokenfair"]["tenants"]) == {
        "tenant_chat_pro",
        "tenant_ide_assist",
        "tenant_batch_rag",
    }
    # The same tenants and policy without the sidecar: section give the same replay.
    assert json.loads(run(*args, "--tenants", tenants).stdout) == report
    scenario = run("simulate", "--scenario", "noisy-neighbor", "--tenants", EXAMPLE)
    assert scenario.returncode == 0, scenario.stderr


def test_trace_generate_accepts_the_sidecars_config_file() -> None:
    done = run("trace", "generate", "--tenants", EXAMPLE, "--requests", "20", "--seed", "1")
    assert done.returncode == 0, done.stderr
    tenants = {json.loads(line)["tenant_id"] for line in done.stdout.splitlines()}
    assert tenants <= {"tenant_chat_pro", "tenant_ide_assist", "tenant_batch_rag"}


SIDECAR_SECTION = (
    "sidecar:\n  listen: 127.0.0.1:8080\n  adminListen: 127.0.0.1:9090\n  backend: costmodel\n"
    "  timeScale: 1.0\n  defaultDecodeTokens: 256\n  maxDecodeTokens: 8192\n"
)


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (SIDECAR_SECTION, "sidecar: [8080]\n", "sidecar: must be a mapping (got list)"),
        ("  decodeWeight: 4\n", "  decodeWeigth: 4\n", "unknown field(s) decodeWeigth"),
    ],
)
def test_the_config_file_is_still_checked(
    old: str, new: str, expected: str, tmp_path: Path, trace: Path
) -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "broken.yaml"
    path.write_text(text.replace(old, new), encoding="utf-8")
    done = run("simulate", "--trace", trace, "--tenants", path)
    assert done.returncode == 2
    assert done.stderr.startswith("tokenfair simulate: error: ")
    assert expected in done.stderr


# --- the end of a command ------------------------------------------------------------------


def test_simulate_output_is_whole_without_the_teardown(
    trace: Path, tenants: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenfair.cli import main

    args = ["simulate", "--trace", str(trace), "--tenants", str(tenants), "--format", "table"]
    out = tmp_path / "report.txt"
    with out.open("w") as handle:
        done = subprocess.run([TOKENFAIR, *args], stdout=handle, check=False, timeout=120)
    assert done.returncode == 0
    assert main([*args, "--no-progress"]) == 0
    assert out.read_text() == capsys.readouterr().out


def test_a_reader_that_stops_early_and_a_full_disk(trace: Path, tenants: Path) -> None:
    args = [TOKENFAIR, "simulate", "--trace", str(trace), "--tenants", str(tenants)]
    with subprocess.Popen([*args, "--format", "table"], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE) as process:  # fmt: skip
        assert process.stdout is not None
        assert process.stderr is not None
        # Closed before the report is written (the replay takes longer than this): every write
        # of it meets a closed pipe, as after `| head` has read its lines.
        process.stdout.close()
        assert process.wait(timeout=120) == 0
        assert process.stderr.read() == b""
    for fmt in ("table", "json"):
        with open("/dev/full", "w") as full:
            done = subprocess.run([*args, "--format", fmt], stdout=full, stderr=subprocess.PIPE,
                                  text=True, check=False, timeout=120)  # fmt: skip
        assert done.returncode == 1
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith("tokenfair simulate: error: ")
        assert "No space left on device" in done.stderr
