"""Keep the webhook's own certificates: a Secret, the caBundle of named webhook configurations,
and the files Kopf's webhook server loads (blocking I/O; called in a worker thread).

Used when no cert-manager issues the certificate (``$TOKENFAIR_WEBHOOK_CERT_SECRET`` set, see
:class:`.settings.OperatorConfig`). One :meth:`CertKeeper.ensure` pass:

1. read the Secret (a :class:`.certs.Rotation`: the current pair, and during a rotation the
   next pair or the previous CA, with their times) and take the next step of the two-phase
   rotation (:func:`.certs.advance`): publish the next CA when renewal is due, switch to the
   next pair once its CA has been published for ``settle``, drop the previous CA ``settle``
   later; write the Secret when it changed (an existing Secret is updated, a missing one
   created; a CA's key is never stored). Parts of the Secret that cannot be read are logged,
   left out and the Secret rewritten without them (a next pair is issued again), never raised:
   a raise would fail every pass on the same Secret;
2. set ``caBundle`` on every webhook of the named Validating/MutatingWebhookConfigurations that
   exist, only where it differs: :meth:`.certs.Rotation.bundle`, the same bundle the document
   server's sidecars get (:mod:`.serving_tls`). The API server reads it at once, so the
   webhook needs no waiting; it follows the same phases, which keep the previous CA trusted
   until every replica's Kopf has reloaded its files, across a restart too;
3. write ``ca.crt`` and ``tls.pem`` (the serving certificate and its key in one file, so one
   atomic rename switches both: Kopf never loads a certificate with the other one's key) into
   the directory Kopf's server reads, only where they differ (Kopf notices changed files within
   60 s and restarts its listener).

Every write (the Secret, each caBundle patch) first asks ``may_write`` (with leader election:
whether this replica leads *now*) and raises :class:`.kube.NotLeader` instead: a leader that
stepped down in the middle of a pass writes nothing more.

The Secret is the source of truth, so a restarted operator (or a new leader) serves the same
certificate, the caBundle does not move and a rotation under way goes on where it was. Run at
startup and then every hour: a rotation starts 30 days before the certificate expires and takes
one step per pass (:mod:`.certs`).
"""

from __future__ import annotations

import base64
import datetime
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kubernetes import client
from kubernetes.client import ApiException

from .certs import CA_KEY, TRUST_SETTLE, Reached, Rotation, ServingCerts, advance
from .kube import NOT_FOUND, NotLeader

log = logging.getLogger("tokenfair.operator")

WEBHOOK_KINDS: Final = ("validating", "mutating")


SERVING_FILE: Final = "tls.pem"


@dataclass(frozen=True, slots=True)
class CertFiles:
    """Where the serving certificate, its key (the same file: key then certificate) and the CA
    bundle are for Kopf's server."""

    cert: Path
    key: Path
    ca: Path


def utc_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class CertKeeper:
    """One Secret ``namespace/name``, the webhook configurations ``configurations`` (each name
    looked up as both kinds), the files in ``directory``; ``may_write`` is asked right before
    each API write; ``settle``: how long a next CA is published before its leaf is served
    (:func:`.certs.trust_settle`); ``reached``: since when the sidecars' ConfigMaps hold a CA
    (:meth:`.serving_tls.TrustPublisher.holding_since`; None: the Secret's time alone), also
    settable later (the publisher starts after the keeper)."""

    def __init__(
        self,
        api: Any,
        secret: tuple[str, str],
        dns_names: Sequence[str],
        configurations: Sequence[str],
        directory: Path,
        clock: Callable[[], datetime.datetime] = utc_now,
        may_write: Callable[[], bool] = lambda: True,
        settle: datetime.timedelta = TRUST_SETTLE,
        reached: Reached | None = None,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self._admission = client.AdmissionregistrationV1Api(api)
        self._namespace, self._name = secret
        self._dns_names = tuple(dns_names)
        self._configurations = tuple(configurations)
        serving = directory / SERVING_FILE
        self.files = CertFiles(serving, serving, directory / CA_KEY)
        self._clock = clock
        self._may_write = may_write
        self._settle = settle
        self.reached = reached

    def _guard(self, what: str) -> None:
        if not self._may_write():
            raise NotLeader(f"not the leader: {what} not written")

    def ensure(self) -> str | None:
        """Bring Secret, caBundles and files in line; what the rotation did (None: nothing)."""
        stored, problems, secret = self._read_secret()
        for problem in problems:
            log.warning(
                "webhook certificate Secret %s/%s: %s", self._namespace, self._name, problem
            )
        step = advance(stored, self._dns_names, self._clock(), self._settle, reached=self.reached)
        if step.rotation != stored or problems:
            self._write_secret(step.rotation, secret)
        bundle = step.rotation.bundle()
        for name in self._configurations:
            for kind in WEBHOOK_KINDS:
                self._patch_ca_bundle(kind, name, bundle)
        self._write_files(step.rotation.current, bundle)
        return "; ".join(step.events) or None

    def follow(self) -> bool:
        """A standby's pass: write the files from the certificates the leader keeps in the
        Secret (never issues, never patches): the same leaf and bundle as the leader's; False
        while there are none yet."""
        stored, _, _ = self._read_secret()
        if stored is None:
            return False
        self._write_files(stored.current, stored.bundle())
        return True

    def _read_secret(self) -> tuple[Rotation | None, list[str], Any]:
        """The stored rotation (None if absent or without a complete current pair), what in it
        could not be read, and the Secret (None if there is none)."""
        try:
            secret = self._core.read_namespaced_secret(self._name, self._namespace)
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return None, [], None
            raise
        data: dict[str, bytes] = {}
        problems: list[str] = []
        for key, value in (secret.data or {}).items():
            try:
                data[key] = base64.b64decode(value, validate=True)
            except ValueError:
                problems.append(f"{key}: not base64")
        stored, unreadable = Rotation.from_secret_data(data)
        return stored, problems + unreadable, secret

    def _write_secret(self, rotation: Rotation, secret: Any) -> None:
        data: dict[str, bytes | str] = {
            k: base64.b64encode(v).decode() for k, v in rotation.as_secret_data().items()
        }
        if secret is None:
            meta = client.V1ObjectMeta(name=self._name, namespace=self._namespace)
            body = client.V1Secret(metadata=meta, data=data)
            self._guard(f"Secret {self._namespace}/{self._name}")
            self._core.create_namespaced_secret(self._namespace, body)
            return
        # Replace the object as read (the chart's labels kept): conditional on its
        # resourceVersion, so a lost race is a 409 and the next pass starts over.
        secret.data = data
        self._guard(f"Secret {self._namespace}/{self._name}")
        self._core.replace_namespaced_secret(self._name, self._namespace, secret)

    def _patch_ca_bundle(self, kind: str, name: str, bundle: bytes) -> None:
        read = getattr(self._admission, f"read_{kind}_webhook_configuration")
        patch = getattr(self._admission, f"patch_{kind}_webhook_configuration")
        try:
            config = read(name)
        except ApiException as exc:
            if exc.status == NOT_FOUND:
                return  # e.g. the mutating one, when the chart installs no injection
            raise
        encoded = base64.b64encode(bundle).decode()
        ops: list[dict[str, Any]] = []
        for i, hook in enumerate(config.webhooks or []):
            if hook.client_config.ca_bundle != encoded:
                # `test` first: if the list changed since we read it, the patch fails whole.
                ops.append({"op": "test", "path": f"/webhooks/{i}/name", "value": hook.name})
                path = f"/webhooks/{i}/clientConfig/caBundle"
                ops.append({"op": "add", "path": path, "value": encoded})
        if ops:
            self._guard(f"caBundle of {kind} webhook configuration {name}")
            patch(name, ops)

    def _write_files(self, certs: ServingCerts, bundle: bytes) -> None:
        # The bundle first: a reader that sees the new leaf already finds its CA.
        _write_if_changed(self.files.ca, bundle)
        _write_if_changed(self.files.cert, certs.key_pem + certs.cert_pem)


def _write_if_changed(path: Path, content: bytes) -> None:
    """Atomically (write aside, rename) and only when different: an unchanged file keeps its
    mtime, so Kopf does not restart its listener for nothing. Private: mode 0600."""
    if path.exists() and path.read_bytes() == content:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.tmp")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(content)
    os.replace(aside, path)
