"""The webhook's own certificates, when no cert-manager issues them (pure: no API, no files).

:func:`issue` makes a fresh CA and a serving certificate it signs, for the webhook Service's DNS
names; :func:`due` says when a stored pair must be replaced. Both are ECDSA P-256. The CA's
private key is thrown away once the leaf is signed: a rotation issues a new CA and a new leaf
together, and the webhook configurations trust the new CA and the previous one
(:func:`ca_bundle`) until the next rotation, so no request fails while the server switches.

Defaults: valid 90 days (``VALIDITY``), replaced once less than 30 days remain
(``RENEW_BEFORE``); the operator checks every hour, so a certificate is never served in its last
29 days.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
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


def ca_bundle(current: ServingCerts, previous: ServingCerts | None) -> bytes:
    """The caBundle for the webhook configurations: the current CA, then the previous one (so
    a server still presenting the old leaf stays trusted until it reloads)."""
    if previous is None or previous.ca_pem == current.ca_pem:
        return current.ca_pem
    try:
        x509.load_pem_x509_certificate(previous.ca_pem)
    except ValueError:
        return current.ca_pem  # never put something unreadable into the API server's bundle
    return current.ca_pem + previous.ca_pem.strip() + b"\n"
