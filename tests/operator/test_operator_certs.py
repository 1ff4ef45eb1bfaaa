"""The operator's own webhook certificates (``tokenfair_operator.certs``), pure parts.

Behaviours under test, each certificate checked by a real TLS handshake (Python's ``ssl``, in
memory) rather than by reading its fields back:

- :func:`issue` makes a CA and a serving certificate that a client trusting only that CA
  accepts for each of the DNS names, and refuses for another name or under another CA;
- :func:`due` accepts a fresh pair and asks for a new one when none is stored, it is
  unreadable, its DNS names differ, or less than ``RENEW_BEFORE`` is left (the boundary to the
  second);
- ``Rotation.bundle`` after a rotation trusts servers with the old and the new certificate, and
  leaves out a previous CA it cannot read;
- ``ServingCerts`` round-trips through a Secret's data and reads an incomplete one as None.
"""

from __future__ import annotations

import datetime
import ssl

import pytest
from certs_support import server_context

from tokenfair_operator.certs import (
    RENEW_BEFORE,
    VALIDITY,
    Rotation,
    ServingCerts,
    due,
    issue,
)

NOW = datetime.datetime(2026, 11, 29, 12, 0, tzinfo=datetime.UTC)
# A handshake checks validity against the real clock, so certificates that meet one are
# issued from the clock, not from the fixed NOW (which would expire under the tests one day).
CLOCK_NOW = datetime.datetime.now(datetime.UTC)
NAMES = ("tokenfair-operator", "tokenfair-operator.tf.svc")


def handshake(server: ServingCerts, ca_pem: bytes, hostname: str) -> None:
    """A full TLS handshake between a server presenting ``server``'s certificate and a client
    that trusts only ``ca_pem`` and checks ``hostname``; raises ``ssl.SSLError`` on refusal.
    Memory BIOs carry the bytes (no sockets), the TLS itself is OpenSSL's."""
    client_ctx = ssl.create_default_context(cadata=ca_pem.decode())
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(to_client, to_server, server_hostname=hostname)
    srv = server_context(server).wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for name, end in (("client", client), ("server", srv)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(to_server.read())
        to_client.write(s_out.read())
        if all(done.values()):
            return
    raise AssertionError("handshake did not finish")


def test_issued_certificate_is_trusted_for_each_name_under_its_ca_only() -> None:
    certs = issue(NAMES, CLOCK_NOW)
    for name in NAMES:
        handshake(certs, certs.ca_pem, name)
    with pytest.raises(ssl.SSLCertVerificationError, match="Hostname mismatch"):
        handshake(certs, certs.ca_pem, "somewhere-else.svc")
    other = issue(NAMES, CLOCK_NOW)
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer"):
        handshake(certs, other.ca_pem, NAMES[0])


def test_issue_needs_a_name() -> None:
    with pytest.raises(ValueError, match="at least one DNS name"):
        issue((), NOW)


def test_due_says_when_to_replace() -> None:
    certs = issue(NAMES, NOW)
    assert due(certs, NAMES, NOW) is None
    assert due(certs, tuple(reversed(NAMES)), NOW) is None  # the order of names is free
    assert due(None, NAMES, NOW) == "no certificate stored"
    assert due(certs, NAMES[:1], NOW) == "stored certificate is for other DNS names"
    garbage = ServingCerts(certs.ca_pem, b"not a certificate", certs.key_pem)
    assert (due(garbage, NAMES, NOW) or "").startswith("stored certificate unreadable")
    # Valid until NOW + VALIDITY; replaced once less than RENEW_BEFORE is left, i.e. from
    # NOW + 90 d - 30 d = NOW + 60 d on (to the second: X.509 times have whole seconds).
    last_quiet = NOW + VALIDITY - RENEW_BEFORE
    assert due(certs, NAMES, last_quiet) is None
    reason = due(certs, NAMES, last_quiet + datetime.timedelta(seconds=1))
    assert reason is not None
    assert "expires in 29 days, 23:59:59" in reason
    # Issued with 5 minutes' allowance for a slower clock, not more.
    assert due(certs, NAMES, NOW - datetime.timedelta(minutes=5)) is None
    early = due(certs, NAMES, NOW - datetime.timedelta(minutes=5, seconds=1))
    assert early == "stored certificate is not valid yet"


def test_bundle_after_rotation_trusts_old_and_new_servers() -> None:
    old, new = issue(NAMES, CLOCK_NOW), issue(NAMES, CLOCK_NOW)
    bundle = Rotation(new, previous_ca=old.ca_pem, previous_since=NOW).bundle()
    handshake(old, bundle, NAMES[0])
    handshake(new, bundle, NAMES[0])
    assert Rotation(new).bundle() == new.ca_pem
    assert Rotation(new, previous_ca=new.ca_pem, previous_since=NOW).bundle() == new.ca_pem
    assert Rotation(new, previous_ca=b"junk", previous_since=NOW).bundle() == new.ca_pem


def test_secret_data_round_trip() -> None:
    certs = issue(NAMES, NOW)
    data = certs.as_secret_data()
    assert sorted(data) == ["ca.crt", "tls.crt", "tls.key"]
    assert ServingCerts.from_secret_data(data) == certs
    assert ServingCerts.from_secret_data({**data, "tls.key": b""}) is None
    assert ServingCerts.from_secret_data({}) is None
