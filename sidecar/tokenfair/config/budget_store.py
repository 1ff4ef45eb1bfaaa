"""The budget store section of the config contract: pool-wide budgets shared through Redis.

Without a store every sidecar enforces its own bucket, so each of ``n`` ready replicas holds
``1/n`` of a tenant's budgets (:func:`split_budgets`, the one home of that rule; the operator
renders it). With a store (``budgetStore:`` in a ``TokenfairConfig`` document, or
``spec.budgetStore`` of a ``SchedulingPolicy`` manifest) the tenants' budgets in the document
are the **pool's**: the sidecars lease them in chunks from one shared bucket per tenant
(:mod:`tokenfair.server.pool`), and fall back to the ``1/replicas`` split while the
store is unreachable. YAML (camelCase, every field but ``redis.url`` optional)::

    budgetStore:
      redis:
        url: redis://redis.tokenfair.svc:6379/0   # redis:// or rediss://
        passwordEnv: TOKENFAIR_BUDGET_STORE_PASSWORD  # env var holding the password, if any
      keyPrefix: tokenfair           # keys are <keyPrefix>:<tenantId>
      replicas: 1                    # sidecars sharing the store: the fallback split is 1/replicas
      leaseMs: 500                   # a lease chunk is leaseMs of the pool's sustained rate
      timeoutMs: 250                 # a store call slower than this falls back
      probeIntervalMs: 1000          # while fallen back, how often the store is tried again
      fairness: true                 # pool-wide fair shares through the same store
      fairnessSyncMs: 500            # a replica's service counters are sent at least this often
      fairnessLeaseServiceTokens: 20000  # ... and once it gave this many service tokens

``secretRef`` (under ``redis``) is the operator's: it turns into ``passwordEnv`` in the pod.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Final, Protocol, TypeVar, cast

from tokenfair.config.fields import (
    ConfigError,
    FieldTable,
    boolean,
    integer_in,
    number_in,
    read_fields,
    shown,
    unknown_keys,
)


class TenantBudgets(Protocol):
    """What this module reads of a tenant (a :class:`tokenfair.config.TenantConfig`): its two
    budgets. A protocol, so that the section does not import the document module, which
    imports it (one direction: ``document`` -> ``budget_store`` -> ``fields``)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]

    @property
    def burst_service_tokens(self) -> int: ...

    @property
    def sustained_service_tokens_per_second(self) -> float: ...


Tenant = TypeVar("Tenant", bound=TenantBudgets)

DEFAULT_KEY_PREFIX: Final = "tokenfair"
MAX_LEASE_MS: Final = 60_000
MAX_TIMEOUT_MS: Final = 10_000
MAX_PROBE_INTERVAL_MS: Final = 600_000
MAX_REPLICAS: Final = 10_000
MAX_FAIRNESS_SYNC_MS: Final = 60_000
MAX_FAIRNESS_LEASE_TOKENS: Final = 1_000_000_000
_URL: Final = re.compile(r"^rediss?://[^\s]+$")
_ENV_NAME: Final = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_KEY_PREFIX: Final = re.compile(r"^[A-Za-z0-9_.:/{}-]{1,200}$")
_OPERATOR_ONLY_REDIS_FIELDS: Final = frozenset({"secretRef"})


@dataclass(frozen=True, slots=True)
class BudgetStoreConfig:
    """Where the pool's shared buckets live and how sidecars lease from them."""

    url: str
    """``redis://[user@]host:port/db`` or ``rediss://`` (TLS); no password in it."""
    password_env: str | None = None
    """Name of the environment variable holding the password (never the password itself)."""
    key_prefix: str = DEFAULT_KEY_PREFIX
    """Each tenant's shared bucket is the hash ``<key_prefix>:<tenant_id>``; the operator writes
    ``tokenfair:<namespace>:<policy>`` so policies never share a bucket."""
    replicas: int = 1
    """Sidecars sharing the store. While the store is unreachable each enforces
    ``1/replicas`` of every budget (:func:`split_budgets`), as without a store."""
    lease_ms: float = 500.0
    """A lease chunk is ``ceil(sustained_per_second * lease_ms / 1000)`` service tokens, at most
    half the burst (so the shared bucket is never full while a sidecar waits for a chunk: a full
    bucket stops refilling). Larger: fewer store calls per request (about ``request cost /
    chunk``); smaller: a smaller overshoot bound (about ``replicas`` chunks, see
    :mod:`tokenfair.server.pool`). 500 ms keeps both under the targets for requests
    of a few hundred service tokens or more."""
    timeout_ms: float = 250.0
    """A store call that has not answered in this long fails, and the sidecar falls back to the
    local split at once: the fallback starts within ``timeout_ms`` of the store going quiet."""
    probe_interval_ms: float = 1000.0
    """While fallen back, the store is tried again this often (real milliseconds)."""
    fairness: bool = True
    """Pool-wide fair shares (:mod:`tokenfair.server.pool_fairness`, docs/fairness.md §9): each
    sidecar's DRR orders its tenants by the weighted service the whole pool gave them. False:
    each sidecar is fair on its own traffic only, as without a store."""
    fairness_sync_ms: float = 500.0
    """A sidecar sends its batch of service counters (and reads the others') at least this
    often while it has service to send or two tenants of a lane to order (model ms, like
    ``lease_ms``: real ms at the sidecar's default ``--time-scale 1``)."""
    fairness_lease_tokens: int = 20_000
    """... and as soon as it gave this many service tokens since its last batch: the ``L`` of
    the pool-wide bound (docs/fairness.md §9.2; smaller: a tighter bound, more store calls,
    about ``request cost / L`` per request)."""

    def lease_tokens(self, tenant: TenantBudgets) -> int:
        """Chunk of one lease: ``max(1, min(burst // 2, ceil(sustained * lease_ms / 1000)))``."""
        chunk = -(-tenant.sustained_service_tokens_per_second * self.lease_ms // 1000)
        return max(1, min(tenant.burst_service_tokens // 2, int(chunk)))


def split_budgets(tenant: Tenant, replicas: int) -> Tenant:
    """One replica's share of ``tenant``'s budgets when each of ``replicas`` sidecars enforces
    its own bucket (weight and keys unchanged):

    * burst per replica ``= max(1, floor(burst / n))`` service tokens (integers; rounding down
      keeps ``n * per_replica <= burst`` except when ``burst < n``, where each still needs 1);
    * sustained per replica ``= sustained / n`` service tokens per second.

    ``replicas < 1`` counts as 1."""
    n = max(1, replicas)
    return dataclasses.replace(
        tenant,
        burst_service_tokens=max(1, tenant.burst_service_tokens // n),
        sustained_service_tokens_per_second=tenant.sustained_service_tokens_per_second / n,
    )


def _mapping(where: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where}: must be a mapping (got {shown(value)})")
    return cast(Mapping[str, object], value)


def _key_prefix(name: str, value: object) -> str:
    if not isinstance(value, str) or not _KEY_PREFIX.match(value):
        raise ConfigError(
            f"{name}: must be 1-200 characters of letters, digits and _.:/{{}}- "
            f"(got {shown(value)})"
        )
    return value


_FIELDS: Final[FieldTable] = {
    "keyPrefix": ("key_prefix", _key_prefix),
    "replicas": ("replicas", integer_in(1, MAX_REPLICAS)),
    "leaseMs": ("lease_ms", number_in(1, MAX_LEASE_MS)),
    "timeoutMs": ("timeout_ms", number_in(1, MAX_TIMEOUT_MS)),
    "probeIntervalMs": ("probe_interval_ms", number_in(1, MAX_PROBE_INTERVAL_MS)),
    "fairness": ("fairness", boolean),
    "fairnessSyncMs": ("fairness_sync_ms", number_in(1, MAX_FAIRNESS_SYNC_MS)),
    "fairnessLeaseServiceTokens": (
        "fairness_lease_tokens",
        integer_in(1, MAX_FAIRNESS_LEASE_TOKENS),
    ),
}
"""``budgetStore:`` key -> (attribute, parser), ``redis`` aside (nested, required)."""


def parse_budget_store(data: object, where: str = "budgetStore") -> BudgetStoreConfig:
    """Build a :class:`BudgetStoreConfig` from its camelCase YAML; bad input raises
    :class:`ConfigError` naming the field and the rule."""
    doc = _mapping(where, data)
    unknown_keys(where, doc, [*_FIELDS, "redis"])
    if "redis" not in doc:
        raise ConfigError(f"{where}: missing required field redis (the only store kind)")
    redis = _mapping(f"{where}.redis", doc["redis"])
    unknown_keys(f"{where}.redis", redis, {"url", "passwordEnv", *_OPERATOR_ONLY_REDIS_FIELDS})
    url = redis.get("url")
    if not isinstance(url, str) or not _URL.match(url):
        raise ConfigError(
            f"{where}.redis.url: must be a redis:// or rediss:// URL (got {shown(url)})"
        )
    userinfo = url.split("://", 1)[1].split("/", 1)[0].rpartition("@")[0]
    if ":" in userinfo:  # user:password@host: a secret would land in a ConfigMap
        raise ConfigError(
            f"{where}.redis.url: must not hold a password (use passwordEnv or secretRef)"
        )
    password_env = redis.get("passwordEnv")
    if password_env is not None and (
        not isinstance(password_env, str) or not _ENV_NAME.match(password_env)
    ):
        raise ConfigError(
            f"{where}.redis.passwordEnv: must be an environment variable name "
            f"(got {shown(password_env)})"
        )
    values = read_fields(where, doc, _FIELDS, also=["redis"])
    return BudgetStoreConfig(url=url, password_env=password_env, **values)


def budget_store_to_dict(store: BudgetStoreConfig) -> dict[str, object]:
    """camelCase mapping that :func:`parse_budget_store` reads back."""
    redis: dict[str, object] = {"url": store.url}
    if store.password_env is not None:
        redis["passwordEnv"] = store.password_env
    return {
        "redis": redis,
        "keyPrefix": store.key_prefix,
        "replicas": store.replicas,
        "leaseMs": store.lease_ms,
        "timeoutMs": store.timeout_ms,
        "probeIntervalMs": store.probe_interval_ms,
        "fairness": store.fairness,
        "fairnessSyncMs": store.fairness_sync_ms,
        "fairnessLeaseServiceTokens": store.fairness_lease_tokens,
    }
