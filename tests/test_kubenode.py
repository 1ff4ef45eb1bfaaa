"""The node plugin's rules that need no node: the skip/fail switch, the kubelet settings the
quota test relies on, and the cluster DNS's answers (real UDP over loopback)."""

from __future__ import annotations

import importlib.util
import os
import socket
import struct
import sys
import threading
from pathlib import Path
from types import ModuleType

import kubenode
import pytest

REPO = Path(__file__).resolve().parents[1]


def load_clusterdns() -> ModuleType:
    """hack/node/clusterdns.py as a module (it is a script, not a package)."""
    path = REPO / "hack" / "node" / "clusterdns.py"
    spec = importlib.util.spec_from_file_location("clusterdns", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["clusterdns"] = module
    spec.loader.exec_module(module)
    return module


def test_node_tests_skip_with_a_hint_and_fail_under_the_ci_switch(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without the node programs a ``node`` test is skipped naming what to run, or fails with
    ``TOKENFAIR_REQUIRE_NODE=1`` (what .ci/run sets): CI cannot pass by skipping the node."""
    monkeypatch.setenv("KUBEBUILDER_ASSETS", str(tmp_path / "assets"))
    monkeypatch.setenv("TOKENFAIR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))
    monkeypatch.delenv("TOKENFAIR_REQUIRE_NODE", raising=False)
    monkeypatch.delenv("TOKENFAIR_REQUIRE_KUBE", raising=False)
    pytester.makepyfile(
        test_needs_node="""
        import pytest

        @pytest.mark.node
        def test_marked():
            pass

        def test_uses_fixture(kube_node):
            pass

        def test_plain():
            pass
        """
    )
    args = ["-p", "kubecluster", "-p", "kubenode", "-p", "no:cacheprovider", "-rs"]
    args += ["-o", "asyncio_default_fixture_loop_scope=function"]

    skipped = pytester.runpytest_subprocess(*args)
    skipped.assert_outcomes(passed=1, skipped=2)
    # Not root: the root hint; root without the build: the make hint. Either names the fix.
    skipped.stdout.fnmatch_lines(["*SKIPPED*make*"])

    monkeypatch.setenv("TOKENFAIR_REQUIRE_NODE", "1")
    failed = pytester.runpytest_subprocess(*args)
    failed.assert_outcomes(passed=1, errors=2)
    failed.stdout.fnmatch_lines(["*TOKENFAIR_REQUIRE_NODE=1 but*"])


def test_kubelet_keeps_upstream_secret_and_configmap_sync() -> None:
    """The quota test measures propagation as users see it: nothing shortens the kubelet's
    sync period or changes how it detects Secret/ConfigMap changes."""
    config = kubenode.kubelet_config(Path("/w"), "192.0.2.2", 10250, 10248, "tokenfair-node-1")
    for key in ("syncFrequency", "configMapAndSecretChangeDetectionStrategy", "fileCheckFrequency"):
        assert key not in config
    # And the node's own choices: cgroupfs under its own root, nothing lowers oom_score_adj.
    assert config["cgroupDriver"] == "cgroupfs"
    assert config["cgroupRoot"] == "/tokenfair-node-1"
    assert config["oomScoreAdj"] == 0
    assert config["clusterDNS"] == [kubenode.BRIDGE_IP]


def dns_query(ident: int, name: str, qtype: int) -> bytes:
    labels = b"".join(bytes([len(p)]) + p.encode() for p in name.split("."))
    return (
        struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0)
        + labels
        + b"\0"
        + struct.pack("!HH", qtype, 1)
    )


def test_cluster_dns_answers_services_over_udp() -> None:
    """A records for known Services (ClusterIP, or a headless Service's endpoints), NOERROR
    without answers for other types, NXDOMAIN for anything else; the query id is echoed."""
    clusterdns = load_clusterdns()
    records = clusterdns.Records.__new__(clusterdns.Records)
    records.domain = "cluster.local"
    records.names = {
        "web.shop.svc.cluster.local": ["10.213.128.7"],
        "db.shop.svc.cluster.local": ["10.213.0.5", "10.213.0.6"],
    }
    records.fetched_at = float("inf")  # never refreshed: no API server in this test
    server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("127.0.0.1", 0))

    def serve(count: int) -> None:
        for _ in range(count):
            packet, peer = server.recvfrom(4096)
            server.sendto(clusterdns.answer(packet, records), peer)

    queries = [
        (7, "web.shop.svc.cluster.local", 1),
        (8, "DB.shop.svc.cluster.local", 1),
        (9, "web.shop.svc.cluster.local", 28),
        (10, "nope.shop.svc.cluster.local", 1),
    ]
    thread = threading.Thread(target=serve, args=(len(queries),), daemon=True)
    thread.start()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.settimeout(5)
    replies = []
    with client, server:
        for ident, name, qtype in queries:
            client.sendto(dns_query(ident, name, qtype), server.getsockname())
            replies.append(client.recv(4096))
        thread.join(5)
    parsed = [struct.unpack("!HHHH", r[:8]) for r in replies]
    # (id, flags, qdcount, ancount): 0x8580 = response, authoritative, RD+RA, NOERROR.
    assert parsed[0] == (7, 0x8580, 1, 1)
    assert socket.inet_ntoa(replies[0][-4:]) == "10.213.128.7"
    assert parsed[1] == (8, 0x8580, 1, 2)  # case-insensitive, both endpoints
    assert {socket.inet_ntoa(replies[1][-20:-16]), socket.inet_ntoa(replies[1][-4:])} == {
        "10.213.0.5",
        "10.213.0.6",
    }
    assert parsed[2] == (9, 0x8580, 1, 0)  # AAAA: the name exists, no IPv6 address
    assert parsed[3][0] == 10
    assert parsed[3][1] & 0x000F == 3
    assert parsed[3][3] == 0


def test_node_requirements_name_the_missing_piece_when_not_root(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    reason = kubenode.find_requirements()
    assert isinstance(reason, str)
    assert "root" in reason
    assert "make node" in reason
