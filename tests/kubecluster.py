"""Pytest plugin: a real Kubernetes control plane for the tests marked ``kube``.

``kube_cluster`` (session scope) starts etcd, kube-apiserver and, when built,
kube-controller-manager as child processes on free loopback ports, and stops them by process
group at the end of the session. What it runs:

- etcd, one member, data in a temporary folder, ``--unsafe-no-fsync`` (test data is disposable).
- kube-apiserver with a self-signed serving certificate (``--cert-dir``), one static admin token
  (``--token-auth-file``, user ``tokenfair-admin`` in ``system:masters``), ``--authorization-mode=
  RBAC``, and an ECDSA key that signs and verifies ServiceAccount tokens, so the TokenRequest API
  works. As in envtest, the ``ServiceAccount`` admission plugin is off (no kubelet mounts tokens).
- kube-controller-manager, when present, with only the garbage-collector, namespace and
  serviceaccount controllers: owner references cascade and deleted namespaces go away.

Every YAML file in the repository's ``crds/`` folder is applied (server-side) and waited for.
``start_cluster``/``running_cluster`` take a :class:`ControlPlaneOptions` whose defaults are
exactly the above; the node plugin (tests/kubenode.py) passes the flags a kubelet needs.

Binaries are looked up in ``$KUBEBUILDER_ASSETS`` first (envtest's convention: a folder with
``kube-apiserver``, ``etcd`` and ``kubectl``), then in the folders that ``make controlplane tools``
fills under ``$TOKENFAIR_CACHE`` (default ``$XDG_CACHE_HOME/tokenfair``, else
``~/.cache/tokenfair``), keyed by the pins in ``hack/controlplane/versions.env``. Without them,
``kube`` tests are skipped with a hint, unless ``TOKENFAIR_REQUIRE_KUBE=1`` (CI), where they fail.
Tests that use ``kube_cluster`` or ``kube_namespace`` get the ``kube`` marker automatically.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from loopback_support import free_ports

pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[1]
VERSIONS_FILE = REPO_ROOT / "hack" / "controlplane" / "versions.env"
CRDS_DIR = REPO_ROOT / "crds"
REQUIRE_ENV = "TOKENFAIR_REQUIRE_KUBE"
HOW_TO_GET = (
    "run `make controlplane tools`, or set KUBEBUILDER_ASSETS to a folder holding "
    "kube-apiserver, etcd and kubectl"
)
ADMIN_USER = "tokenfair-admin"
# Generous: a cold page cache on a 2-core machine; a warm start takes a few seconds.
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
WORKDIR_PREFIX = "tokenfair-kube-"
OWNER_FILE = "owner.pid"
# Free ports are picked before the children bind them; another process may win that race.
START_ATTEMPTS = 3
FIXTURES_NEEDING_KUBE = ("kube_cluster", "kube_namespace")
# Filled by the kube_cluster fixture, printed in the terminal summary.
_startup_seconds: list[float] = []


# --- locating the binaries -------------------------------------------------------------------


def read_versions(path: Path = VERSIONS_FILE) -> dict[str, str]:
    """Parse the ``KEY = VALUE`` lines of ``hack/controlplane/versions.env`` (``#`` comments)."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.lstrip().startswith("#"):
            pins[key.strip()] = value.strip()
    return pins


def cache_root() -> Path:
    """``$TOKENFAIR_CACHE``, else ``$XDG_CACHE_HOME/tokenfair``, else ``~/.cache/tokenfair``."""
    if explicit := os.environ.get("TOKENFAIR_CACHE"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "tokenfair"


def search_dirs() -> list[Path]:
    """Folders searched for binaries, first hit wins: KUBEBUILDER_ASSETS, then the make caches."""
    pins = read_versions()
    root = cache_root()
    dirs = [Path(assets)] if (assets := os.environ.get("KUBEBUILDER_ASSETS")) else []
    dirs.append(root / "controlplane" / f"{pins['KUBE_VERSION']}-{pins['ETCD_VERSION']}")
    tools = f"{pins['TOOLS_LAYER']}-{pins['TOOLS_LAYER_VERSION']}"
    tools += f"_{pins['HELM3_LAYER']}-{pins['HELM3_LAYER_VERSION']}"
    dirs.append(root / "tools" / tools)
    return dirs


def find_binary(name: str) -> Path | None:
    """The first executable ``name`` in :func:`search_dirs`, or None. PATH is never used."""
    for folder in search_dirs():
        candidate = folder / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass(frozen=True)
class Binaries:
    """Paths of the control-plane programs; the optional ones may be None."""

    kube_apiserver: Path
    etcd: Path
    kubectl: Path
    kube_controller_manager: Path | None
    helm3: Path | None
    helm4: Path | None


def find_binaries() -> Binaries | str:
    """All binaries, or a skip/fail reason naming what is missing and how to get it."""
    apiserver, etcd, kubectl = (find_binary(n) for n in ("kube-apiserver", "etcd", "kubectl"))
    if apiserver is None or etcd is None or kubectl is None:
        missing = [n for n in ("kube-apiserver", "etcd", "kubectl") if find_binary(n) is None]
        searched = ", ".join(str(d) for d in search_dirs())
        return f"no {', '.join(missing)} in {searched}: {HOW_TO_GET}"
    return Binaries(
        kube_apiserver=apiserver,
        etcd=etcd,
        kubectl=kubectl,
        kube_controller_manager=find_binary("kube-controller-manager"),
        helm3=find_binary("helm3"),
        helm4=find_binary("helm4"),
    )


def skip_or_fail(reason: str) -> None:
    """Skip with ``reason``; fail instead when ``TOKENFAIR_REQUIRE_KUBE=1`` (CI must not skip)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


def require_binaries() -> Binaries:
    """The binaries, or skip/fail the current test (see :func:`skip_or_fail`)."""
    found = find_binaries()
    if isinstance(found, str):
        skip_or_fail(found)
        raise AssertionError("unreachable")  # pytest.skip/fail raise
    return found


# --- the running cluster ---------------------------------------------------------------------


@dataclass(frozen=True)
class ApiResponse:
    """An API server answer: HTTP status and the decoded JSON body (``{}`` when not JSON)."""

    status: int
    body: dict[str, Any]


@dataclass
class KubeCluster:
    """A running control plane: where it listens, an admin credential, and small helpers."""

    server: str
    ca_file: Path
    admin_token: str
    kubeconfig: Path
    binaries: Binaries
    workdir: Path
    startup_seconds: float = 0.0

    @functools.cached_property
    def _ssl(self) -> ssl.SSLContext:
        # Lazy: kube-apiserver writes its self-signed certificate only once it has started.
        return ssl.create_default_context(cafile=str(self.ca_file))

    def request(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
        *,
        token: str | None = None,
        content_type: str = "application/json",
        timeout: float = 30.0,
    ) -> ApiResponse:
        """One API call as the admin (or ``token``); never raises on an HTTP error status."""
        data = None if body is None else json.dumps(body).encode()
        headers = {
            "Authorization": f"Bearer {token or self.admin_token}",
            "Accept": "application/json",
        }
        if data is not None:
            headers["Content-Type"] = content_type
        req = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with self._opener().open(req, timeout=timeout) as resp:
                return ApiResponse(resp.status, _json_object(resp.read()))
        except urllib.error.HTTPError as err:
            with err:
                return ApiResponse(err.code, _json_object(err.read()))

    def watch(
        self,
        path: str,
        *,
        resource_version: str,
        timeout_seconds: int = 30,
        token: str | None = None,
    ) -> Generator[dict[str, Any], None, None]:
        """Watch events (``{"type": ..., "object": ...}``) on a collection ``path`` after
        ``resource_version``; the server ends the stream after ``timeout_seconds``."""
        sep = "&" if "?" in path else "?"
        query = f"{sep}watch=1&resourceVersion={resource_version}&timeoutSeconds={timeout_seconds}"
        headers = {"Authorization": f"Bearer {token or self.admin_token}"}
        req = urllib.request.Request(self.server + path + query, headers=headers)
        with self._opener().open(req, timeout=timeout_seconds + 10) as resp:
            for line in resp:
                yield _json_object(line)

    def create_namespace(self, prefix: str = "t") -> str:
        """Create a namespace named ``<prefix>-<random>`` and return its name."""
        name = f"{prefix}-{secrets.token_hex(4)}"
        self.expect(201, "POST", "/api/v1/namespaces", {"metadata": {"name": name}})
        return name

    def delete_namespace(self, name: str) -> None:
        """Delete a namespace without waiting (kube-controller-manager, if running, empties it)."""
        self.expect((200, 202, 404), "DELETE", f"/api/v1/namespaces/{name}")

    def create_service_account(self, namespace: str, name: str) -> None:
        """Create a ServiceAccount (it has no permissions beyond the defaults until bound)."""
        body = {"metadata": {"name": name}}
        self.expect(201, "POST", f"/api/v1/namespaces/{namespace}/serviceaccounts", body)

    def service_account_token(
        self, namespace: str, name: str, *, expiration_seconds: int = 3600
    ) -> str:
        """A bearer token for an existing ServiceAccount from the TokenRequest API (default 1 h),
        so code under test can act with exactly the RBAC that ServiceAccount was granted."""
        body = {"spec": {"expirationSeconds": expiration_seconds}}
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token"
        token = self.expect(201, "POST", path, body).body["status"]["token"]
        assert isinstance(token, str)
        return token

    def write_kubeconfig(self, path: Path, token: str | None = None, user: str = "admin") -> Path:
        """Write a self-contained kubeconfig for ``token`` (default: the admin) to ``path``."""
        ca_data = base64.b64encode(self.ca_file.read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "tokenfair",
                    "cluster": {"server": self.server, "certificate-authority-data": ca_data},
                }
            ],
            "users": [{"name": user, "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": user, "context": {"cluster": "tokenfair", "user": user}}],
            "current-context": user,
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML: every client reads it
        path.chmod(0o600)
        return path

    def kubectl(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this cluster (admin unless ``kubeconfig``); raise on failure if
        ``check``. Text in and out; its discovery cache lives in the cluster's temp folder."""
        cmd = [str(self.binaries.kubectl), *args]
        return self._run(cmd, input=input, check=check, kubeconfig=kubeconfig, timeout=timeout)

    def helm(
        self,
        *args: str,
        major: int = 4,
        check: bool = True,
        kubeconfig: Path | None = None,
        timeout: float = 120.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run Helm ``major`` (3 or 4) against this cluster; skip/fail the test if it is absent."""
        helm = {3: self.binaries.helm3, 4: self.binaries.helm4}.get(major)
        if helm is None:
            skip_or_fail(f"no helm{major}: {HOW_TO_GET}")
            raise AssertionError("unreachable")
        cmd = [str(helm), *args]
        return self._run(cmd, input=None, check=check, kubeconfig=kubeconfig, timeout=timeout)

    def expect(
        self,
        status: int | Sequence[int],
        method: str,
        path: str,
        body: Mapping[str, Any] | None = None,
    ) -> ApiResponse:
        """:meth:`request` as the admin, asserting the status is (one of) ``status``."""
        wanted = (status,) if isinstance(status, int) else tuple(status)
        resp = self.request(method, path, body)
        assert resp.status in wanted, f"{method} {path}: {resp.status} {resp.body}"
        return resp

    def _opener(self) -> urllib.request.OpenerDirector:
        # No ProxyHandler: an HTTPS_PROXY in the environment must never see loopback traffic.
        return urllib.request.build_opener(urllib.request.HTTPSHandler(context=self._ssl))

    def _run(
        self,
        cmd: list[str],
        *,
        input: str | None,
        check: bool,
        kubeconfig: Path | None,
        timeout: float,
    ) -> subprocess.CompletedProcess[str]:
        home = self.workdir / "client-home"
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig or self.kubeconfig),
            "KUBECACHEDIR": str(home / "kube-cache"),
            # Keep Helm's repositories, cache and plugins out of the developer's home.
            "HELM_CACHE_HOME": str(home / "helm-cache"),
            "HELM_CONFIG_HOME": str(home / "helm-config"),
            "HELM_DATA_HOME": str(home / "helm-data"),
        }
        result = subprocess.run(
            cmd, input=input, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr}")
        return result


def _json_object(raw: bytes) -> dict[str, Any]:
    """Decode a JSON object; anything else (plain-text errors, empty bodies) becomes ``{}``."""
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


# --- starting and stopping -------------------------------------------------------------------


def start_process(
    name: str, cmd: list[str], workdir: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in its own process group (so it can be stopped as a whole), output to
    ``workdir/<name>.log``, with ``env`` (default: pytest's environment). Where util-linux's
    ``setpriv`` exists the child also gets SIGKILL if pytest dies without tearing down (kill -9,
    a second Ctrl-C): no orphans even then."""
    if setpriv := shutil.which("setpriv"):
        cmd = [setpriv, "--pdeathsig", "KILL", "--", *cmd]
    with (workdir / f"{name}.log").open("wb") as log:
        return subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, SIGKILL it after ``STOP_TIMEOUT_S``; reap the leader."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
            break
        except subprocess.TimeoutExpired:
            continue
    # The leader is gone; make sure nothing it spawned lingers in its group.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def log_tail(workdir: Path, name: str, lines: int = 25) -> str:
    """The last ``lines`` lines of a child's log, for error messages."""
    path = workdir / f"{name}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return f"--- {name}.log (tail) ---\n" + "\n".join(text.splitlines()[-lines:])


def generate_service_account_key(path: Path) -> None:
    """An ECDSA P-256 key for signing and verifying ServiceAccount tokens, via the openssl CLI
    (the standard library cannot make keys; ECDSA is instant where RSA takes a moment)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("kube_cluster needs the `openssl` command to make a signing key")
    subprocess.run(
        [openssl, "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(path)],
        check=True,
        capture_output=True,
    )


def etcd_command(binary: Path, workdir: Path, client_port: int, peer_port: int) -> list[str]:
    """One etcd member on loopback; fsync off because test data is thrown away."""
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(binary),
        "--name=tokenfair",
        f"--data-dir={workdir / 'etcd'}",
        f"--listen-client-urls={client}",
        f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}",
        f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=tokenfair={peer}",
        "--unsafe-no-fsync=true",
        "--log-level=warn",
    ]


@dataclass(frozen=True)
class ControlPlaneOptions:
    """What differs between the API-only control plane (``kube_cluster``, the defaults) and one
    that a kubelet joins (``kube_node`` in tests/kubenode.py, see docs/node.md)."""

    #: Address kube-apiserver listens on; ``0.0.0.0`` lets Pods reach it through the
    #: ``kubernetes`` Service (its self-signed certificate then names ``advertise_address``).
    bind_address: str = "127.0.0.1"
    #: Address published in the ``kubernetes`` Service's endpoints and used by the clients here.
    advertise_address: str = "127.0.0.1"
    #: ClusterIP range (``--service-cluster-ip-range``); its first address is ``kubernetes``.
    service_cidr: str = "10.0.0.0/24"
    #: The ``ServiceAccount`` admission plugin, which gives Pods their token volume. Off without
    #: a kubelet: the ``default`` ServiceAccount would race the controller that creates it.
    service_account_admission: bool = False
    #: ``none``: loopback may not be an endpoint; ``lease`` keeps ``kubernetes`` pointing at
    #: ``advertise_address`` (a node address).
    endpoint_reconciler: str = "none"
    #: kube-controller-manager's ``--controllers``.
    controllers: str = "garbage-collector-controller,namespace-controller,serviceaccount-controller"
    #: Give kube-controller-manager the serving certificate's CA as ``--root-ca-file``, so it
    #: publishes ConfigMap ``kube-root-ca.crt`` in every namespace (Pods' token volumes use it).
    publish_root_ca: bool = False
    #: Appended to kube-apiserver's flags.
    extra_apiserver_flags: tuple[str, ...] = ()
    #: Appended to kube-controller-manager's flags.
    extra_controller_manager_flags: tuple[str, ...] = ()


DEFAULT_OPTIONS = ControlPlaneOptions()


def apiserver_command(
    binary: Path,
    workdir: Path,
    etcd_port: int,
    port: int,
    options: ControlPlaneOptions = DEFAULT_OPTIONS,
) -> list[str]:
    """kube-apiserver flags, after envtest's (controller-runtime's controlplane/apiserver.go),
    with token instead of client-certificate authentication."""
    sa_key = workdir / "sa.key"
    command = [
        str(binary),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--bind-address={options.bind_address}",
        f"--advertise-address={options.advertise_address}",
        f"--secure-port={port}",
        f"--cert-dir={workdir / 'pki'}",
        f"--token-auth-file={workdir / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer=https://{options.advertise_address}:{port}",
        f"--service-account-key-file={sa_key}",
        f"--service-account-signing-key-file={sa_key}",
        f"--service-cluster-ip-range={options.service_cidr}",
        "--allow-privileged=true",
    ]
    if not options.service_account_admission:
        # No kubelet mounts tokens and the `default` ServiceAccount would race the controller.
        command.append("--disable-admission-plugins=ServiceAccount")
    # Endpoints of the `kubernetes` Service may not point at loopback (`none` then).
    command.append(f"--endpoint-reconciler-type={options.endpoint_reconciler}")
    command.append("--profiling=false")
    return [*command, *options.extra_apiserver_flags]


def controller_manager_command(
    binary: Path, kubeconfig: Path, options: ControlPlaneOptions = DEFAULT_OPTIONS
) -> list[str]:
    """kube-controller-manager with just the controllers API-level tests notice."""
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--controllers={options.controllers}",
        "--leader-elect=false",
        "--bind-address=127.0.0.1",
        "--secure-port=0",  # serves nothing: no port to collide on
        *options.extra_controller_manager_flags,
    ]


def wait_ready(cluster: KubeCluster, procs: Mapping[str, subprocess.Popen[bytes]]) -> None:
    """Poll ``/readyz`` until 200; raise with the logs if a child exits or time runs out."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(
                    f"{name} exited with {proc.returncode}\n{log_tail(cluster.workdir, name)}"
                )
        # The serving certificate appears once kube-apiserver has parsed its flags.
        if cluster.ca_file.exists():
            with contextlib.suppress(OSError):
                if cluster.request("GET", "/readyz", timeout=2.0).status == 200:
                    return
        time.sleep(0.1)
    logs = "\n".join(log_tail(cluster.workdir, name) for name in procs)
    raise RuntimeError(f"kube-apiserver not ready after {START_TIMEOUT_S:.0f} s\n{logs}")


def apply_crds(cluster: KubeCluster, crds_dir: Path = CRDS_DIR) -> None:
    """Apply every YAML file in ``crds_dir`` (server-side: big schemas overflow the client-side
    annotation) and wait until each CRD is Established. No folder or no files: nothing to do."""
    files = sorted(p for p in crds_dir.glob("*.y*ml") if p.is_file()) if crds_dir.is_dir() else []
    if not files:
        return
    file_args = [arg for path in files for arg in ("-f", str(path))]
    cluster.kubectl("apply", "--server-side", "--force-conflicts", *file_args)
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", "crd", "--all")


def remove_stale_workdirs() -> None:
    """Remove temporary folders left by a killed pytest (its children died with it, see
    :func:`start_process`): those whose owner process no longer exists."""
    for workdir in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*"):
        try:
            os.kill(int((workdir / OWNER_FILE).read_text()), 0)
        except ProcessLookupError:
            shutil.rmtree(workdir, ignore_errors=True)
        except (OSError, ValueError):
            continue  # being created, or not ours to judge


def start_cluster(
    binaries: Binaries,
    stack: contextlib.ExitStack,
    options: ControlPlaneOptions = DEFAULT_OPTIONS,
) -> KubeCluster:
    """Start the control plane in a fresh temporary folder and return it once ready (CRDs
    applied). Stopping the processes and removing the folder are pushed onto ``stack``."""
    started = time.monotonic()
    remove_stale_workdirs()
    workdir = Path(tempfile.mkdtemp(prefix=WORKDIR_PREFIX))
    stack.callback(shutil.rmtree, workdir, ignore_errors=True)
    (workdir / OWNER_FILE).write_text(str(os.getpid()))
    admin_token = secrets.token_urlsafe(32)
    tokens = f'{admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n'
    (workdir / "tokens.csv").write_text(tokens)
    generate_service_account_key(workdir / "sa.key")
    etcd_port, peer_port, port = free_ports(3)
    cluster = KubeCluster(
        server=f"https://{options.advertise_address}:{port}",
        ca_file=workdir / "pki" / "apiserver.crt",
        admin_token=admin_token,
        kubeconfig=workdir / "admin.kubeconfig",
        binaries=binaries,
        workdir=workdir,
    )
    # Started together: kube-apiserver retries etcd until it answers, which saves a second.
    commands = {
        "etcd": etcd_command(binaries.etcd, workdir, etcd_port, peer_port),
        "kube-apiserver": apiserver_command(
            binaries.kube_apiserver, workdir, etcd_port, port, options
        ),
    }
    procs: dict[str, subprocess.Popen[bytes]] = {}
    for name, cmd in commands.items():
        procs[name] = start_process(name, cmd, workdir)
        stack.callback(stop_process, procs[name])  # LIFO: kube-apiserver stops before etcd
    wait_ready(cluster, procs)
    cluster.write_kubeconfig(cluster.kubeconfig)
    if binaries.kube_controller_manager is not None:
        kcm = controller_manager_command(
            binaries.kube_controller_manager, cluster.kubeconfig, options
        )
        if options.publish_root_ca:
            kcm.append(f"--root-ca-file={cluster.ca_file}")
        stack.callback(stop_process, start_process("kube-controller-manager", kcm, workdir))
    apply_crds(cluster)
    cluster.startup_seconds = time.monotonic() - started
    return cluster


@contextlib.contextmanager
def running_cluster(
    binaries: Binaries, options: ControlPlaneOptions = DEFAULT_OPTIONS
) -> Iterator[KubeCluster]:
    """:func:`start_cluster`, retried with new ports if one was taken in the meantime; on exit
    every process is stopped and the temporary folder removed."""
    for attempt in range(1, START_ATTEMPTS + 1):
        with contextlib.ExitStack() as stack:
            try:
                cluster = start_cluster(binaries, stack, options)
            except RuntimeError as err:
                if "address already in use" in str(err) and attempt < START_ATTEMPTS:
                    continue
                raise
            yield cluster
            return


# --- pytest wiring ---------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Register ``kube`` here too, so the plugin works in any project (pytester runs included)."""
    config.addinivalue_line(
        "markers",
        "kube: needs a real kube-apiserver and etcd (make controlplane, or KUBEBUILDER_ASSETS)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses a cluster fixture ``kube``, so ``-m 'not kube'`` leaves it out."""
    for item in items:
        if any(name in getattr(item, "fixturenames", ()) for name in FIXTURES_NEEDING_KUBE):
            item.add_marker(pytest.mark.kube)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or, with ``TOKENFAIR_REQUIRE_KUBE=1``, fail) ``kube`` tests without binaries."""
    if item.get_closest_marker("kube") is not None:
        require_binaries()


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Report how long the control plane took to start, when one was started."""
    for seconds in _startup_seconds:
        terminalreporter.write_line(f"kube_cluster: control plane ready in {seconds:.1f} s")


@pytest.fixture(scope="session")
def kube_cluster() -> Iterator[KubeCluster]:
    """The session's control plane (see the module docstring); skips or fails without binaries."""
    with running_cluster(require_binaries()) as cluster:
        _startup_seconds.append(cluster.startup_seconds)
        yield cluster


@pytest.fixture
def kube_namespace(kube_cluster: KubeCluster) -> Iterator[str]:
    """A fresh namespace for one test, deleted afterwards."""
    name = kube_cluster.create_namespace()
    yield name
    kube_cluster.delete_namespace(name)
