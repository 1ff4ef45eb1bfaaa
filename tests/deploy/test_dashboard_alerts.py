"""The Grafana dashboard and the alert rules against a real running sidecar and real promtool.

* ``tokenfair sidecar`` runs as a process (cost-model engine, JSON access log on stdout); a few
  requests go through it (served, refused by a gate, unauthenticated) and ``/metrics`` is
  scraped over loopback.
* ``promtool check metrics`` accepts that scrape (exposition format and naming lint);
  ``promtool check rules`` accepts ``files/alerts.yaml``; every dashboard query, as a
  recording rule with the dashboard's variables filled in, passes ``promtool check rules`` too
  (valid PromQL).
* Every metric a dashboard query or an alert names exists in the running sidecar's exposition
  or in the operator's (its metrics module's real exposition).
* The access log: one JSON line per request on the process's stdout.

Without promtool the promtool tests skip, unless ``TOKENFAIR_REQUIRE_PROMTOOL=1`` (CI): then
they fail (``tests/conftest.py``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from loopback_support import free_ports
from repo_paths import REPO_ROOT
from sidecar_support import CHAT, keyed_config

from tokenfair.config import PolicyConfig, config_to_document
from tokenfair_operator.metrics import OperatorMetrics

REPO = REPO_ROOT
FILES = REPO / "charts" / "tokenfair" / "files"
ALERTS = FILES / "alerts.yaml"
DASHBOARD = FILES / "dashboard.json"
TOKENFAIR = Path(sys.executable).with_name("tokenfair")
METRIC_RE = re.compile(r"\b(?:tokenfair|process)_[a-z0-9_]+\b")
SERIES_SUFFIXES = ("_total", "_bucket", "_sum", "_count", "_created")
READY_BUDGET_S = 30.0
DASHBOARD_VARIABLES = {
    "$__rate_interval": "1m",
    "$namespace": ".*",
    "$pod": ".*",
    "$tenant": ".*",
}


@dataclass
class RunningSidecar:
    process: subprocess.Popen[bytes]
    proxy: str
    admin: str
    statuses: list[int]
    scrape: str


def http(method: str, url: str, body: dict[str, Any] | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:  # fmt: skip
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Content-Type": "application/json", **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningSidecar]:
    """A ``tokenfair sidecar`` process after four requests: two served, one refused by the
    tenant's budget (429), one unauthenticated (401); stopped (SIGTERM) at the end."""
    tmp = tmp_path_factory.mktemp("sidecar")
    # Burst 5000, refill 1000 tokens/s: of two 4000-token requests the second is refused
    # (the bucket holds 1000 + e after the first, and interactive requests wait 420 ms at most).
    config = keyed_config(
        PolicyConfig(), burst_service_tokens=5000, sustained_service_tokens_per_second=1000.0
    )
    path = tmp / "sidecar.yaml"
    path.write_text(yaml.safe_dump(config_to_document(config)), encoding="utf-8")
    proxy_port, admin_port = free_ports(2)
    process = subprocess.Popen(
        [str(TOKENFAIR), "sidecar", "--config", str(path),
         "--listen", f"127.0.0.1:{proxy_port}", "--admin-listen", f"127.0.0.1:{admin_port}",
         "--backend", "costmodel", "--access-log", "json", "--log-level", "WARNING",
         "--drain-grace", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    proxy, admin = f"http://127.0.0.1:{proxy_port}", f"http://127.0.0.1:{admin_port}"
    try:
        deadline = time.monotonic() + READY_BUDGET_S
        while True:
            assert process.poll() is None, "the sidecar exited before it was ready"
            try:
                if http("GET", f"{admin}/readyz")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the sidecar did not become ready"
            time.sleep(0.05)
        body = {"model": "m", "prompt": "x" * 4000, "max_tokens": 750}
        auth = {"Authorization": CHAT}
        statuses = [
            http("POST", f"{proxy}/v1/completions", body, auth)[0],
            http("POST", f"{proxy}/v1/completions", body, auth)[0],
            http("POST", f"{proxy}/v1/completions", body)[0],
            http("POST", f"{proxy}/v1/chat/completions", {
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True}, auth)[0],
        ]  # fmt: skip
        status, scrape = http("GET", f"{admin}/metrics")
        assert status == 200
        yield RunningSidecar(process, proxy, admin, statuses, scrape.decode())
    finally:
        if process.returncode is None:
            stop(process)


def stop(process: subprocess.Popen[bytes]) -> str:
    """SIGTERM, then its stdout (the sidecar drains, writes its last lines and exits)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        out, _ = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    return out.decode()


def exposition_names(text: str) -> set[str]:
    """Every family (``# TYPE``) and sample name of a text exposition."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def known_metrics(sidecar: RunningSidecar) -> set[str]:
    return exposition_names(sidecar.scrape) | exposition_names(
        OperatorMetrics().exposition().decode()
    )


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every panel target and query variable."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        (panel["title"], target["expr"])
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append((f"${variable['name']}", variable["query"]["query"]))
    return queries


def filled(expression: str) -> str:
    for variable, value in DASHBOARD_VARIABLES.items():
        expression = expression.replace(variable, value)
    return expression


def test_requests_went_through(sidecar: RunningSidecar) -> None:
    assert sidecar.statuses == [200, 429, 401, 200]


def test_every_metric_of_the_dashboard_and_alerts_exists(sidecar: RunningSidecar) -> None:
    known = known_metrics(sidecar)
    alerts = yaml.safe_load(ALERTS.read_text())
    expressions = [
        (rule["alert"], rule["expr"]) for group in alerts["groups"] for rule in group["rules"]
    ]
    expressions += dashboard_queries()
    named: set[str] = set()
    for where, expression in expressions:
        names = METRIC_RE.findall(expression)
        assert names, where
        for name in names:
            family = next((name.removesuffix(s) for s in SERIES_SUFFIXES if name.endswith(s)), name)
            assert name in known or family in known, f"{where}: {name} is exported by nobody"
            named.add(family)
    # The new families are on the dashboard.
    for family in (
        "tokenfair_e2e_request_latency_seconds", "tokenfair_time_to_first_token_seconds",
        "tokenfair_prompt_tokens", "tokenfair_completion_tokens", "tokenfair_in_flight_requests",
        "process_resident_memory_bytes",
    ):  # fmt: skip
        assert family in named, family


def test_the_new_families_are_in_the_scrape(sidecar: RunningSidecar) -> None:
    known = exposition_names(sidecar.scrape)
    for name in (
        "tokenfair_e2e_request_latency_seconds_bucket",
        "tokenfair_time_to_first_token_seconds_count",
        "tokenfair_prompt_tokens_total",
        "tokenfair_completion_tokens_total",
        "tokenfair_in_flight_requests",
    ):
        assert name in known, name
    if sys.platform == "linux":
        for name in (
            "process_cpu_seconds_total", "process_resident_memory_bytes",
            "process_virtual_memory_bytes", "process_open_fds", "process_max_fds",
            "process_start_time_seconds",
        ):  # fmt: skip
            assert name in known, name


def test_promtool_check_metrics_accepts_the_scrape(sidecar: RunningSidecar, promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "metrics"], input=sidecar.scrape, capture_output=True, text=True,
        check=False, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_check_rules_accepts_the_alerts(promtool: str) -> None:
    result = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_parses_every_dashboard_query(promtool: str, tmp_path: Path) -> None:
    rules = [
        {"record": f"tokenfair:dashboard:{index}", "expr": filled(expression)}
        for index, (_, expression) in enumerate(dashboard_queries())
        if not expression.startswith("label_values(")  # Grafana's function, not PromQL
    ]
    rules += [
        {"record": f"tokenfair:variable:{index}", "expr": filled(match.group(1))}
        for index, (_, expression) in enumerate(dashboard_queries())
        if (match := re.fullmatch(r"label_values\((.*), [a-z_]+\)", expression))
    ]
    path = tmp_path / "dashboard-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_one_json_access_line_per_request_on_stdout(sidecar: RunningSidecar) -> None:
    # The last test of the module (they run in file order): it stops the sidecar to read all.
    stdout = stop(sidecar.process)
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    # The readiness polls and the scrape go to the admin listener: not access-logged.
    assert [line["status"] for line in lines] == [200, 429, 401, 200]
    assert [line["reason"] for line in lines] == [
        "admitted", "shed_tenant_token_quota", "invalid_api_key", "admitted",
    ]  # fmt: skip
    assert lines[3]["route"] == "/v1/chat/completions"
    assert lines[3]["completion_tokens"] == 2
    assert sidecar.process.returncode == 0
