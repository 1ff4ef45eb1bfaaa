"""Tenant authentication: ``Authorization: Bearer <key>`` -> tenant, by SHA-256 key hashes.

The config holds only ``sha256(key)`` in lower-case hex. A presented key is hashed once and the
digest looked up in a dictionary of the config's digests: O(1), so a bad key costs the same with
10,000 tenants as with 3 (it was a constant-time comparison with every digest: ~2.4 ms per 401
at 10,000 tenants, a cheap way to load the proxy).

**Why a dictionary lookup leaks nothing useful.** A lookup's time can depend on the digest
presented (its hash bucket, how many leading characters it shares with a stored digest before
the comparison stops). But the attacker does not choose the digest: they choose the key, and
the digest is SHA-256 of it. Learning that the digest of a guess shares a prefix (or a bucket)
with a valid digest tells nothing about a valid *key* — getting closer to a digest does not get
closer to a key that hashes to it (that is a preimage of SHA-256) — so the timing of the
lookup carries no information an attacker can climb. The key itself is only ever hashed, in
full, whatever its content. (:func:`hmac.compare_digest` matters where the attacker chooses the
compared value itself, an HMAC tag say, not where it is a hash of what they chose.)

A *trusted tenant header* (``SidecarSettings.trusted_tenant_header``) names the tenant directly; it
is honoured only when the operator turned that mode on (behind an authenticating gateway).
"""

from __future__ import annotations

from tokenfair.config import Config, TenantConfig, api_key_digest


class Authenticator:
    """Maps credentials to tenants of one config (rebuilt on every reload)."""

    __slots__ = ("_by_digest", "_config", "_trusted_header")

    def __init__(self, config: Config, trusted_header: str | None = None) -> None:
        self._config = config
        # The config refuses a digest held by two tenants (document.py), so each maps to one.
        self._by_digest = {
            digest: tenant for tenant in config.tenants for digest in tenant.api_key_sha256
        }
        self._trusted_header = trusted_header

    def by_key(self, key: str) -> TenantConfig | None:
        try:
            presented = api_key_digest(key)
        except UnicodeEncodeError:
            # Header bytes that are not UTF-8 arrive as surrogate escapes: no key is such text.
            return None
        return self._by_digest.get(presented)

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
