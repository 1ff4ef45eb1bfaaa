"""Pytest plugin: a real Kubernetes node for the tests marked ``node`` (docs/node.md).

``kube_node`` (session scope) starts, as child processes of pytest, a control plane of its own
(the ``kube_cluster`` programs with the flags a kubelet needs, see :func:`node_options`) and one
node joined to it:

- containerd (Debian's), its CRI plugin with ``restrict_oom_score_adj`` (the machine may refuse
  a lower ``oom_score_adj``), cgroupfs, runc state, root and sockets in the node's folder;
- CNI from Debian's containernetworking-plugins: bridge :data:`BRIDGE` with gateway
  :data:`BRIDGE_IP` on :data:`POD_CIDR` (host-local IPAM), portmap, loopback;
- kubelet (cgroupfs driver, pods under the cgroup :data:`CGROUP_PREFIX`-<pid>, logs and volumes
  in the node's folder, image GC and eviction effectively off), kube-scheduler, and kube-proxy
  (iptables mode, ``--masquerade-all`` so Pod -> Service -> Pod on one bridge works without
  br_netfilter), all built from the same k8s.io/kubernetes module as the API server;
- a cluster DNS answering Services' A records (hack/node/clusterdns.py) on :data:`BRIDGE_IP`;
- the images of ``make image`` (tokenfair and the pause sandbox) imported into containerd's
  ``k8s.io`` namespace, so Pods run them with no registry.

Teardown: workloads deleted through the API and waited for (the kubelet tears down sandboxes and
their CNI), then every process stopped by process group, ``kube-proxy --cleanup``, then a sweep
that removes whatever of the node is left: containers, mounts under the folder (the Pods'
network namespaces live there), the bridge, the iptables/ip6tables rules and chains that are the
node's (:func:`iptables_deletions`: ``KUBE-``/``CNI-`` chains, rules jumping to them or naming
the bridge or the node's address ranges; never another program's), the cgroup trees, and the
kernel settings the node changed (restored from this session's own record). A folder left by a
killed session is swept the same way by the next one (:func:`sweep_stale_nodes`), except that
its kernel settings are left alone: its record may be days old.

Needs root, the Debian packages containerd, runc, containernetworking-plugins, iptables and
conntrack, and ``make controlplane tools image``. Without them ``node`` tests are skipped with a
hint, unless ``TOKENFAIR_REQUIRE_NODE=1`` (CI), where they fail.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubecluster import (
    REPO_ROOT,
    Binaries,
    ControlPlaneOptions,
    KubeCluster,
    find_binary,
    log_tail,
    require_binaries,
    running_cluster,
    start_process,
    stop_process,
)
from loopback_support import free_ports

REQUIRE_NODE_ENV = "TOKENFAIR_REQUIRE_NODE"
# Import this image tarball instead of the one `make image` made for the current sources (while
# iterating on the node with sources that others keep changing); never set in CI.
IMAGE_TAR_ENV = "TOKENFAIR_NODE_IMAGE_TAR"
# A folder to copy the node's logs (kubelet, containerd, ...) into at teardown, for debugging.
KEEP_LOGS_ENV = "TOKENFAIR_NODE_LOGS"
NODE_NAME = "tfnode"
BRIDGE = "tfnode0"
POD_CIDR = "10.213.0.0/24"
BRIDGE_IP = "10.213.0.1"
SERVICE_CIDR = "10.213.128.0/24"
CLUSTER_DOMAIN = "cluster.local"
CGROUP_PREFIX = "tokenfair-node-"
WORKDIR_PREFIX = "tfnode-"
STATE_FILE = "node-state.json"
# Chains the node's programs make: kube-proxy's and the CNI bridge/portmap plugins'. The sweep
# touches nothing else in the firewall (Docker, tailscale, firewalld... add rules meanwhile).
NODE_CHAIN_PREFIXES = ("KUBE-", "CNI-", NODE_NAME)
OWNER_FILE = "owner.pid"
HOW_TO_GET = (
    "run as root with the Debian packages `containerd runc containernetworking-plugins "
    "iptables conntrack` installed, then `make node` (docs/node.md)"
)
# Host commands the node runs, and the Debian package of each (for the hint).
HOST_COMMANDS = {
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "runc": "runc",
    "iptables": "iptables",
    "iptables-save": "iptables",
    "ip6tables-save": "iptables",
    "conntrack": "conntrack",
    "ip": "iproute2",
    "mount": "mount",
}
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")
# Debian's containernetworking-plugins, then upstream's release tarball layout.
CNI_BIN_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
# Kernel settings the kubelet or kube-proxy may change; the ones the node changed are restored on
# the session's own teardown (never from a killed session's record: it may be days old).
SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "net/bridge/bridge-nf-call-iptables",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# One node per machine: the bridge, the pod CIDR and the cluster DNS address are fixed. A second
# pytest session (another checkout, a colleague's run) waits for the lock this long.
LOCK_FILE = Path(tempfile.gettempdir()) / "tokenfair-node.lock"
LOCK_TIMEOUT_S = 900.0
NODE_READY_TIMEOUT_S = 180.0
# Host folders the kubelet, containerd's shims and CNI use whatever they are told (upstream
# constants): removed on teardown, empty folders only, when they did not exist before.
HOST_DIRS = (
    "/var/lib/kubelet",
    "/var/lib/cni",
    "/var/log/containers",
    "/run/containerd",
    "/run/netns",
)
DRAIN_TIMEOUT_S = 90.0
FIXTURES_NEEDING_NODE = ("kube_node",)
_startup_seconds: list[float] = []


# --- what the machine has --------------------------------------------------------------------


@dataclass(frozen=True)
class NodeRequirements:
    """Paths of everything the node runs besides the control plane."""

    kubelet: Path
    kube_scheduler: Path
    kube_proxy: Path
    kube_controller_manager: Path
    cni_bin_dir: Path
    images: dict[str, str]


def image_paths() -> dict[str, str]:
    """``hack/node/image.py paths``: the tarballs ``make image`` made for the current sources."""
    out = subprocess.run(
        [sys.executable, str(REPO_ROOT / "hack" / "node" / "image.py"), "paths"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    paths: dict[str, str] = json.loads(out)
    if pinned := os.environ.get(IMAGE_TAR_ENV):
        paths["image_tar"] = pinned
    return paths


def find_requirements() -> NodeRequirements | str:
    """Everything the node needs, or a skip/fail reason naming what is missing."""
    if os.geteuid() != 0:
        return f"the node needs root (containers, mounts, iptables): {HOW_TO_GET}"
    missing = sorted({pkg for cmd, pkg in HOST_COMMANDS.items() if shutil.which(cmd) is None})
    if missing:
        return f"no Debian package(s) {', '.join(missing)} installed: {HOW_TO_GET}"
    cni = next(
        (Path(d) for d in CNI_BIN_DIRS if all((Path(d) / p).is_file() for p in CNI_PLUGINS)),
        None,
    )
    if cni is None:
        return f"no CNI plugins {', '.join(CNI_PLUGINS)} in {', '.join(CNI_BIN_DIRS)}: {HOW_TO_GET}"
    names = ("kubelet", "kube-scheduler", "kube-proxy", "kube-controller-manager")
    found = {n: find_binary(n) for n in names}
    if absent := [n for n, p in found.items() if p is None]:
        return f"no {', '.join(absent)} built: run `make controlplane` (docs/node.md)"
    images = image_paths()
    if absent := [images[k] for k in ("image_tar", "pause_tar") if not Path(images[k]).is_file()]:
        return f"no image {', '.join(absent)} for the current sources: run `make image`"
    return NodeRequirements(
        kubelet=found["kubelet"],  # type: ignore[arg-type]
        kube_scheduler=found["kube-scheduler"],  # type: ignore[arg-type]
        kube_proxy=found["kube-proxy"],  # type: ignore[arg-type]
        kube_controller_manager=found["kube-controller-manager"],  # type: ignore[arg-type]
        cni_bin_dir=cni,
        images=images,
    )


def skip_or_fail_node(reason: str) -> None:
    """Skip with ``reason``; fail instead with ``TOKENFAIR_REQUIRE_NODE=1`` (CI never skips)."""
    if os.environ.get(REQUIRE_NODE_ENV) == "1":
        pytest.fail(f"{REQUIRE_NODE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_node() -> NodeRequirements:
    found = find_requirements()
    if isinstance(found, str):
        skip_or_fail_node(found)
        raise AssertionError("unreachable")
    return found


def primary_ipv4() -> str:
    """The address the host leaves by (the source of its default route), never loopback: the
    apiserver advertises it and the kubelet registers it. A UDP connect sends nothing."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect(("203.0.113.1", 9))  # TEST-NET-3: only the route lookup matters
        address = str(sock.getsockname()[0])
    if address.startswith("127."):
        raise RuntimeError("the node needs a non-loopback IPv4 address with a default route")
    return address


# --- the running node ----------------------------------------------------------------------------


@dataclass
class KubeNode:
    """A control plane with one node that runs Pods (see the module docstring)."""

    cluster: KubeCluster
    name: str
    ip: str
    workdir: Path
    containerd_socket: Path
    images: dict[str, str]
    startup_seconds: float = 0.0
    phases_s: dict[str, float] = field(default_factory=dict)

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``ctr`` against the node's containerd in the ``k8s.io`` namespace (the CRI's)."""
        cmd = ["ctr", "--address", str(self.containerd_socket), "--namespace", "k8s.io", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=300)


def node_options(node_ip: str) -> ControlPlaneOptions:
    """:class:`ControlPlaneOptions` for a control plane a kubelet joins: listening on every
    address (Pods reach it through the ``kubernetes`` Service, which the apiserver keeps
    pointing at ``node_ip``), Pods' ServiceAccount tokens on, every default controller."""
    return ControlPlaneOptions(
        bind_address="0.0.0.0",
        advertise_address=node_ip,
        service_cidr=SERVICE_CIDR,
        service_account_admission=True,
        endpoint_reconciler="lease",
        controllers="*",
        publish_root_ca=True,
        extra_apiserver_flags=("--kubelet-preferred-address-types=InternalIP",),
    )


def containerd_config(workdir: Path, reqs: NodeRequirements) -> str:
    """containerd 1.6 (config version 2): every path in ``workdir``; see docs/node.md."""
    w = workdir
    return f"""version = 2
root = "{w}/containerd/root"
state = "{w}/containerd/state"
oom_score = 0
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{w}/containerd.sock"
[ttrpc]
  address = "{w}/containerd.sock.ttrpc"
[debug]
  address = "{w}/containerd-debug.sock"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{w}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{reqs.images["pause_ref"]}"
  restrict_oom_score_adj = true
  disable_apparmor = true
  enable_selinux = false
  # Pods' network namespaces under the node's folder, not /run/netns: the sweep unmounts them
  # with the folder's mounts and never touches another program's namespaces.
  netns_mounts_under_state_dir = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{w}/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{reqs.cni_bin_dir}"
    conf_dir = "{w}/cni/net.d"
    max_conf_num = 1
"""


def cni_config(workdir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "0.4.0",
        "name": NODE_NAME,
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": BRIDGE_IP}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(workdir / "cni" / "ipam"),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(
    workdir: Path, node_ip: str, port: int, healthz_port: int, cgroup: str
) -> dict[str, Any]:
    """KubeletConfiguration: the settings of docs/node.md. ConfigMap/Secret sync is left at
    upstream's defaults on purpose (quota propagation is measured as a user would see it)."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node_ip,
        "port": port,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        # The API server calls the kubelet (logs, exec) with no client certificate; the node is
        # a throwaway test node, so it answers anyone who reaches its port.
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{cgroup}",
        "failCgroupV1": False,
        "failSwapOn": False,
        "containerRuntimeEndpoint": f"unix://{workdir / 'containerd.sock'}",
        "clusterDNS": [BRIDGE_IP],
        "clusterDomain": CLUSTER_DOMAIN,
        # The machine may refuse a lower oom_score_adj (no CAP_SYS_RESOURCE).
        "oomScoreAdj": 0,
        "podLogsDir": str(workdir / "pod-logs"),
        "volumePluginDir": str(workdir / "volume-plugins"),
        # Never evict or garbage-collect the imported images: there is no registry to pull from.
        "evictionHard": {
            "memory.available": "1Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "maxPods": 40,
        "serializeImagePulls": False,
    }


# --- host state: recorded before, restored after -------------------------------------------------


def iptables_rules() -> dict[str, dict[str, list[str]]]:
    """``{"ipv4"|"ipv6": {table: ["-N chain" | "-A chain spec", ...]}}`` from iptables-save."""
    result: dict[str, dict[str, list[str]]] = {}
    for family, command in (("ipv4", "iptables-save"), ("ipv6", "ip6tables-save")):
        out = subprocess.run([command], capture_output=True, text=True, check=False).stdout
        result[family] = parse_iptables_save(out)
    return result


def parse_iptables_save(out: str) -> dict[str, list[str]]:
    """One family's ``iptables-save`` listing as ``{table: ["-N chain" | "-A chain spec"]}``."""
    tables: dict[str, list[str]] = {}
    table = ""
    for line in out.splitlines():
        if line.startswith("*"):
            table = line[1:]
            tables[table] = []
        elif line.startswith(":"):
            tables[table].append("-N " + line[1:].split()[0])
        elif line.startswith("-A "):
            tables[table].append(line)
    return tables


def is_node_chain(chain: str) -> bool:
    return chain.startswith(NODE_CHAIN_PREFIXES)


_NODE_NETWORKS = (ipaddress.ip_network(POD_CIDR), ipaddress.ip_network(SERVICE_CIDR))


def _names_node_address(token: str) -> bool:
    """``token`` is an address or range inside the Pod or Service range (``10.213.0.5/32``)."""
    try:
        net = ipaddress.ip_network(token, strict=False)
    except ValueError:
        return False
    return any(
        net.version == own.version and net.subnet_of(own)  # type: ignore[arg-type]
        for own in _NODE_NETWORKS
    )


def is_node_rule(rule: str) -> bool:
    """An ``-A chain spec`` line the node made: in one of its chains, jumping (``-j``/``-g``) to
    one, or naming its bridge or its Pod/Service ranges (the CNI plugin's MASQUERADE rules)."""
    args = _split_rule(rule[3:])
    if is_node_chain(args[0]):
        return True
    for flag, value in itertools.pairwise(args):
        if flag in ("-j", "--jump", "-g", "--goto") and is_node_chain(value):
            return True
    return any(token == BRIDGE or _names_node_address(token.split(",")[0]) for token in args[1:])


def iptables_deletions(
    before: dict[str, dict[str, list[str]]], now: dict[str, dict[str, list[str]]]
) -> list[tuple[str, str, list[str]]]:
    """What the sweep deletes, as ``(family, table, iptables arguments)`` in order: the node's
    rules (:func:`is_node_rule`) that are in ``now`` but not in ``before``, then its new chains
    flushed and removed. Rules and chains of other programs are kept, however new."""
    commands: list[tuple[str, str, list[str]]] = []
    for family, tables in now.items():
        for table, lines in tables.items():
            old = set(before.get(family, {}).get(table, []))
            chains = [ln[3:] for ln in lines if ln.startswith("-N ") and ln not in old]
            chains = [c for c in chains if is_node_chain(c)]
            for rule in lines:
                if not rule.startswith("-A ") or rule in old or not is_node_rule(rule):
                    continue
                args = _split_rule(rule[3:])
                if args[0] not in chains:  # rules in chains removed below go with them
                    commands.append((family, table, ["-D", *args]))
            commands += [(family, table, ["-F", chain]) for chain in chains]
            commands += [(family, table, ["-X", chain]) for chain in chains]
    return commands


def record_node_sysctls(workdir: Path) -> None:
    """Add the kernel settings as the running node left them to the record (see
    :func:`sysctls_to_restore`)."""
    state_path = workdir / STATE_FILE
    state = json.loads(state_path.read_text())
    state["sysctls_after"] = read_sysctls()
    state_path.write_text(json.dumps(state))


def _delete_node_iptables(before: dict[str, dict[str, list[str]]]) -> list[str]:
    """Run :func:`iptables_deletions` against the live tables; return a summary of what it did."""
    binaries = {"ipv4": "iptables", "ipv6": "ip6tables"}
    counts: dict[str, dict[str, int]] = {}
    for family, table, args in iptables_deletions(before, iptables_rules()):
        subprocess.run([binaries[family], "-w", "-t", table, *args], capture_output=True)
        count = counts.setdefault(f"{family}/{table}", {"-D": 0, "-F": 0, "-X": 0})
        count[args[0]] += 1
    return [f"{key}: {c['-D']} rules, {c['-X']} chains" for key, c in counts.items()]


def _split_rule(spec: str) -> list[str]:
    """An iptables-save rule body as arguments (its comments are shell-quoted)."""
    return shlex.split(spec)


def read_sysctls() -> dict[str, str]:
    values = {}
    for name in SYSCTLS:
        with contextlib.suppress(OSError):
            values[name] = (Path("/proc/sys") / name).read_text().strip()
    return values


def cgroup_mounts() -> list[Path]:
    """Mount points of the cgroup hierarchies (v1: one per controller; v2: one)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        fstype = fields[fields.index("-") + 1]
        if fstype in ("cgroup", "cgroup2"):
            points.append(Path(fields[4]))
    return points


def make_cgroup(name: str) -> None:
    """Create ``/<name>`` in every cgroup hierarchy (the kubelet requires its root to exist);
    cpuset needs its cpus and mems copied from the parent before anything can join it."""
    for mount in cgroup_mounts():
        path = mount / name
        path.mkdir(exist_ok=True)
        for knob in ("cpuset.cpus", "cpuset.mems"):
            if (mount / knob).exists():
                (path / knob).write_text((mount / knob).read_text())


def remove_cgroup(name: str) -> None:
    """Remove ``/<name>`` and everything below it in every hierarchy, deepest first, killing
    whatever is still in it (only processes the node started can be there)."""
    for mount in cgroup_mounts():
        root = mount / name
        if not root.is_dir():
            continue
        folders = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))
        for folder in [*reversed(folders), root]:
            with contextlib.suppress(OSError):
                for pid in (folder / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), 9)
            for _ in range(50):
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)


def mounts_under(folder: Path) -> list[str]:
    prefix = str(folder) + "/"
    targets = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if target.startswith(prefix) or target == str(folder):
            targets.append(target)
    return targets


def record_host_state(workdir: Path, cgroup: str) -> None:
    """Write what teardown must restore to ``workdir/STATE_FILE`` (also read by the sweep)."""
    state = {
        "cgroup": cgroup,
        "sysctls": read_sysctls(),
        "iptables": iptables_rules(),
        "host_dirs": {folder: Path(folder).exists() for folder in HOST_DIRS},
        "containers_logs": sorted(p.name for p in Path("/var/log/containers").glob("*"))
        if Path("/var/log/containers").is_dir()
        else [],
    }
    (workdir / STATE_FILE).write_text(json.dumps(state))


def sweep(workdir: Path, *, restore_sysctls: bool = True) -> list[str]:
    """Remove everything the node in ``workdir`` left on the host; idempotent. Returns a list of
    what it had to clean (empty after an orderly teardown, except the folder itself).

    ``restore_sysctls``: put back the kernel settings the node changed (its own session's
    teardown only; :func:`sweep_stale_nodes` passes False: an old record is not the truth)."""
    notes: list[str] = []
    state_path = workdir / STATE_FILE
    state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
    sock = workdir / "containerd.sock"
    # Container processes whose shim outlived containerd: their runc state is in workdir/runc.
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            if b"containerd-shim-runc-v2" in cmdline[0] and str(sock).encode() in cmdline:
                os.kill(int(proc.name), 9)
                notes.append(f"killed shim {proc.name}")
    if cgroup := state.get("cgroup"):
        remove_cgroup(cgroup)
    for target in sorted(mounts_under(workdir), key=len, reverse=True):
        subprocess.run(["umount", "-l", target], capture_output=True)
        notes.append(f"unmounted {target}")
    if Path("/sys/class/net", BRIDGE).exists():
        subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True)
    notes += _delete_node_iptables(state.get("iptables", {}))
    subprocess.run(["conntrack", "-D", "-s", POD_CIDR], capture_output=True)
    subprocess.run(["conntrack", "-D", "-d", POD_CIDR], capture_output=True)
    if restore_sysctls:
        for name, value in sysctls_to_restore(state).items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / name).write_text(value)
                notes.append(f"restored {name}={value}")
    logs = Path("/var/log/containers")
    if logs.is_dir():
        for link in logs.iterdir():
            with contextlib.suppress(OSError):
                if link.is_symlink() and str(workdir) in os.readlink(link):
                    link.unlink()
    for folder, was_there in state.get("host_dirs", {}).items():
        if not was_there and Path(folder).is_dir():
            for dirpath, _, filenames in os.walk(folder, topdown=False):
                for name in filenames:  # sockets the kubelet leaves (device-plugins/kubelet.sock)
                    path = Path(dirpath, name)
                    if stat.S_ISSOCK(path.lstat().st_mode):
                        path.unlink()
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)  # empty folders only: never another program's files
            if not Path(folder).exists():
                notes.append(f"removed {folder}")
    return notes


def sysctls_to_restore(state: dict[str, Any]) -> dict[str, str]:
    """``{name: value before}`` for the settings the node changed and nobody changed since: the
    value now is the one recorded once the node was up (``sysctls_after``), and differs from
    the one before. Before that record (start failed), any setting that differs from before."""
    before: dict[str, str] = state.get("sysctls", {})
    after: dict[str, str] | None = state.get("sysctls_after")
    now = read_sysctls()
    return {
        name: value
        for name, value in before.items()
        if name in now
        and now[name] != value
        and (after is None or (name in after and now[name] == after[name]))
    }


def sweep_stale_nodes() -> None:
    """Sweep and remove node folders whose owning pytest is gone (killed without teardown)."""
    for workdir in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            os.kill(int((workdir / OWNER_FILE).read_text()), 0)
        except ProcessLookupError:
            sweep(workdir, restore_sysctls=False)
            shutil.rmtree(workdir, ignore_errors=True)
        except (OSError, ValueError):
            continue


# --- starting ------------------------------------------------------------------------------------


def wait_for(what: str, check: Any, timeout_s: float, logs: tuple[Path, ...] = ()) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            if result := check():
                return result
        time.sleep(0.5)
    tails = "\n".join(log_tail(p.parent, p.stem, 40) for p in logs)
    raise RuntimeError(f"node: {what} not after {timeout_s:.0f} s\n{tails}")


def node_ready(cluster: KubeCluster) -> bool:
    resp = cluster.request("GET", f"/api/v1/nodes/{NODE_NAME}")
    if resp.status != 200:
        return False  # not registered yet
    conditions = resp.body.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def drain(cluster: KubeCluster) -> None:
    """Delete every workload and Pod and wait until the kubelet has torn them down (sandboxes,
    CNI, volumes), so the sweep finds nothing. Helm hooks' Jobs and bare Pods included."""
    kinds = "deployments,replicasets,statefulsets,daemonsets,jobs"
    cluster.kubectl("delete", kinds, "--all", "-A", "--wait=false", check=False)
    cluster.kubectl(
        "delete", "pods", "--all", "-A", "--grace-period=2", "--wait=false", check=False
    )

    def no_pods() -> bool:
        return not cluster.request("GET", "/api/v1/pods").body.get("items", [None])

    with contextlib.suppress(RuntimeError):
        wait_for("all Pods gone", no_pods, DRAIN_TIMEOUT_S)


def start_node(binaries: Binaries, reqs: NodeRequirements, stack: contextlib.ExitStack) -> KubeNode:
    """Start the control plane and the node (see the module docstring); every undo is pushed
    onto ``stack``."""
    started = time.monotonic()
    phases: dict[str, float] = {}
    sweep_stale_nodes()
    node_ip = primary_ipv4()
    # Short: containerd's socket paths must fit in 108 bytes.
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    (workdir / OWNER_FILE).write_text(str(os.getpid()))
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    if keep := os.environ.get(KEEP_LOGS_ENV):
        stack.callback(copy_logs, workdir, Path(keep))
    cgroup = f"{CGROUP_PREFIX}{os.getpid()}"
    record_host_state(workdir, cgroup)
    stack.callback(sweep, workdir)

    cluster = stack.enter_context(running_cluster(binaries, node_options(node_ip)))
    phases["control plane"] = time.monotonic() - started
    if keep := os.environ.get(KEEP_LOGS_ENV):
        stack.callback(copy_logs, cluster.workdir, Path(keep))
    (workdir / "admin.token").write_text(cluster.admin_token)
    (workdir / "admin.token").chmod(0o600)

    for folder in ("cni/net.d", "cni/ipam", "containerd", "runc", "kubelet", "pod-logs"):
        (workdir / folder).mkdir(parents=True, exist_ok=True)
    (workdir / "cni/net.d/10-tfnode.conflist").write_text(json.dumps(cni_config(workdir)))
    (workdir / "containerd/config.toml").write_text(containerd_config(workdir, reqs))
    # The bridge exists before the first Pod so the cluster DNS can listen on its gateway; the
    # bridge plugin adopts it.
    # One left by a node that died with its folder gone: under the lock no live node owns it.
    if Path("/sys/class/net", BRIDGE).exists():
        subprocess.run(["ip", "link", "delete", BRIDGE], check=True, capture_output=True)
    for cmd in (
        ["ip", "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "addr", "add", f"{BRIDGE_IP}/24", "dev", BRIDGE],
        ["ip", "link", "set", BRIDGE, "up"],
    ):
        subprocess.run(cmd, check=True, capture_output=True)
    Path("/proc/sys/net/ipv4/ip_forward").write_text("1")  # Pod -> Service -> Pod is routed
    make_cgroup(cgroup)

    def start(name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        proc = start_process(name, cmd, workdir)
        stack.callback(stop_process, proc)
        return proc

    start("containerd", ["containerd", "--config", str(workdir / "containerd/config.toml")])
    node = KubeNode(
        cluster=cluster,
        name=NODE_NAME,
        ip=node_ip,
        workdir=workdir,
        containerd_socket=workdir / "containerd.sock",
        images=reqs.images,
    )
    wait_for(
        "containerd answering",
        lambda: node.ctr("version", check=False).returncode == 0,
        60,
        (workdir / "containerd.log",),
    )
    # Containers left by a failed drain: killed before containerd stops (LIFO: runs first).
    stack.callback(kill_containers, node)
    t = time.monotonic()
    for key in ("pause_tar", "image_tar"):
        node.ctr("images", "import", reqs.images[key])
    phases["image import"] = time.monotonic() - t

    kubelet_port, healthz_port, proxy_healthz, proxy_metrics = free_ports(4)
    config = kubelet_config(workdir, node_ip, kubelet_port, healthz_port, cgroup)
    (workdir / "kubelet/config.json").write_text(json.dumps(config, indent=2))
    kubeconfig = str(cluster.kubeconfig)
    start(
        "kubelet",
        [
            str(reqs.kubelet),
            f"--config={workdir / 'kubelet/config.json'}",
            f"--kubeconfig={kubeconfig}",
            f"--root-dir={workdir / 'kubelet'}",
            f"--cert-dir={workdir / 'kubelet/pki'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={node_ip}",
            "--v=1",
        ],
    )
    start(
        "kube-scheduler",
        [
            str(reqs.kube_scheduler),
            f"--kubeconfig={kubeconfig}",
            "--leader-elect=false",
            "--secure-port=0",
        ],
    )
    proxy_flags = [
        f"--kubeconfig={kubeconfig}",
        "--proxy-mode=iptables",
        f"--hostname-override={NODE_NAME}",
        f"--cluster-cidr={POD_CIDR}",
        # Pod -> ClusterIP -> Pod on the same bridge: SNAT, so replies come back through the
        # host's conntrack even without br_netfilter.
        "--masquerade-all",
        # Leave the machine's conntrack table size and timeouts alone.
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0",
        "--conntrack-tcp-timeout-close-wait=0",
        "--oom-score-adj=0",
        f"--healthz-bind-address=127.0.0.1:{proxy_healthz}",
        f"--metrics-bind-address=127.0.0.1:{proxy_metrics}",
        # NodePorts on the node address only: no route_localnet change.
        f"--nodeport-addresses={node_ip}/32",
    ]
    stack.callback(
        subprocess.run,
        [str(reqs.kube_proxy), "--cleanup", "--proxy-mode=iptables"],
        capture_output=True,
        check=False,
    )
    start("kube-proxy", [str(reqs.kube_proxy), *proxy_flags])
    dns = [
        sys.executable,
        str(REPO_ROOT / "hack" / "node" / "clusterdns.py"),
        f"--listen={BRIDGE_IP}:53",
        f"--server={cluster.server}",
        f"--ca={cluster.ca_file}",
        f"--token-file={workdir / 'admin.token'}",
        f"--domain={CLUSTER_DOMAIN}",
    ]
    start("clusterdns", dns)
    logs = tuple(workdir / f"{n}.log" for n in ("kubelet", "containerd", "kube-proxy"))
    wait_for("node Ready", lambda: node_ready(cluster), NODE_READY_TIMEOUT_S, logs)
    record_node_sysctls(workdir)
    # Pushed after the node processes: runs before they stop.
    stack.callback(drain, cluster)
    node.startup_seconds = time.monotonic() - started
    node.phases_s = {**phases, "total": node.startup_seconds}
    return node


def copy_logs(workdir: Path, target: Path) -> None:
    """Copy the node's ``*.log`` files and the control plane's to ``target`` (debugging)."""
    target.mkdir(parents=True, exist_ok=True)
    for log in workdir.glob("*.log"):
        shutil.copy2(log, target / log.name)
    if (workdir / "pod-logs").is_dir():
        shutil.copytree(workdir / "pod-logs", target / "pod-logs", dirs_exist_ok=True)


def kill_containers(node: KubeNode) -> None:
    """Kill and delete every container still in containerd's ``k8s.io`` namespace."""
    listed = node.ctr("tasks", "ls", "-q", check=False).stdout.split()
    for task in listed:
        node.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
    for task in listed:
        node.ctr("tasks", "delete", "-f", task, check=False)
    for container in node.ctr("containers", "ls", "-q", check=False).stdout.split():
        node.ctr("containers", "delete", container, check=False)


@contextlib.contextmanager
def machine_lock(timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold :data:`LOCK_FILE` (flock, released by the kernel if the holder dies): only one node
    runs on a machine. Raises TimeoutError naming the holder after ``timeout_s``."""
    with LOCK_FILE.open("a+") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    handle.seek(0)
                    raise TimeoutError(
                        f"another test node holds {LOCK_FILE} (pid {handle.read().strip()})"
                    ) from None
                time.sleep(1.0)
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def running_node(binaries: Binaries, reqs: NodeRequirements) -> Iterator[KubeNode]:
    """The node, started under :func:`machine_lock`; everything undone on exit."""
    try:
        lock = machine_lock()
        lock.__enter__()
    except TimeoutError as err:
        skip_or_fail_node(str(err))
        raise AssertionError("unreachable") from err
    try:
        with contextlib.ExitStack() as stack:
            yield start_node(binaries, reqs, stack)
    finally:
        lock.__exit__(None, None, None)


# --- pytest wiring -------------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "node: needs a real node (root, Debian's containerd/runc/CNI, make controlplane image)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark tests that use ``kube_node`` ``node`` (and ``kube``: they need the binaries too)."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in FIXTURES_NEEDING_NODE):
            item.add_marker(pytest.mark.node)
            item.add_marker(pytest.mark.kube)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, with ``TOKENFAIR_REQUIRE_NODE=1``, fail) ``node`` tests the machine cannot run;
    first, so the reason names what the node lacks rather than only the control plane."""
    if item.get_closest_marker("node") is not None:
        require_node()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for phases in _startup_seconds:
        terminalreporter.write_line(f"kube_node: node Ready in {phases:.1f} s")


@pytest.fixture(scope="session")
def kube_node() -> Iterator[KubeNode]:
    """The session's node (see the module docstring); skips or fails without what it needs."""
    reqs = require_node()
    with running_node(require_binaries(), reqs) as node:
        _startup_seconds.append(node.startup_seconds)
        yield node
