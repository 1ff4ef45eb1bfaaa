"""The webhook's own certificates, when no cert-manager issues them (pure: no API, no files).

:func:`issue` makes a fresh CA and a serving certificate it signs, for the webhook Service's DNS
names; :func:`due` says when a stored pair must be replaced. Both are ECDSA P-256. The CA's
private key is thrown away once the leaf is signed: a rotation issues a new CA and a new leaf
together.

A rotation has two phases (:func:`advance`, over the :class:`Rotation` kept in the Secret), so
that no client ever meets a leaf its CA bundle cannot verify. The sidecars read the bundle
from a projected ConfigMap, which the kubelet refreshes a minute or two after the operator
wrote it; the API server reads the webhooks' caBundle at once.

1. *Publish the next CA.* Renewal is due: the next CA and its leaf are issued and stored
   beside the current pair; the bundle (:meth:`Rotation.bundle`) holds both CAs; the current
   leaf is still served.
2. *Switch the leaf.* Once the next CA has been published for at least ``settle``
   (:data:`TRUST_SETTLE`: every client's bundle holds it by then), the next pair becomes the
   current one; the old CA stays in the bundle (a replica or Kopf's listener may present the
   old leaf until it reloads its files). When the document server serves this certificate,
   ``settle`` counts from when every policy namespace's ConfigMap was seen holding the next CA
   (``reached``), not only from the Secret's time; if that cannot be confirmed for
   :data:`SWITCH_ANYWAY`, the leaf switches anyway.
3. *Drop the old CA* once it has been retired for ``settle`` too.

Each step happens at the first check (hourly) after its interval. A current pair that cannot
be served any more (none, unreadable, other DNS names, not valid yet, or less than ``settle``
left) is replaced at once: by the next pair when one is pending, else by a fresh one (one
phase; nothing valid to keep serving).

Defaults: valid 90 days (``VALIDITY``), a rotation starts once less than 30 days remain
(``RENEW_BEFORE``); the operator checks every hour, so the leaf switches about an hour later (at
the first check at least :data:`TRUST_SETTLE` after the next CA was published) and the old CA
leaves the bundle an hour after that: a certificate is never served in its last 29 days.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY: Final = datetime.timedelta(days=90)
RENEW_BEFORE: Final = datetime.timedelta(days=30)
CLOCK_SKEW: Final = datetime.timedelta(minutes=5)
"""Certificates start this much before ``now``: an API server whose clock is a little behind
ours still accepts a fresh one."""

CA_KEY: Final = "ca.crt"
CERT_KEY: Final = "tls.crt"
PKEY_KEY: Final = "tls.key"
NEXT_PREFIX: Final = "next-"
"""The pending next pair's keys: ``next-ca.crt``, ``next-tls.crt``, ``next-tls.key``."""
NEXT_SINCE_KEY: Final = "next-published-at"
"""When the next CA was first published (ISO 8601, UTC)."""
PREVIOUS_CA_KEY: Final = "previous-ca.crt"
PREVIOUS_SINCE_KEY: Final = "previous-retired-at"
"""When the previous CA's leaf stopped being served (ISO 8601, UTC)."""

KUBELET_SYNC_PERIOD: Final = datetime.timedelta(seconds=60)
"""The kubelet's ``syncFrequency``: how often it refreshes a Pod's projected volumes."""
KUBELET_CACHE_TTL: Final = datetime.timedelta(seconds=60)
"""How old the kubelet's copy of a ConfigMap may be (``configMapAndSecretChangeDetection``
``Strategy: Cache`` with its default TTL; the ``Watch`` strategy is faster)."""
PUBLISH_INTERVAL: Final = datetime.timedelta(seconds=30)
"""The default round (``$TOKENFAIR_RESYNC_SECONDS``) in which the leader copies a new bundle
into the policies' ConfigMaps (:mod:`.serving_tls`)."""


def trust_settle(publish_interval: datetime.timedelta = PUBLISH_INTERVAL) -> datetime.timedelta:
    """How long a new CA must have been published before a leaf it signs is served: twice the
    worst case of the operator's publishing round, the kubelet's sync period and its cache TTL
    (a margin for a slow API server, a kubelet under load, a little clock skew between
    replicas)."""
    return 2 * (publish_interval + KUBELET_SYNC_PERIOD + KUBELET_CACHE_TTL)


TRUST_SETTLE: Final = trust_settle()
"""5 minutes with the default 30 s round."""
SWITCH_ANYWAY: Final = datetime.timedelta(days=7)
"""A next pair published this long ago is switched to even when the publisher could not
confirm that every ConfigMap holds its CA (one namespace's writes keep failing): the current
leaf must not run into its expiry (``RENEW_BEFORE`` after the rotation began)."""

Reached = Callable[[bytes], datetime.datetime | None]
"""Since when every reader's copy of the bundle holds this CA (the policies' ConfigMaps, as
:class:`.serving_tls.TrustPublisher` saw them); None while one does not, or is not known to."""


@dataclass(frozen=True, slots=True)
class ServingCerts:
    """PEM bytes: the CA certificate, the serving certificate and its private key."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes

    def as_secret_data(self) -> dict[str, bytes]:
        return {CA_KEY: self.ca_pem, CERT_KEY: self.cert_pem, PKEY_KEY: self.key_pem}

    @classmethod
    def from_secret_data(cls, data: Mapping[str, bytes]) -> ServingCerts | None:
        """The three PEMs of a Secret's (decoded) data; None when one is missing or empty."""
        parts = [data.get(key) for key in (CA_KEY, CERT_KEY, PKEY_KEY)]
        if not all(parts):
            return None
        ca, cert, key = (bytes(p or b"") for p in parts)
        return cls(ca, cert, key)


@dataclass(frozen=True, slots=True)
class Rotation:
    """What the Secret holds: the pair served now; during a rotation the next pair and when
    its CA was first published; after one, the previous CA and when it was retired."""

    current: ServingCerts
    next: ServingCerts | None = None
    next_since: datetime.datetime | None = None
    previous_ca: bytes | None = None
    previous_since: datetime.datetime | None = None

    def bundle(self) -> bytes:
        """The CA bundle to publish: the current CA, then the next, then the previous (only
        readable ones besides the current)."""
        parts = [self.current.ca_pem.strip()]
        for extra in (self.next.ca_pem if self.next else None, self.previous_ca):
            if extra is not None and _readable_ca(extra) and extra.strip() not in parts:
                parts.append(extra.strip())
        return b"\n".join(parts) + b"\n"

    def as_secret_data(self) -> dict[str, bytes]:
        data = self.current.as_secret_data()
        if self.next is not None and self.next_since is not None:
            for key, value in self.next.as_secret_data().items():
                data[NEXT_PREFIX + key] = value
            data[NEXT_SINCE_KEY] = _stamp(self.next_since)
        if self.previous_ca is not None and self.previous_since is not None:
            data[PREVIOUS_CA_KEY] = self.previous_ca
            data[PREVIOUS_SINCE_KEY] = _stamp(self.previous_since)
        return data

    @classmethod
    def from_secret_data(cls, data: Mapping[str, bytes]) -> tuple[Rotation | None, list[str]]:
        """The rotation a Secret's (decoded) data holds (None: no current pair) and what in it
        could not be read (left out: a next pair without its time, a previous CA that is no
        certificate)."""
        current = ServingCerts.from_secret_data(data)
        if current is None:
            return None, []
        problems: list[str] = []
        next_pair: ServingCerts | None = None
        next_since: datetime.datetime | None = None
        next_data = {k[len(NEXT_PREFIX) :]: v for k, v in data.items() if k.startswith(NEXT_PREFIX)}
        if any(next_data.values()):
            next_pair = ServingCerts.from_secret_data(next_data)
            next_since = _parse_stamp(data.get(NEXT_SINCE_KEY))
            if next_pair is None:
                problems.append("stored next certificate incomplete")
            elif next_since is None:
                problems.append(f"stored next certificate without a valid {NEXT_SINCE_KEY}")
            if next_pair is None or next_since is None:
                next_pair, next_since = None, None
        previous_ca = data.get(PREVIOUS_CA_KEY) or None
        previous_since = _parse_stamp(data.get(PREVIOUS_SINCE_KEY))
        if previous_ca is not None and (previous_since is None or not _readable_ca(previous_ca)):
            problems.append("stored previous CA unreadable or without a valid time")
            previous_ca, previous_since = None, None
        if previous_ca is None:
            previous_since = None
        return cls(current, next_pair, next_since, previous_ca, previous_since), problems


def _stamp(moment: datetime.datetime) -> bytes:
    return moment.astimezone(datetime.UTC).isoformat().encode()


def _parse_stamp(value: bytes | None) -> datetime.datetime | None:
    """An ISO 8601 time with its zone; None when absent or anything else."""
    if not value:
        return None
    try:
        moment = datetime.datetime.fromisoformat(value.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        return None
    return moment if moment.tzinfo is not None else None


def _readable_ca(pem: bytes) -> bool:
    try:
        x509.load_pem_x509_certificate(pem)
    except ValueError:
        return False
    return True


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def issue(
    dns_names: Sequence[str], now: datetime.datetime, validity: datetime.timedelta = VALIDITY
) -> ServingCerts:
    """A new CA (``tokenfair-webhook-ca``) and a serving certificate for ``dns_names`` (the
    first is the subject's common name), both valid from ``now - CLOCK_SKEW`` to
    ``now + validity``."""
    if not dns_names:
        raise ValueError("a serving certificate needs at least one DNS name")
    start, end = now - CLOCK_SKEW, now + validity
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("tokenfair-webhook-ca")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(signs_certs=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(dns_names[0]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(signs_certs=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return ServingCerts(_pem(ca), _pem(leaf), key_pem)


def _usage(*, signs_certs: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs_certs,
        crl_sign=signs_certs,
        encipher_only=False,
        decipher_only=False,
    )


def due(
    certs: ServingCerts | None,
    dns_names: Sequence[str],
    now: datetime.datetime,
    renew_before: datetime.timedelta = RENEW_BEFORE,
) -> str | None:
    """Why ``certs`` must be replaced at ``now`` (missing or unreadable, other DNS names, not
    yet valid, less than ``renew_before`` left), or None when they can be served."""
    if certs is None:
        return "no certificate stored"
    try:
        leaf = x509.load_pem_x509_certificate(certs.cert_pem)
        x509.load_pem_x509_certificate(certs.ca_pem)
        serialization.load_pem_private_key(certs.key_pem, password=None)
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        return f"stored certificate unreadable: {exc}"
    if sorted(sans.get_values_for_type(x509.DNSName)) != sorted(dns_names):
        return "stored certificate is for other DNS names"
    if now < leaf.not_valid_before_utc:
        return "stored certificate is not valid yet"
    left = leaf.not_valid_after_utc - now
    if left < renew_before:
        return f"stored certificate expires in {left} (renewed {renew_before} before)"
    return None


@dataclass(frozen=True, slots=True)
class Step:
    """One pass of :func:`advance`: the rotation to keep and what changed (empty: nothing)."""

    rotation: Rotation
    events: tuple[str, ...] = ()


def advance(
    stored: Rotation | None,
    dns_names: Sequence[str],
    now: datetime.datetime,
    settle: datetime.timedelta = TRUST_SETTLE,
    renew_before: datetime.timedelta = RENEW_BEFORE,
    reached: Reached | None = None,
) -> Step:
    """The rotation's next state at ``now`` (see the module's docstring for the phases):
    pure but for issuing keys. Anything stored that cannot be used is left out and said in
    the events (a next pair that is unreadable, for other names or stale is issued again).

    ``reached``: when given, the leaf switches ``settle`` after the later of the Secret's
    ``next-published-at`` and the time it says every ConfigMap held the next CA, and not while
    it says None (for :data:`SWITCH_ANYWAY` at most); without it, the Secret's time alone."""
    if stored is None:
        fresh = issue(dns_names, now)
        return Step(Rotation(fresh), ("issued a new certificate: no certificate stored",))
    events: list[str] = []
    current, pending, since = stored.current, stored.next, stored.next_since
    previous, retired = stored.previous_ca, stored.previous_since
    if pending is not None:
        bad = due(pending, dns_names, now, renew_before)
        if bad is None and (since is None or since > now + CLOCK_SKEW):
            bad = f"published at {since}, after now"
        if bad is not None:
            events.append(f"discarded the stored next certificate ({bad.removeprefix('stored ')})")
            pending, since = None, None
    if previous is not None and (retired is None or retired > now + CLOCK_SKEW):
        retired = now  # a time in the future (another clock): counted from now
    if previous is not None and retired is not None and now - retired >= settle:
        events.append("dropped the previous CA from the bundle")
        previous, retired = None, None

    unservable = due(current, dns_names, now, settle)
    why = unservable
    if unservable is None and pending is not None and since is not None:
        held = since if reached is None else reached(pending.ca_pem)
        if held is not None and now - max(since, held) >= settle:
            why = f"its CA published since {max(since, held)}"
        elif now - since >= SWITCH_ANYWAY:
            why = f"its CA published since {since}, not every ConfigMap confirmed to hold it"
    if why is not None:
        old_ca = current.ca_pem if _readable_ca(current.ca_pem) else None
        if pending is not None:
            events.append(f"switched to the next certificate ({why.removeprefix('stored ')})")
            current = pending
        else:
            events.append(f"issued a new certificate at once: {why}")
            current = issue(dns_names, now)
        pending, since = None, None
        if old_ca is not None and old_ca != current.ca_pem:
            previous, retired = old_ca, now
    elif pending is None:
        renewal = due(current, dns_names, now, renew_before)
        if renewal is not None:
            pending, since = issue(dns_names, now), now
            events.append(
                f"published the next CA ({renewal.removeprefix('stored ')}); its certificate is "
                f"served from the first check after {now + settle} at the earliest"
            )
    rotation = Rotation(current, pending, since, previous, retired)
    return Step(rotation, tuple(events))
