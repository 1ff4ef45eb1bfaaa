#!/usr/bin/env python3
"""The test node's cluster DNS: A records of Services, the part of CoreDNS a chart needs.

The node (tests/kubenode.py, docs/node.md) has no CoreDNS image, yet Pods name Services
(``helm test`` calls ``http://<release>-tokenfair-operator:8080``). This answers, over UDP:

- ``<service>.<namespace>.svc.<domain>`` type A (1) or ANY (255): the Service's ClusterIP,
  TTL ``TTL_S``; a headless Service (``clusterIP: None``) gets its ready endpoints' addresses.
- the same name with any other type (AAAA from dual-stack resolvers): NOERROR, no answer;
- any other name: NXDOMAIN (nothing is forwarded: test Pods need no outside names).

Services and endpoints are listed from the API server at most every ``REFRESH_S`` seconds, on
demand. Standard library only; run by the node fixture as its own process:

    clusterdns.py --listen 10.213.0.1:53 --server https://HOST:PORT --ca CA --token-file FILE
"""

from __future__ import annotations

import argparse
import json
import socket
import ssl
import struct
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

TTL_S = 5
REFRESH_S = 1.0
TYPE_A, TYPE_ANY = 1, 255
RCODE_NXDOMAIN = 3


class Records:
    """Service name -> IPv4 addresses, refreshed from the API server when older than REFRESH_S."""

    def __init__(self, server: str, ca: Path, token: str, domain: str) -> None:
        self.server, self.token, self.domain = server, token, domain
        self.context = ssl.create_default_context(cafile=str(ca))
        self.opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=self.context))
        self.names: dict[str, list[str]] = {}
        self.fetched_at = float("-inf")

    def _items(self, path: str) -> list[dict[str, Any]]:
        """The ``items`` of a list call."""
        req = urllib.request.Request(
            self.server + path, headers={"Authorization": f"Bearer {self.token}"}
        )
        with self.opener.open(req, timeout=5) as resp:
            body = json.loads(resp.read())
        items: list[dict[str, Any]] = body["items"]
        return items

    def refresh(self) -> None:
        if time.monotonic() - self.fetched_at < REFRESH_S:
            return
        names: dict[str, list[str]] = {}
        services = self._items("/api/v1/services")
        endpoints = {
            (e["metadata"]["namespace"], e["metadata"]["name"]): e
            for e in self._items("/api/v1/endpoints")
        }
        for svc in services:
            meta, spec = svc["metadata"], svc["spec"]
            name = f"{meta['name']}.{meta['namespace']}.svc.{self.domain}".lower()
            ip = spec.get("clusterIP")
            if ip and ip != "None":
                names[name] = [ip]
            else:
                ep = endpoints.get((meta["namespace"], meta["name"]), {})
                names[name] = [
                    a["ip"] for s in ep.get("subsets", []) for a in s.get("addresses", [])
                ]
        self.names, self.fetched_at = names, time.monotonic()


def parse_question(packet: bytes) -> tuple[int, int, str, int, bytes]:
    """(id, flags, lower-case name, qtype, raw question) of a one-question query."""
    ident, flags, qdcount = struct.unpack("!HHH", packet[:6])
    if qdcount != 1:
        raise ValueError(f"qdcount {qdcount}, expected 1")
    labels, offset = [], 12
    while (length := packet[offset]) != 0:
        if length & 0xC0:
            raise ValueError("compressed name in a question")
        labels.append(packet[offset + 1 : offset + 1 + length].decode("ascii", "replace"))
        offset += 1 + length
    qtype = struct.unpack("!H", packet[offset + 1 : offset + 3])[0]
    return ident, flags, ".".join(labels).lower(), qtype, packet[12 : offset + 5]


def answer(packet: bytes, records: Records) -> bytes:
    ident, flags, name, qtype, question = parse_question(packet)
    rd = flags & 0x0100
    if name.endswith(f".svc.{records.domain}"):
        try:
            records.refresh()
        except OSError as err:
            print(f"clusterdns: listing services failed: {err}", file=sys.stderr, flush=True)
    ips = records.names.get(name)
    if ips is None:
        header = struct.pack("!HHHHHH", ident, 0x8080 | rd | RCODE_NXDOMAIN, 1, 0, 0, 0)
        return header + question
    answers = [] if qtype not in (TYPE_A, TYPE_ANY) else ips
    header = struct.pack("!HHHHHH", ident, 0x8480 | rd, 1, len(answers), 0, 0)
    body = b"".join(
        struct.pack("!HHHIH", 0xC00C, TYPE_A, 1, TTL_S, 4) + socket.inet_aton(ip) for ip in answers
    )
    return header + question + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--listen", required=True, help="IP:PORT to serve UDP DNS on")
    parser.add_argument("--server", required=True, help="API server URL")
    parser.add_argument("--ca", required=True, type=Path, help="CA file of the API server")
    parser.add_argument("--token-file", required=True, type=Path, help="bearer token file")
    parser.add_argument("--domain", default="cluster.local", help="cluster domain")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    records = Records(args.server, args.ca, args.token_file.read_text().strip(), args.domain)
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((host, int(port)))
    print(f"clusterdns: serving {args.listen}", flush=True)
    while True:
        packet, peer = sock.recvfrom(4096)
        try:
            sock.sendto(answer(packet, records), peer)
        except (ValueError, IndexError, struct.error) as err:
            print(f"clusterdns: bad query from {peer}: {err}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
