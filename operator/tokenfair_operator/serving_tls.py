"""TLS for the document server, and the CA bundle sidecars verify it with.

The document server (:mod:`.serve`) answers sidecars' long-polls over TLS with the operator's
own serving certificate: the webhook's (the same Service, so the same DNS names), issued and
rotated by the leader (:mod:`.webhook_certs`, :mod:`.certs`) or by cert-manager, and served by
every replica. :class:`ServingTLS` holds the server's ``SSLContext`` and the relay's client
context over those files and reloads both when the files change (a rotation, a standby
following the leader's Secret): new handshakes get the new certificate, open connections
keep theirs.

Sidecars trust the CA bundle, not the system store: :class:`TrustPublisher` writes it into a
ConfigMap :data:`TRUST_CONFIGMAP` (key ``ca.crt``, only public certificates) in each namespace
that holds a SchedulingPolicy, as Istio's ``istio-ca-root-cert`` and Kubernetes'
``kube-root-ca.crt``; the injector projects it next to the ServiceAccount token
(:mod:`.inject`), and the kubelet refreshes it there, a minute or two later. So that this lag
never fails a poll, the operator's own certificate rotates in two phases (:mod:`.certs`): the
bundle holds the current and the next CA before the served leaf switches, and the previous CA
for a while after. The ConfigMap is owned by that namespace's policies (no ``controller``:
nothing blocks), so the garbage collector removes it with the last one. Only the leader
writes, asking right before each write; a write only where the bundle differs, and what was
written is remembered, so a steady round costs nothing; every :data:`RECHECK_ROUNDS` rounds
each namespace is read again (a deleted ConfigMap comes back). :meth:`TrustPublisher.holding_since`
tells the rotation since when every namespace's ConfigMap holds a CA (written, or read and
found in line), so the leaf switches only once they all do.
"""

from __future__ import annotations

import datetime
import ssl
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from cryptography import x509
from kubernetes import client
from kubernetes.client import ApiException

from .certs import CA_KEY
from .inject import TRUST_CONFIGMAP
from .kube import API_TIMEOUT_S, NOT_FOUND, NotLeader
from .views import GROUP, VERSION, PolicyView

MANAGED_BY: Final = {"app.kubernetes.io/managed-by": "tokenfair-operator"}
RECHECK_ROUNDS: Final = 10
"""Rounds between reads of every namespace's ConfigMap (5 minutes at the 30 s resync)."""
NO_NAMESPACE_SINCE: Final = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
"""What :meth:`TrustPublisher.holding_since` says when no namespace has a policy: no sidecar
waits for a CA."""


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _read(path: Path) -> bytes:
    return path.read_bytes()


def first_dns_name(cert_pem: bytes) -> str:
    """The first DNS name of a certificate's subjectAltName ("" without one): the name a relay
    asks for when it calls another replica by IP (every replica serves the same certificate)."""
    for cert in x509.load_pem_x509_certificates(cert_pem):
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            continue
        names = sans.get_values_for_type(x509.DNSName)
        if names:
            return str(names[0])
    return ""


@dataclass
class ServingTLS:
    """The serving certificate and key (PEM files; one file may hold both) and the CA bundle
    that verifies it (PEM file)."""

    cert: Path
    key: Path
    ca: Path
    server: ssl.SSLContext = field(init=False)
    client: ssl.SSLContext = field(init=False)
    """Verifies another replica (the relay): this CA bundle, hostname :attr:`server_name`."""
    server_name: str = field(init=False, default="")
    ca_pem: bytes = field(init=False, default=b"")
    _loaded: tuple[bytes, bytes, bytes] = field(init=False, default=(b"", b"", b""))

    def __post_init__(self) -> None:
        self.server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.server.minimum_version = ssl.TLSVersion.TLSv1_2
        self.client = ssl.create_default_context()
        self.reload()

    def reload(self) -> bool:
        """Load the files if they changed since the last load; True if they did. Raises
        (``OSError``, ``ssl.SSLError``, ``ValueError``) when they cannot be served, leaving
        the last good ones in use."""
        current = (_read(self.cert), _read(self.key), _read(self.ca))
        if current == self._loaded:
            return False
        client_context = ssl.create_default_context(cadata=current[2].decode())
        client_context.minimum_version = ssl.TLSVersion.TLSv1_2
        name = first_dns_name(current[0])
        # Load from one snapshot of the bytes (private copies), never from the files twice: a
        # kubelet swap between two reads could load a certificate with another key into the
        # context being served, which then fails every handshake until the next round. A
        # scratch context first: a pair that does not match raises there, not half-loaded.
        with tempfile.TemporaryDirectory(prefix="tokenfair-tls-") as folder:
            cert_copy, key_copy = Path(folder, "tls.crt"), Path(folder, "tls.key")
            cert_copy.write_bytes(current[0])
            key_copy.touch(mode=0o600)
            key_copy.write_bytes(current[1])
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert_copy, key_copy)
            # The same context object: the listening socket keeps it, new handshakes see it.
            self.server.load_cert_chain(cert_copy, key_copy)
        self.client, self.server_name, self.ca_pem = client_context, name, current[2]
        self._loaded = current
        return True


class TrustPublisher:
    """Writes the CA bundle into :data:`TRUST_CONFIGMAP` of each namespace given (blocking;
    called in a worker thread)."""

    def __init__(
        self,
        api: Any,
        recheck_rounds: int = RECHECK_ROUNDS,
        clock: Callable[[], datetime.datetime] = utc_now,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._written: dict[str, tuple[bytes, tuple[str, ...]]] = {}
        """namespace -> (bundle, owner uids) last written or found there."""
        self._recheck_rounds = recheck_rounds
        self._rounds = 0
        self._clock = clock
        self._held: dict[str, tuple[bytes, datetime.datetime]] = {}
        """namespace -> (the bundle its ConfigMap holds, since when we know it does)."""
        self._covered: frozenset[str] | None = None
        """The namespaces of the last round, when it brought every one in line (else None)."""

    def holding_since(self, ca_pem: bytes) -> datetime.datetime | None:
        """Since when every policy namespace's ConfigMap holds the CA ``ca_pem``, as far as
        this replica knows (from when it wrote it there, or first read it there); None when
        one does not, or the last round did not reach every namespace (a failed write, not
        the leader, none run yet)."""
        covered, pem = self._covered, ca_pem.strip()
        if covered is None or not pem:
            return None
        since = NO_NAMESPACE_SINCE
        for namespace in covered:
            held = self._held.get(namespace)
            if held is None or pem not in held[0]:
                return None
            since = max(since, held[1])
        return since

    def forget(self) -> None:
        """Check every namespace again at the next :meth:`publish`, and confirm nothing held
        until then (another leader may have written meanwhile)."""
        self._written.clear()
        self._held.clear()
        self._covered = None

    def publish(
        self,
        bundle: bytes,
        policies: Mapping[str, Sequence[PolicyView]],
        may_write: Callable[[], bool],
    ) -> list[str]:
        """Bring each namespace's ConfigMap in line with ``bundle``, owned by its ``policies``;
        the namespaces written. A namespace that fails is skipped (tried next round); the
        first failure is raised after the others are done."""
        written: list[str] = []
        failure: Exception | None = None
        if not may_write():
            self._covered = None
            return written
        self._rounds += 1
        if self._rounds % self._recheck_rounds == 0:
            self._written.clear()  # read again; what is found in line keeps its time
        covered: set[str] = set()
        complete = True
        for namespace in sorted(policies):
            owners = tuple(sorted(p.uid for p in policies[namespace] if p.uid))
            if not owners:
                continue
            covered.add(namespace)
            if self._written.get(namespace) == (bundle, owners):
                continue
            try:
                wrote, bundle_changed = self._ensure(
                    namespace, bundle, policies[namespace], may_write
                )
                if wrote:
                    written.append(namespace)
                self._written[namespace] = (bundle, owners)
                # Since when it holds this bundle: a write of its owners only keeps the time
                # (policy churn must not put off a certificate switch).
                if bundle_changed or self._held.get(namespace, (b"",))[0] != bundle:
                    self._held[namespace] = (bundle, self._clock())
            except NotLeader:
                self._written.pop(namespace, None)
                complete = False
                break  # stepped down: the new leader writes
            except Exception as exc:
                self._written.pop(namespace, None)
                complete = False
                failure = failure or exc
        self._covered = frozenset(covered) if complete else None
        if failure is not None:
            raise failure
        return written

    def _ensure(
        self,
        namespace: str,
        bundle: bytes,
        policies: Sequence[PolicyView],
        may_write: Callable[[], bool],
    ) -> tuple[bool, bool]:
        """Whether the ConfigMap was written, and whether its bundle changed by that (created,
        or its data replaced; not when only its owners were)."""
        data = {CA_KEY: bundle.decode()}
        owners = [
            client.V1OwnerReference(
                api_version=f"{GROUP}/{VERSION}", kind=policy.KIND, name=policy.name, uid=policy.uid
            )
            for policy in sorted(policies, key=lambda p: p.uid)
            if policy.uid
        ]
        try:
            current = self._core.read_namespaced_config_map(
                TRUST_CONFIGMAP, namespace, _request_timeout=API_TIMEOUT_S
            )
        except ApiException as exc:
            if exc.status != NOT_FOUND:
                raise
            current = None
        if current is None:
            if not may_write():
                raise NotLeader("not the leader any more")
            meta = client.V1ObjectMeta(
                name=TRUST_CONFIGMAP,
                namespace=namespace,
                labels=MANAGED_BY,
                owner_references=owners,
            )
            body = client.V1ConfigMap(metadata=meta, data=data)
            self._core.create_namespaced_config_map(namespace, body, _request_timeout=API_TIMEOUT_S)
            return True, True
        current_meta: Any = current.metadata
        uids = sorted(ref.uid for ref in current_meta.owner_references or [])
        same_data = current.data == data
        if same_data and uids == [o.uid for o in owners]:
            return False, False
        if not may_write():
            raise NotLeader("not the leader any more")
        # Replaced as read: conditional on its resourceVersion (a lost race is a 409, retried
        # next round); owners set to the namespace's policies now.
        current.data = data
        current_meta.owner_references = owners
        self._core.replace_namespaced_config_map(
            TRUST_CONFIGMAP, namespace, current, _request_timeout=API_TIMEOUT_S
        )
        return True, not same_data
