"""tokenfair: fair admission and scheduling for a shared LLM inference service, in service tokens.

Packages, each importing only those above it in this list, ``loadgen`` and ``server`` not each
other (tests/test_layout.py checks):

* :mod:`tokenfair.config` — the config contract (policy, tenants, budget store), shared with the
  operator (``tokenfair_operator``), which renders documents with it;
* :mod:`tokenfair.core` — the scheduling core: pure, synchronous, time injected; no asyncio;
* :mod:`tokenfair.records` — the record format (schemas, decoders, the one encoder), the contract
  between the writers of records (``sim``, ``server``, ``loadgen``) and their readers;
* :mod:`tokenfair.sim` — replay on a virtual clock, trace formats, reports, fairness;
* :mod:`tokenfair.loadgen` — a client that replays a workload against a live endpoint;
* :mod:`tokenfair.server` — the sidecar process (aiohttp proxy, dispatcher, backends);
* :mod:`tokenfair.cli` and :mod:`tokenfair.commands` — the ``tokenfair`` command, one module per
  subcommand, imported only by ``cli``.
"""

from tokenfair import native as _native

# Before any module of the core is imported: the compiled core if a fresh build is there
# (tokenfair/native.py), else the interpreted one.
_native.activate()
