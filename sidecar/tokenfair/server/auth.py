"""Tenant authentication: ``Authorization: Bearer <key>`` -> tenant, by SHA-256 key hashes.

The config holds only ``sha256(key)`` in lower-case hex. A presented key is hashed once and compared
with **every** known digest using :func:`hmac.compare_digest`, without stopping at a match, so the
time taken does not tell an attacker how close a guess came (O(keys); tenants have few keys).

A *trusted tenant header* (``SidecarSettings.trusted_tenant_header``) names the tenant directly; it
is honoured only when the operator turned that mode on (behind an authenticating gateway).
"""

from __future__ import annotations

import hmac

from tokenfair.config import Config, TenantConfig, api_key_digest


class Authenticator:
    """Maps credentials to tenants of one config (rebuilt on every reload)."""

    __slots__ = ("_config", "_digests", "_trusted_header")

    def __init__(self, config: Config, trusted_header: str | None = None) -> None:
        self._config = config
        self._digests = tuple(
            (digest.encode("ascii"), tenant)
            for tenant in config.tenants
            for digest in tenant.api_key_sha256
        )
        self._trusted_header = trusted_header

    def by_key(self, key: str) -> TenantConfig | None:
        try:
            presented = api_key_digest(key).encode("ascii")
        except UnicodeEncodeError:
            # Header bytes that are not UTF-8 arrive as surrogate escapes: no key is such text.
            return None
        found: TenantConfig | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found

    def authenticate(self, authorization: str | None, trusted: str | None) -> TenantConfig | None:
        """The tenant of a request, or None (-> 401).

        ``authorization`` is the ``Authorization`` header, ``trusted`` the trusted tenant header's
        value (ignored unless the mode is on).
        """
        if self._trusted_header is not None and trusted:
            return self._config.tenant_index.get(trusted)
        if not authorization:
            return None
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return None
        return self.by_key(key.strip())
