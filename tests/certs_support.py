"""Stand-ins for the webhook certificate tests, no cluster needed: a TLS server context from an
issued pair, a fake API holding the keeper's Secret and webhook configuration, and a clock the
test moves by hand."""

from __future__ import annotations

import base64
import datetime
import ssl
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from kubernetes.client import ApiException

from tokenfair_operator.certs import (
    Reached,
    ServingCerts,
)
from tokenfair_operator.webhook_certs import CertKeeper


def server_context(certs: ServingCerts) -> ssl.SSLContext:
    """A TLS server context serving ``certs`` (through files: ssl loads a chain from no other)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as folder:
        cert, key = Path(folder) / "tls.crt", Path(folder) / "tls.key"
        cert.write_bytes(certs.cert_pem)
        key.write_bytes(certs.key_pem)
        context.load_cert_chain(cert, key)
    return context


NAMES = ("tokenfair-operator", "tokenfair-operator.tf.svc")


class FakeCluster:
    """The keeper's API: one Secret (base64 data, as the API returns it) and one validating
    webhook configuration; counts the Secret's writes."""

    def __init__(self, names: Sequence[str] = NAMES) -> None:
        self.names = tuple(names)
        self.data: dict[str, str] | None = None
        self.writes = 0
        self.hook = SimpleNamespace(name="admit", client_config=SimpleNamespace(ca_bundle=None))

    def store(self, data: dict[str, bytes]) -> None:
        self.data = {k: base64.b64encode(v).decode() for k, v in data.items()}

    def secret_data(self) -> dict[str, bytes]:
        return {k: base64.b64decode(v) for k, v in (self.data or {}).items()}

    def ca_bundle(self) -> bytes:
        return base64.b64decode(cast(str, self.hook.client_config.ca_bundle))

    def keeper(
        self,
        folder: Path,
        clock: Callable[[], datetime.datetime],
        leads: bool = True,
        reached: Reached | None = None,
    ) -> CertKeeper:
        """A new keeper (as a newly started operator makes) over this cluster."""
        keeper = CertKeeper(
            None,
            ("tf", "webhook-tls"),
            self.names,
            ["tokenfair.io"],
            folder,
            clock,
            lambda: leads,
            reached=reached,
        )
        core = SimpleNamespace(
            read_namespaced_secret=self._read,
            create_namespaced_secret=lambda ns, body: self._write(body),
            replace_namespaced_secret=lambda name, ns, body: self._write(body),
        )
        admission = SimpleNamespace(
            read_validating_webhook_configuration=lambda name: SimpleNamespace(
                webhooks=[self.hook]
            ),
            patch_validating_webhook_configuration=self._patch,
            read_mutating_webhook_configuration=self._missing,
            patch_mutating_webhook_configuration=self._patch,
        )
        keeper._core, keeper._admission = cast(Any, core), cast(Any, admission)
        return keeper

    def _missing(self, *_: Any) -> Any:
        raise ApiException(status=404, reason="Not Found")

    def _read(self, name: str, namespace: str) -> Any:
        if self.data is None:
            self._missing()
        return SimpleNamespace(data=dict(self.data or {}))

    def _write(self, body: Any) -> None:
        self.data = dict(body.data)
        self.writes += 1

    def _patch(self, name: str, ops: list[dict[str, Any]]) -> None:
        for op in ops:
            if op["op"] == "add":
                self.hook.client_config.ca_bundle = op["value"]


class Clock:
    """``now()`` for the code under test, set by the test."""

    def __init__(self, now: datetime.datetime) -> None:
        self.now = now

    def __call__(self) -> datetime.datetime:
        return self.now
