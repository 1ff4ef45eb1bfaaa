"""tokenfair operator: TenantQuota and SchedulingPolicy objects -> the sidecars' config document.

The Kopf handlers live in :mod:`tokenfair_operator.handlers` (``kopf run -m
tokenfair_operator.handlers``); importing this package does not register them. The pure parts
below are what tests and other tools call directly.

Of the sidecar's package the operator imports the config contract only (``tokenfair.config``:
the document, its value rules, and in ``tokenfair.config.wire`` the names both sides of the
config feed use); tests/test_layout.py refuses any other ``tokenfair.*`` import.

It speaks to the API server through three clients, each for what the others cannot do (issue
31 asks for one or a reason for each; these are the reasons, and merging them is future work):

* **Kopf's own** (aiohttp, inside the framework): the watches and listings, the handlers'
  progress annotations, the Events it posts (:mod:`.events`). Kopf owns these streams and their
  retries; nothing of ours replaces them without replacing Kopf.
* **the** ``kubernetes`` **client** (:mod:`.kube`, :mod:`.leader`, :mod:`.serve`,
  :mod:`.serving_tls`, :mod:`.webhook_certs`), blocking, in worker threads: every write
  (conditional on ``resourceVersion``, after the leadership check), status patches, Leases,
  TokenReviews, the admission-time reads, and the configuration itself (kubeconfig or in-cluster
  credentials, their refresh). Kopf's client is not a public API, and its calls run on the event
  loop, where a write's wait would hold every handler.
* **a lean GET path** (:mod:`.leanhttp`), for key Secret reads in bulk only: pipelined keep-alive
  GETs over a raw socket, configured from the ``kubernetes`` client's configuration (its server,
  CA, client certificate, auth headers). Measured on the test control plane: ~0.05 ms of the
  operator's CPU per read against ~0.5 ms through the client (docs/operator.md), which is what
  a first pass over 10,000 TenantQuotas needs. A configuration it does not cover (a proxy, a
  TLS server-name override) gets none, and the reads go through the ``kubernetes`` client.
"""

from .budgets import split_budgets
from .conditions import Check, conditions_for
from .model import PolicyView, QuotaView, configmap_name, secret_name
from .render import KeyProblem, Rendering, Verdict, render_config
from .status import policy_status, quota_status

__all__ = [
    "Check",
    "KeyProblem",
    "PolicyView",
    "QuotaView",
    "Rendering",
    "Verdict",
    "conditions_for",
    "configmap_name",
    "policy_status",
    "quota_status",
    "render_config",
    "secret_name",
    "split_budgets",
]
