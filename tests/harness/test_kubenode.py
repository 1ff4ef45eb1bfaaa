"""The node plugin's rules that need no node: the skip/fail switch, the kubelet settings the
quota test relies on, and the cluster DNS's answers (real UDP over loopback)."""

from __future__ import annotations

import importlib.util
import os
import socket
import struct
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import kubenode
import pytest
from repo_paths import REPO_ROOT, TESTS_DIR

REPO = REPO_ROOT


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
    monkeypatch.setenv("PYTHONPATH", str(TESTS_DIR))
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


IPTABLES_BEFORE = """\
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A INPUT -i lo -j ACCEPT
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
COMMIT
"""

# After the node started: kube-proxy's and the CNI plugin's chains and rules, and, added
# meanwhile by other programs, Docker's and tailscale's (some naming other private ranges).
IPTABLES_AFTER = """\
*filter
:INPUT ACCEPT [0:0]
:FORWARD ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:DOCKER - [0:0]
:DOCKER-USER - [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-SERVICES - [0:0]
:ts-input - [0:0]
-A INPUT -i lo -j ACCEPT
-A INPUT -j ts-input
-A INPUT -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A FORWARD -j DOCKER-USER
-A FORWARD -o docker0 -j DOCKER
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A FORWARD -i tfnode0 -j ACCEPT
-A DOCKER -d 172.17.0.2/32 ! -i docker0 -o docker0 -p tcp -m tcp --dport 80 -j ACCEPT
-A KUBE-FORWARD -m conntrack --ctstate INVALID -j DROP
-A ts-input -s 100.64.0.0/10 ! -i tailscale0 -j DROP
COMMIT
*nat
:PREROUTING ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:CNI-0123456789abcdef01234567 - [0:0]
:CNI-HOSTPORT-MASQ - [0:0]
:DOCKER - [0:0]
:KUBE-POSTROUTING - [0:0]
:KUBE-SVC-ABCDEF - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER
-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE
-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING
-A POSTROUTING -s 10.213.0.5/32 -m comment --comment "name: \\"tfnode\\" id: \\"abc\\"" \
-j CNI-0123456789abcdef01234567
-A POSTROUTING -s 10.213.0.0/24 ! -o tfnode0 -j MASQUERADE
-A POSTROUTING -d 10.213.128.10/32 -j MASQUERADE
-A POSTROUTING -m comment --comment "CNI portfwd requiring masquerade" -j CNI-HOSTPORT-MASQ
-A CNI-0123456789abcdef01234567 -d 10.213.0.0/24 -j ACCEPT
-A KUBE-SVC-ABCDEF -j RETURN
-A DOCKER -i docker0 -j RETURN
COMMIT
""".replace("\\\n", "")


def test_sweep_deletes_only_the_nodes_iptables_rules_and_chains() -> None:
    """The sweep's firewall plan: of everything added after the node started, only KUBE-/CNI-
    chains, rules jumping to them and rules naming tfnode0 or the node's ranges go; Docker's
    and tailscale's chains and rules, however new, are kept."""
    before = {"ipv4": kubenode.parse_iptables_save(IPTABLES_BEFORE), "ipv6": {}}
    after = {"ipv4": kubenode.parse_iptables_save(IPTABLES_AFTER), "ipv6": {}}
    commands = kubenode.iptables_deletions(before, after)
    planned = [(table, " ".join(args)) for family, table, args in commands]
    assert {family for family, _, _ in commands} == {"ipv4"}

    for _, line in planned:
        for other in ("DOCKER", "docker0", "ts-input", "tailscale0", "172.17.", "100.64."):
            assert other not in line, line
    deleted_chains = sorted((t, line[3:]) for t, line in planned if line.startswith("-X "))
    assert deleted_chains == [
        ("filter", "KUBE-FORWARD"),
        ("filter", "KUBE-SERVICES"),
        ("nat", "CNI-0123456789abcdef01234567"),
        ("nat", "CNI-HOSTPORT-MASQ"),
        ("nat", "KUBE-POSTROUTING"),
        ("nat", "KUBE-SVC-ABCDEF"),
    ]
    assert sorted(line[3:] for t, line in planned if line.startswith("-F ")) == sorted(
        c for _, c in deleted_chains
    )
    deleted_rules = [(t, line) for t, line in planned if line.startswith("-D ")]
    assert deleted_rules == [
        ("filter", "-D INPUT -m comment --comment kubernetes service portals -j KUBE-SERVICES"),
        ("filter", "-D FORWARD -m comment --comment kubernetes forwarding rules -j KUBE-FORWARD"),
        ("filter", "-D FORWARD -i tfnode0 -j ACCEPT"),
        (
            "nat",
            "-D POSTROUTING -m comment --comment kubernetes postrouting rules -j KUBE-POSTROUTING",
        ),
        (
            "nat",
            '-D POSTROUTING -s 10.213.0.5/32 -m comment --comment name: "tfnode" id: "abc" '
            "-j CNI-0123456789abcdef01234567",
        ),
        ("nat", "-D POSTROUTING -s 10.213.0.0/24 ! -o tfnode0 -j MASQUERADE"),
        ("nat", "-D POSTROUTING -d 10.213.128.10/32 -j MASQUERADE"),
        (
            "nat",
            "-D POSTROUTING -m comment --comment CNI portfwd requiring masquerade "
            "-j CNI-HOSTPORT-MASQ",
        ),
    ]
    # Rules are removed before the chains they jump to; a second sweep has nothing to do.
    for table in ("filter", "nat"):
        verbs = [line[:2] for t, line in planned if t == table]
        assert verbs == sorted(verbs, key=["-D", "-F", "-X"].index), verbs
    assert kubenode.iptables_deletions(after, after) == []


def test_sweep_restores_only_settings_the_node_changed_and_never_a_stale_record(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Kernel settings: the live session puts back what the node changed and nobody changed
    since; a killed session's folder (a record maybe days old) restores nothing."""
    now = {"net/ipv4/ip_forward": "1", "vm/overcommit_memory": "1", "kernel/panic": "10"}
    monkeypatch.setattr(kubenode, "read_sysctls", lambda: dict(now))
    state = {
        "sysctls": {"net/ipv4/ip_forward": "0", "vm/overcommit_memory": "0", "kernel/panic": "0"},
        # kernel/panic: changed by someone else after the node was up.
        "sysctls_after": {
            "net/ipv4/ip_forward": "1",
            "vm/overcommit_memory": "1",
            "kernel/panic": "0",
        },
    }
    assert kubenode.sysctls_to_restore(state) == {
        "net/ipv4/ip_forward": "0",
        "vm/overcommit_memory": "0",
    }

    swept: list[tuple[Path, bool]] = []
    monkeypatch.setattr(
        kubenode, "sweep", lambda w, restore_sysctls=True: swept.append((w, restore_sysctls))
    )
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    stale = tmp_path / f"{kubenode.WORKDIR_PREFIX}old"
    stale.mkdir()
    (stale / kubenode.OWNER_FILE).write_text("999999999")  # no such process
    kubenode.sweep_stale_nodes()
    assert swept == [(stale, False)]
    assert not stale.exists()


def test_pod_network_namespaces_live_in_the_nodes_folder() -> None:
    """containerd mounts Pods' netns under its state folder (inside the node's), so the sweep
    unmounts them with the folder and never touches /run/netns, where others keep theirs."""
    reqs = kubenode.NodeRequirements(
        kubelet=Path("k"),
        kube_scheduler=Path("s"),
        kube_proxy=Path("p"),
        kube_controller_manager=Path("c"),
        cni_bin_dir=Path("cni"),
        images={"pause_ref": "pause:1"},
    )
    assert "netns_mounts_under_state_dir = true" in kubenode.containerd_config(Path("/w"), reqs)
