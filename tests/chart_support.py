"""The Helm chart as the tests render and run it: ``helm`` of a given major version, the
documented variants' ``--set`` arguments, the rendered documents parsed and picked by kind or
container, a server-side dry run against the test cluster, and a rendered container's command
run locally as a child process."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml
from kubecluster import (
    HOW_TO_GET,
    KubeCluster,
    find_binary,
    skip_or_fail,
    stop_process,
)
from repo_paths import REPO_ROOT

REPO = REPO_ROOT
CHART = REPO / "charts" / "tokenfair"


# The documented variants (docs/deploy.md): name -> `--set` arguments.
VARIANTS: dict[str, tuple[str, ...]] = {
    "default": (),
    "demo": ("demo.enabled=true",),
    "webhook-cert-manager": ("webhook.enabled=true", "certManager.enabled=true"),
    "webhook-own-certificate": ("webhook.enabled=true",),
    "watch-namespaces": ("operator.watchNamespaces={team-a,team-b}",),
    "production": (
        "webhook.enabled=true",
        "networkPolicy.enabled=true",
        "serviceMonitor.enabled=true",
        "prometheusRule.enabled=true",
        "image.digest=sha256:" + "0123456789abcdef" * 4,
        "operator.logFormat=json",
    ),
    "autoscaling-keda": (
        "autoscaling.mode=keda",
        "autoscaling.targetDeployment=model-server",
        "podMonitor.enabled=true",
    ),
    "autoscaling-hpa": ("autoscaling.mode=hpa", "autoscaling.targetDeployment=model-server"),
}


Doc = dict[str, Any]


def helm_binary(major: int) -> Path:
    """``helm3``/``helm4`` from ``make tools``; skip (fail under TOKENFAIR_REQUIRE_KUBE=1)."""
    found = find_binary(f"helm{major}")
    if found is None:
        skip_or_fail(f"no helm{major}: {HOW_TO_GET}")
        raise AssertionError("unreachable")
    return found


def run_helm(major: int, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Helm ``major`` offline, its caches in a throwaway folder (never the developer's home)."""
    home = Path(os.environ.get("TMPDIR", "/tmp")) / f"tokenfair-helm{major}-{os.getpid()}"
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
    }
    result = subprocess.run(
        [str(helm_binary(major)), *args], capture_output=True, text=True, env=env, check=False
    )
    if check and result.returncode != 0:
        raise AssertionError(f"helm{major} {' '.join(args)}:\n{result.stderr}")
    return result


def set_args(sets: tuple[str, ...]) -> list[str]:
    return [arg for value in sets for arg in ("--set", value)]


def render(
    major: int,
    sets: tuple[str, ...] = (),
    *,
    release: str = "tokenfair",
    namespace: str = "tokenfair-system",
    extra: tuple[str, ...] = (),
) -> str:
    """``helm template`` of the chart (its text)."""
    args = ["template", release, str(CHART), "--namespace", namespace, *set_args(sets), *extra]
    return run_helm(major, *args).stdout


def parse(text: str) -> list[Doc]:
    """Every non-empty YAML document, each checked to be an object with apiVersion, kind and
    metadata.name."""
    docs = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    for doc in docs:
        assert isinstance(doc, dict), doc
        assert doc.get("apiVersion"), doc
        assert doc.get("kind"), doc
        assert doc.get("metadata", {}).get("name"), doc
    return docs


def of_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def dry_run(cluster: KubeCluster, namespace: str, docs: list[Doc]) -> str:
    """``kubectl apply --server-side --dry-run=server`` of ``docs``: the API server validates
    every object (schemas, CEL, admission) and stores nothing."""
    text = "\n---\n".join(json.dumps(doc) for doc in docs)
    args = ("apply", "--server-side", "--force-conflicts", "--dry-run=server", "-n", namespace)
    result = cluster.kubectl(*args, "-f", "-", input=text, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def container(docs: list[Doc], kind: str, name_suffix: str) -> Doc:
    """The first container of the one ``kind`` object whose name ends with ``name_suffix``."""
    (obj,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    spec = obj["spec"]["template"]["spec"] if kind == "Deployment" else obj["spec"]
    first: Doc = spec["containers"][0]
    return first


def local_command(spec: Doc, remap: Mapping[str, str]) -> list[str]:
    """A container's command and args as a local command line: the image's programs from this
    virtualenv, and every ``old`` substring of an argument replaced by ``remap[old]``."""
    programs = {"kopf": [sys.executable, "-m", "kopf"], "python": [sys.executable]}
    programs["tokenfair"] = [str(Path(sys.executable).with_name("tokenfair"))]
    command = [*spec["command"], *spec.get("args", [])]
    local = [*programs[command[0]]]
    for arg in command[1:]:
        for old, new in remap.items():
            arg = arg.replace(old, new)
        local.append(arg)
    return local


@contextlib.contextmanager
def process(cmd: list[str], log: Path, env: Mapping[str, str]) -> Iterator[Path]:
    """``cmd`` as a child process in its own group, output to ``log``; stopped on exit."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True
        )
    try:
        yield log
    finally:
        stop_process(proc)
        print(f"--- {log.name} (tail) ---\n{log.read_text(errors='replace')[-4000:]}")


# A log record starts with a timestamp (Kopf's and the operator's text format: ``[2026-12-06
# 04:52:04,123]`` or ``2026-12-06T04:52:04``) or is one JSON object; any other line (a traceback,
# a response body) continues the record before it.
_RECORD_START = re.compile(r"\[?\d{4}-\d\d-\d\d[ T]|\{")


def log_records(log_text: str) -> list[str]:
    """``log_text`` split into records: each record's lines joined, continuation lines (those
    not starting a record, see ``_RECORD_START``) kept with the record they continue."""
    records: list[str] = []
    for line in log_text.splitlines():
        if records and not _RECORD_START.match(line):
            records[-1] += "\n" + line
        else:
            records.append(line)
    return records


def assert_never_refused(log_text: str) -> None:
    """The chart's RBAC was enough: the API server refused the operator nothing. A write into a
    namespace being deleted is refused with 403 too (``NamespaceTerminating``: the namespace of
    an earlier test, which an operator watching every namespace still sees go); that is no
    permission missing, so such a record is left out — the whole record, traceback included,
    and only if it names no permission (an RBAC refusal says ``User "…" cannot …``)."""
    kept = "\n".join(
        record
        for record in log_records(log_text)
        if " cannot " in record
        or ("NamespaceTerminating" not in record and "is being terminated" not in record)
    )
    assert "Forbidden" not in kept, kept[-4000:]
    assert " 403" not in kept, kept[-4000:]
