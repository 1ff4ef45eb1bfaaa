"""What a test serving on loopback needs, with no cluster and no operator: free TCP ports
(:func:`free_ports`) and a throwaway CA with a serving certificate (:func:`localhost_tls`)."""

from __future__ import annotations

import contextlib
import datetime
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=1)
CLOCK_SKEW = datetime.timedelta(minutes=5)
"""Certificates start this long before now, so a peer whose clock is a little behind takes them."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 right now (the kernel's picks, all held
    open until the last is chosen). A child may still lose one to a race (see
    :data:`kubecluster.START_ATTEMPTS`)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]


@dataclass(frozen=True)
class TLSFiles:
    """PEM files: the CA a client trusts, and the certificate and key a server presents."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def localhost_tls(folder: Path, host: str = "localhost") -> TLSFiles:
    """A new P-256 CA and a serving certificate for DNS name ``host`` signed by it, valid for a
    day, written to ``folder`` as ``ca.pem``, ``cert.pem`` and ``key.pem``."""
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - CLOCK_SKEW, now + VALIDITY
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tokenfair-test-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    ca_ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(folder / "ca.pem", folder / "cert.pem", folder / "key.pem")
    files.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files.cert_file.write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    files.key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return files
