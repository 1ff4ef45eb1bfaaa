"""The ``tokenfair`` command imports only what the subcommand being run needs.

Behaviours under test:

* a real ``tokenfair simulate --trace`` run (a subprocess, ``cli.main`` on a tiny trace, stderr
  a pipe) loads the simulate command and the simulator, and none of aiohttp, asyncio, ssl,
  matplotlib, prometheus_client, tqdm (no bar off a terminal), the server, loadgen, or another
  subcommand's module — also when ``--tenants`` is the sidecar's own config file (its
  ``sidecar:`` section is skipped without the server's settings module);
* ``tokenfair --version`` imports no subcommand;
* ``tokenfair --help`` lists every subcommand with its summary without importing any of them;
* each summary in ``commands.COMMANDS`` is the ``help`` its module registers (no drift between
  the lazy table and the modules).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from repo_paths import REPO_ROOT

from tokenfair.cli import build_parser
from tokenfair.commands import COMMANDS

TENANTS_YAML = """\
apiVersion: tokenfair.io/v1alpha1
kind: TenantQuota
metadata:
  name: chat
spec:
  tenantId: tenant_chat
  weight: 1
  burstServiceTokens: 100000
  sustainedServiceTokensPerSecond: 100000
  priorityClass: interactive
"""
TRACE = "".join(
    json.dumps(
        {
            "request_id": f"r{i}",
            "tenant_id": "tenant_chat",
            "arrival_ms": 10 * i,
            "prefill_tokens": 100,
            "decode_tokens": 10,
            "priority_class": "interactive",
        }
    )
    + "\n"
    for i in range(5)
)
# Runs the command in-process, then prints the modules it loaded (stdout carries the report).
PROBE = """\
import json, sys
from tokenfair.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # --help
    code = exc.code
print(json.dumps({"code": code, "modules": sorted(sys.modules)}), file=sys.stderr)
"""
FORBIDDEN_ROOTS = {
    "aiohttp",
    "asyncio",
    "ssl",
    "matplotlib",
    "prometheus_client",
    "httptools",
    "multidict",
    "yarl",
    "kopf",
    "kubernetes",
    "tqdm",
}
FORBIDDEN_OURS = {
    "tokenfair.server",
    "tokenfair.loadgen",
    "tokenfair.sim.plot",
    "tokenfair.sim.calibrate",
    "tokenfair.sim.tracegen",
    *(f"tokenfair.commands.{name}" for name in COMMANDS if name != "simulate"),
}


def loaded_modules(*argv: str, cwd: Path) -> tuple[set[str], str]:
    """The modules ``tokenfair ARGV`` loaded, run in a fresh interpreter; and its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    probe = json.loads(done.stderr.splitlines()[-1])
    assert probe["code"] == 0, done.stderr
    return set(probe["modules"]), done.stdout


def test_simulate_loads_no_server_loadgen_or_plotting(tmp_path: Path) -> None:
    (tmp_path / "tenants.yaml").write_text(TENANTS_YAML, encoding="utf-8")
    (tmp_path / "trace.jsonl").write_text(TRACE, encoding="utf-8")
    modules, report = loaded_modules(
        *("simulate", "--trace", "trace.jsonl", "--tenants", "tenants.yaml"),
        *("--policy", "tokenfair", "--format", "json"),
        cwd=tmp_path,
    )
    # It did run the replay (so the absences below are not those of a run that stopped early).
    assert json.loads(report)["comparison"]["tokenfair"]["admitted_requests"] == 5
    assert {"tokenfair.commands.simulate", "tokenfair.sim.simulator"} <= modules
    assert sorted(m for m in modules if m.split(".")[0] in FORBIDDEN_ROOTS) == []
    ours = sorted(
        m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN_OURS)
    )
    assert ours == []


def test_simulate_with_the_sidecars_config_loads_no_server(tmp_path: Path) -> None:
    example = REPO_ROOT / "examples" / "sidecar-standalone.yaml"
    modules, report = loaded_modules(
        *("simulate", "--scenario", "noisy-neighbor", "--tenants", str(example)),
        *("--policy", "tokenfair", "--format", "json"),
        cwd=tmp_path,
    )
    assert json.loads(report)["comparison"]["tokenfair"]["total_requests"] == 60
    assert sorted(m for m in modules if m.split(".")[0] in FORBIDDEN_ROOTS) == []
    assert sorted(m for m in modules if m.startswith("tokenfair.server")) == []


def test_version_imports_no_subcommand(tmp_path: Path) -> None:
    modules, text = loaded_modules("--version", cwd=tmp_path)
    assert text.startswith("tokenfair ")
    assert sorted(m for m in modules if m.startswith("tokenfair.commands.")) == []


def test_top_level_help_imports_no_subcommand(tmp_path: Path) -> None:
    modules, help_text = loaded_modules("--help", cwd=tmp_path)
    assert sorted(m for m in modules if m.startswith("tokenfair.commands.")) == []
    assert "tokenfair.sim.simulator" not in modules
    for name, entry in COMMANDS.items():
        assert name in help_text
        assert entry.summary.split()[0] in help_text


def test_summaries_are_the_modules_own_help() -> None:
    parser = build_parser()  # every module imported and registered
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    registered = {action.dest: action.help for action in subparsers._choices_actions}
    assert registered == {name: entry.summary for name, entry in COMMANDS.items()}
