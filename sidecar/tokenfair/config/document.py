"""The config contract: typed, frozen scheduling policy and tenants, loaded from YAML.

The sidecar owns this schema; the operator renders documents with the same code, so the rules live
in one place. Two YAML shapes are read, alone or mixed in one multi-document file:

* a **config document** ``kind: TokenfairConfig`` with ``policy:`` and ``tenants:`` sections;
* plain **manifests** — ``kind: TenantQuota`` (one tenant each) and at most one
  ``kind: SchedulingPolicy`` — exactly the YAML a user would ``kubectl apply``.

YAML names are camelCase (as the CRDs name them); Python attributes are snake_case with units.
Every default below is the reference lesson's value. Bad input raises :class:`ConfigError`
naming the field and the rule it broke.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal, cast

import yaml

from tokenfair.config.budget_store import (
    BudgetStoreConfig,
    budget_store_to_dict,
    parse_budget_store,
)
from tokenfair.config.fields import (
    ConfigError,
    Parser,
    boolean,
    integer_in,
    non_negative,
    number_in,
    one_of,
    positive,
    positive_int,
    ratio,
    read_fields,
    share,
    shown,
    unknown_keys,
)
from tokenfair.config.files import InputFileError, read_regular

API_VERSION: Final = "tokenfair.io/v1alpha1"
CONFIG_KIND: Final = "TokenfairConfig"
TENANT_KIND: Final = "TenantQuota"
POLICY_KIND: Final = "SchedulingPolicy"
_KINDS: Final = (CONFIG_KIND, TENANT_KIND, POLICY_KIND)

PriorityClass = Literal["interactive", "batch"]
PRIORITY_CLASSES: Final[tuple[PriorityClass, ...]] = ("interactive", "batch")

Enforcement = Literal["Enforce", "Shadow"]
ENFORCEMENTS: Final[tuple[Enforcement, ...]] = ("Enforce", "Shadow")
"""``enforcement`` of a policy or a tenant: ``Enforce`` refuses what the gates refuse;
``Shadow`` makes and records every decision (``would_refuse``) and serves the request anyway
(docs/sidecar.md, "Shadow mode")."""

MAX_BATCH_REQUESTS: Final = 65_536
"""Largest ``maxBatchRequests`` (and ``batchThroughputGain``): far above any engine's batch."""
MAX_CONCURRENT_REQUESTS: Final = 1_000_000
"""Largest ``maxConcurrentRequests`` of a tenant (the CRD's bound too)."""

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Scheduling policy parameters (one per pool of sidecars).

    Service tokens: ``prefill + decode_weight * decode`` (rounded up to an integer).
    """

    total_kv_blocks: int = 1600
    """KV-cache capacity of one model server, in blocks."""
    kv_block_tokens: int = 16
    """Tokens per KV block; a request holds ``ceil((prefill + decode) / kv_block_tokens)``."""
    interactive_kv_watermark: float = 0.90
    """Highest KV occupancy (0..1] an interactive request may bring the cache to."""
    batch_kv_watermark: float = 0.65
    """Highest KV occupancy a batch request may bring the cache to; <= interactive's."""
    max_interactive_wait_ms: float = 420.0
    """Queue-wait SLO of the interactive lane: predicted waits above it are shed."""
    max_batch_wait_ms: float = 3500.0
    """Queue-wait SLO of the batch lane."""
    decode_weight: float = 4.0
    """Cost of one decoded token in prefill-token units (decode is dearer)."""
    base_quantum_tokens: int = 1200
    """DRR quantum per round for weight 1.0, in service tokens (quantum = base * weight)."""
    service_tokens_per_ms: float = 45.0
    """Service rate of one model server (its throughput at its full batch, ``X(S)``), used to
    predict queue waits and execution time."""
    max_batch_requests: int = 1
    """Batching engine model (:mod:`tokenfair.core.batching`): the most requests the engine runs
    at once, ``S`` (vLLM's ``--max-num-seqs``, or fewer if the sidecar may send fewer). 1 is
    the lesson's serial server: one request at a time at ``serviceTokensPerMs``."""
    batch_throughput_gain: float = 1.0
    """Batching engine model: how many times the service tokens per ms of one request running
    alone the engine delivers with ``S`` running, ``G = X(S) / X(1)`` in ``[1, S]``. 1: the
    batch shares one throughput (each of ``c`` requests runs at ``R / c``); ``S``: throughput
    grows linearly with the batch. ``tokenfair calibrate`` fits it from records taken under
    load."""
    batch_min_share: float = 0.10
    """Share of service (0..0.5] the batch lane is guaranteed under interactive overload
    (``tokenfair`` policy only; the lesson's policies have strict priority)."""
    batch_rate_margin_sigmas: float = 1.0
    """The batch lane's admission reads the interactive demand this many standard deviations
    above its recent average (the spread of the interactive work that may arrive within
    ``maxBatchWaitMs``, from the recent requests' sizes; ``tokenfair`` policy only, docs/
    fairness.md §5.5). Higher: fewer admitted batch requests expire in the queue and more are
    refused at the door; 0: the average alone."""
    lend_idle_capacity: bool = False
    """Let a tenant over its token budget use capacity nobody within budget is waiting for
    (``tokenfair`` policy only). Off by default: budgets are caps a platform sells, and a
    tenant that learns to rely on idle capacity is surprised when the neighbours come back.
    Lent capacity is reclaimed at the next dispatch (within-budget work always goes first)
    and is not charged to the borrower's bucket."""
    max_queued_requests: int = 10_000
    """Bound on queued requests of all tenants together; beyond it: ``queue_full``."""
    max_queued_requests_per_tenant: int = 2_000
    """Bound on one tenant's queued requests; beyond it: ``queue_full``."""
    prefill_floor_ms: float = 8.0
    """Cost model: the shortest prefill (time to first token once running)."""
    prefill_tokens_per_ms: float = 48.0
    """Cost model: prefill speed; prefill time is ``max(floor, prefill / speed)``."""
    kv_residency_factor: float = 5.5
    """Cost model: KV blocks stay resident ``factor * execution time`` after dispatch."""
    enforcement: Enforcement = "Enforce"
    """``Shadow``: every refusal is decided and recorded (``would_refuse``) but the request is
    served beside the policy's books; a tenant's own ``enforcement`` overrides it."""


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant's quota (a ``TenantQuota``)."""

    tenant_id: str
    weight: float
    """DRR weight within the tenant's lane (relative share of service)."""
    burst_service_tokens: int
    """Token-bucket capacity: the most service a tenant can take at once."""
    sustained_service_tokens_per_second: float
    """Token-bucket refill rate."""
    priority_class: PriorityClass = "interactive"
    api_key_sha256: tuple[str, ...] = ()
    """Lower-case hex SHA-256 digests of the tenant's API keys (never the keys)."""
    enforcement: Enforcement | None = None
    """The tenant's own ``Enforce`` or ``Shadow``; None: the policy's."""
    max_concurrent_requests: int | None = None
    """Most requests of the tenant running at once (``tokenfair`` holds the rest queued); None:
    no limit."""
    max_kv_share: float | None = None
    """Most of the pool's KV blocks (``totalKvBlocks``) the tenant's running requests may hold,
    as a fraction in (0, 1] (``tokenfair`` holds the rest queued); None: no limit."""


@dataclass(frozen=True, slots=True)
class Config:
    """A whole setup: the policy and its tenants (order = DRR visiting order)."""

    policy: PolicyConfig
    tenants: tuple[TenantConfig, ...]
    version: str = ""
    """Free-form version of the document (the operator writes a content hash)."""
    budget_store: BudgetStoreConfig | None = None
    """Pool-wide budgets through a shared store (:mod:`tokenfair.config.budget_store`); None:
    each sidecar enforces the budgets in this document on its own."""
    tenant_index: Mapping[str, TenantConfig] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tenant_index", {t.tenant_id: t for t in self.tenants})

    def tenant(self, tenant_id: str) -> TenantConfig:
        return self.tenant_index[tenant_id]


# ---------------------------------------------------------------------------------------------
# Field tables: YAML name -> (attribute, parser). One table drives parsing, validation, `--set`;
# the parsers and the reader are tokenfair.config.fields' (one rule each, integers included).


def _tenant_id(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{name}: must be a non-empty string (got {shown(value)})")
    if value != value.strip():
        raise ConfigError(f"{name}: must not start or end with white space (got {shown(value)})")
    return value


_priority_class: Final = one_of(PRIORITY_CLASSES)


def _priority(name: str, value: object) -> PriorityClass:
    return cast(PriorityClass, _priority_class(name, value))


_enforcement_value: Final = one_of(ENFORCEMENTS)


def _enforcement(name: str, value: object) -> Enforcement:
    return cast(Enforcement, _enforcement_value(name, value))


def api_key_digest(api_key: str) -> str:
    """The digest ``apiKeySha256`` holds for an API key, and the one a presented key is compared
    by: lower-case hex SHA-256 of the key's UTF-8 bytes, white space around it removed (a key
    read from a file or a Secret often ends in a newline: ``kubectl create secret --from-file``
    keeps it; an ``Authorization`` header's value is trimmed the same way). For a key without
    such white space it is ``printf %s "$KEY" | sha256sum``. One home for the operator's render
    and the sidecar's check. Raises ``UnicodeEncodeError`` for text that is no key (lone
    surrogates: header bytes that were not UTF-8)."""
    return hashlib.sha256(api_key.strip().encode("utf-8")).hexdigest()


def _key_hashes(name: str, value: object) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{name}: must be a list of SHA-256 hex digests (got {shown(value)})")
    for i, digest in enumerate(value):
        if not isinstance(digest, str) or not _SHA256_HEX.match(digest):
            raise ConfigError(f"{name}[{i}]: must be 64 lower-case hex characters")
    return tuple(value)


POLICY_FIELDS: Final[dict[str, tuple[str, Parser]]] = {
    "totalKvBlocks": ("total_kv_blocks", positive_int),
    "kvBlockTokens": ("kv_block_tokens", positive_int),
    "interactiveKvWatermark": ("interactive_kv_watermark", ratio),
    "batchKvWatermark": ("batch_kv_watermark", ratio),
    "maxInteractiveWaitMs": ("max_interactive_wait_ms", positive),
    "maxBatchWaitMs": ("max_batch_wait_ms", positive),
    "decodeWeight": ("decode_weight", positive),
    "baseQuantumTokens": ("base_quantum_tokens", positive_int),
    "serviceTokensPerMs": ("service_tokens_per_ms", positive),
    "maxBatchRequests": ("max_batch_requests", integer_in(1, MAX_BATCH_REQUESTS)),
    "batchThroughputGain": ("batch_throughput_gain", number_in(1.0, MAX_BATCH_REQUESTS)),
    "batchMinShare": ("batch_min_share", share),
    "batchRateMarginSigmas": ("batch_rate_margin_sigmas", number_in(0.0, 4.0)),
    "lendIdleCapacity": ("lend_idle_capacity", boolean),
    "maxQueuedRequests": ("max_queued_requests", positive_int),
    "maxQueuedRequestsPerTenant": ("max_queued_requests_per_tenant", positive_int),
    "prefillFloorMs": ("prefill_floor_ms", non_negative),
    "prefillTokensPerMs": ("prefill_tokens_per_ms", positive),
    "kvResidencyFactor": ("kv_residency_factor", positive),
    "enforcement": ("enforcement", _enforcement),
}

TENANT_FIELDS: Final[dict[str, tuple[str, Parser]]] = {
    "tenantId": ("tenant_id", _tenant_id),
    "weight": ("weight", positive),
    "burstServiceTokens": ("burst_service_tokens", positive_int),
    "sustainedServiceTokensPerSecond": ("sustained_service_tokens_per_second", positive),
    "priorityClass": ("priority_class", _priority),
    "apiKeySha256": ("api_key_sha256", _key_hashes),
    "enforcement": ("enforcement", _enforcement),
    "maxConcurrentRequests": ("max_concurrent_requests", integer_in(1, MAX_CONCURRENT_REQUESTS)),
    "maxKvShare": ("max_kv_share", ratio),
}
_REQUIRED_TENANT_FIELDS: Final = (
    "weight",
    "burstServiceTokens",
    "sustainedServiceTokensPerSecond",
)
# CRD fields the operator resolves; a standalone sidecar accepts and ignores them.
_OPERATOR_ONLY_TENANT_FIELDS: Final = frozenset({"policyName", "apiKeySecretRef"})
_OPERATOR_ONLY_POLICY_FIELDS: Final = frozenset({"selector"})
# A SchedulingPolicy section read by parse_documents (budget_store.py), not a policy parameter.
_POLICY_SECTIONS: Final = frozenset({"budgetStore"})


def _mapping(where: str, value: object) -> Mapping[str, object]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be a mapping (got {type(value).__name__})")
    for key in value:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings (got {shown(key)})")
    return cast(Mapping[str, object], value)


def parse_policy(data: Mapping[str, object], where: str = "policy") -> PolicyConfig:
    """Build a :class:`PolicyConfig` from camelCase keys; missing keys take the defaults."""
    also = [*_OPERATOR_ONLY_POLICY_FIELDS, *_POLICY_SECTIONS]
    values = read_fields(where, data, POLICY_FIELDS, also)
    return validate_policy(PolicyConfig(**values), where)


def validate_policy(policy: PolicyConfig, where: str = "policy") -> PolicyConfig:
    """Cross-field rules (single fields are checked by their parsers)."""
    if not 0 < policy.batch_kv_watermark <= policy.interactive_kv_watermark <= 1:
        raise ConfigError(
            f"{where}.batchKvWatermark: watermarks must satisfy 0 < batchKvWatermark <= "
            f"interactiveKvWatermark <= 1 (got batch {policy.batch_kv_watermark}, "
            f"interactive {policy.interactive_kv_watermark})"
        )
    if policy.batch_throughput_gain > policy.max_batch_requests:
        raise ConfigError(
            f"{where}.batchThroughputGain: must be <= maxBatchRequests (a batch of S requests "
            f"runs at most S times as fast as one; got {policy.batch_throughput_gain:g} > "
            f"{policy.max_batch_requests})"
        )
    if policy.max_queued_requests_per_tenant > policy.max_queued_requests:
        raise ConfigError(
            f"{where}.maxQueuedRequestsPerTenant: must be <= maxQueuedRequests "
            f"(got {policy.max_queued_requests_per_tenant} > {policy.max_queued_requests})"
        )
    return policy


def parse_tenant(
    data: Mapping[str, object], where: str, default_id: str | None = None
) -> TenantConfig:
    """Build a :class:`TenantConfig` from a TenantQuota ``spec`` or a config-document entry."""
    unknown_keys(where, data, [*TENANT_FIELDS, *_OPERATOR_ONLY_TENANT_FIELDS])
    missing = [key for key in _REQUIRED_TENANT_FIELDS if key not in data]
    if "tenantId" not in data and default_id is None:
        missing.insert(0, "tenantId")
    if missing:
        raise ConfigError(f"{where}: missing required field(s) {', '.join(missing)}")
    values = read_fields(where, data, TENANT_FIELDS, _OPERATOR_ONLY_TENANT_FIELDS)
    if "tenant_id" not in values:
        values["tenant_id"] = _tenant_id(f"{where}.tenantId", default_id)
    return TenantConfig(**values)


def check_tenant_limits(tenant: TenantConfig, policy: PolicyConfig, where: str) -> None:
    """The tenant's rules that read the policy: ``maxKvShare`` of ``totalKvBlocks`` is at least
    one KV block (else the tenant could never run a request)."""
    share = tenant.max_kv_share
    if share is not None and share * policy.total_kv_blocks < 1:
        raise ConfigError(
            f"{where}.maxKvShare: maxKvShare x totalKvBlocks must be at least one KV block, or "
            f"the tenant could never run a request (got {share:g} x {policy.total_kv_blocks})"
        )


def build_config(
    policy: PolicyConfig,
    tenants: Sequence[TenantConfig],
    version: str = "",
    budget_store: BudgetStoreConfig | None = None,
) -> Config:
    """Check the rules that span tenants and return the :class:`Config`."""
    if not tenants:
        raise ConfigError("tenants: at least one tenant is required")
    seen: dict[str, int] = {}
    for i, tenant in enumerate(tenants):
        if tenant.tenant_id in seen:
            raise ConfigError(
                f"tenants[{i}].tenantId: duplicate tenant id {shown(tenant.tenant_id)} "
                f"(also tenants[{seen[tenant.tenant_id]}])"
            )
        seen[tenant.tenant_id] = i
        check_tenant_limits(tenant, policy, f"tenants[{i}]")
    owners: dict[str, str] = {}
    for tenant in tenants:
        for digest in tenant.api_key_sha256:
            other = owners.setdefault(digest, tenant.tenant_id)
            if other != tenant.tenant_id:
                raise ConfigError(
                    f"tenants[{tenant.tenant_id}].apiKeySha256: key hash {digest[:12]}… "
                    f"is also a key of tenant {shown(other)}"
                )
    return Config(
        policy=validate_policy(policy),
        tenants=tuple(tenants),
        version=version,
        budget_store=budget_store,
    )


MAX_VERSION_CHARS: Final = 256
"""Longest ``version`` of a config document (the operator writes a 64-character content hash);
it is shown in ``/status``, the logs and a metric label, so it is bounded."""


def _version(name: str, value: object) -> str:
    """A document's ``version``: a string of at most :data:`MAX_VERSION_CHARS` characters.
    ``null`` (``version:`` left empty) is ``""``; a number (YAML reads an unquoted ``3`` or
    ``20261201`` as one) is kept as its text, however large the integer — only its length
    counts."""
    if value is None:
        return ""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{name}: must be a string (got {shown(value)})")
    if isinstance(value, int) and abs(value) >= 10**MAX_VERSION_CHARS:
        # Its text would pass the bound (and str() of a huge integer is slow, or refused).
        raise ConfigError(f"{name}: must be at most {MAX_VERSION_CHARS} characters (got an "
                          f"integer of over {MAX_VERSION_CHARS} digits)")  # fmt: skip
    version = str(value)
    if len(version) > MAX_VERSION_CHARS:
        raise ConfigError(
            f"{name}: must be at most {MAX_VERSION_CHARS} characters (got {len(version)})"
        )
    return version


def parse_documents(documents: Iterable[object], source: str = "<config>") -> Config:
    """Read a config document and/or TenantQuota and SchedulingPolicy manifests."""
    policy: PolicyConfig | None = None
    tenants: list[TenantConfig] = []
    version = ""
    budget_store: BudgetStoreConfig | None = None
    count = 0
    for n, raw in enumerate(documents, start=1):
        if raw is None:  # an empty document between `---` separators
            continue
        count += 1
        doc = _mapping(f"{source}: document {n}", raw)
        kind = doc.get("kind")
        where = f"{source}: document {n} ({kind if kind in _KINDS else shown(kind)})"
        api_version = doc.get("apiVersion")
        if api_version != API_VERSION:
            raise ConfigError(
                f"{where}: apiVersion must be {API_VERSION} (got {shown(api_version)})"
            )
        if kind == CONFIG_KIND:
            unknown_keys(
                where, doc, ["apiVersion", "kind", "version", "policy", "tenants", "budgetStore"]
            )
            if "policy" in doc:
                if policy is not None:
                    raise ConfigError(f"{where}: the policy is defined twice")
                policy = parse_policy(
                    _mapping(f"{where}.policy", doc["policy"]), f"{source}: policy"
                )
            version = _version(f"{where}.version", doc.get("version", ""))
            if "budgetStore" in doc:
                budget_store = _budget_store(budget_store, doc["budgetStore"], where)
            entries = doc.get("tenants", [])
            if not isinstance(entries, list):
                raise ConfigError(f"{where}.tenants: must be a list")
            for i, entry in enumerate(entries):
                entry_where = f"{source}: tenants[{i}]"
                tenants.append(parse_tenant(_mapping(entry_where, entry), entry_where))
        elif kind in (TENANT_KIND, POLICY_KIND):
            name = _manifest_name(where, doc)
            where = f"{source}: {kind} {shown(name)}"
            spec = _mapping(f"{where}: spec", doc.get("spec", {}))
            if kind == TENANT_KIND:
                tenants.append(parse_tenant(spec, f"{where}: spec", default_id=name))
            else:
                if policy is not None:
                    raise ConfigError(f"{where}: the policy is defined twice")
                policy = parse_policy(spec, f"{where}: spec")
                if "budgetStore" in spec:
                    budget_store = _budget_store(
                        budget_store, spec["budgetStore"], f"{where}: spec"
                    )
        else:
            raise ConfigError(
                f"{where}: kind must be {CONFIG_KIND}, {TENANT_KIND} or {POLICY_KIND} "
                f"(got {shown(kind)})"
            )
    if count == 0:
        raise ConfigError(f"{source}: no YAML documents")
    try:
        return build_config(policy or PolicyConfig(), tenants, version, budget_store)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def _budget_store(earlier: BudgetStoreConfig | None, data: object, where: str) -> BudgetStoreConfig:
    if earlier is not None:
        raise ConfigError(f"{where}: the budgetStore is defined twice")
    return parse_budget_store(data, f"{where}.budgetStore")


def _manifest_name(where: str, doc: Mapping[str, object]) -> str:
    metadata = _mapping(f"{where}: metadata", doc.get("metadata", {}))
    name = metadata.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: metadata.name must be a non-empty string")
    return name


def load_config(path: str | Path) -> Config:
    """Load a YAML file (one or many documents) into a :class:`Config`."""
    source = str(path)
    data = read_config_file(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    return loads_config(text, source)


def read_config_file(path: str | Path) -> bytes:
    """The bytes of a config file: a regular file (not a FIFO, a device, a directory) of at
    most :data:`MAX_DOCUMENT_BYTES` (:mod:`tokenfair.config.files`); :class:`ConfigError`
    naming the file and the rule otherwise."""
    try:
        return read_regular(path, MAX_DOCUMENT_BYTES)
    except InputFileError as exc:
        raise ConfigError(str(exc)) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None


def loads_config(text: str, source: str = "<config>") -> Config:
    """Parse YAML text (one or many documents) into a :class:`Config`."""
    return parse_documents(load_documents(text, source), source)


SIDECAR_SECTION: Final = "sidecar"
"""The ``TokenfairConfig`` section of the sidecar's runtime settings (listeners, backend, ...),
read by ``tokenfair.server.runtime_settings``, not part of the policy contract."""


def load_tenants_file(path: str | Path) -> Config:
    """The policy and tenants of a config file as the CLI's ``--tenants`` reads it: the file a
    sidecar runs with, as it is (UTF-8 or gzip, YAML or JSON, like the sidecar's loader). The
    ``sidecar:`` section of a ``TokenfairConfig`` document is accepted (it must be a mapping) and
    ignored: a replay has no listeners or backend. Everything else follows
    :func:`parse_documents`' rules, unknown fields included."""
    source = str(path)
    documents = load_documents(document_text(read_config_file(path), source), source)
    return parse_documents([_without_sidecar_section(d, source) for d in documents], source)


def _without_sidecar_section(document: object, source: str) -> object:
    if not isinstance(document, dict) or document.get("kind") != CONFIG_KIND:
        return document
    if SIDECAR_SECTION not in document:
        return document
    stripped = dict(document)
    section = stripped.pop(SIDECAR_SECTION)
    if section is not None and not isinstance(section, dict):
        raise ConfigError(
            f"{source}: {SIDECAR_SECTION}: must be a mapping (got {type(section).__name__})"
        )
    return stripped


GZIP_MAGIC: Final = b"\x1f\x8b"
MAX_DOCUMENT_BYTES: Final = 16 * 1024 * 1024
"""Largest config document after decompression (16 MiB, about 75,000 tenants; the operator
publishes at most 1 MiB compressed, ~5 MB of JSON): a gzip bomb in a mounted or served
document is refused by size instead of filling the sidecar's memory. A config *file* is bound
by it too (:func:`read_config_file`): a 100 MB file is refused before it is read, not parsed
for minutes."""


def document_text(data: bytes, source: str = "<config>") -> str:
    """The text of a config file's bytes: UTF-8, or gzip of UTF-8 (the operator compresses
    documents too big for one Kubernetes object, ``docs/operator.md``), at most
    :data:`MAX_DOCUMENT_BYTES` once decompressed. A gzip document must be exactly one whole
    stream: a truncated one, or one with bytes after its end, is refused."""
    if data.startswith(GZIP_MAGIC):
        inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        try:
            data = inflater.decompress(data, MAX_DOCUMENT_BYTES)
        except zlib.error as exc:
            raise ConfigError(f"{source}: invalid gzip: {exc}") from None
        if inflater.unconsumed_tail or (not inflater.eof and len(data) >= MAX_DOCUMENT_BYTES):
            raise ConfigError(
                f"{source}: must be at most {MAX_DOCUMENT_BYTES} bytes once decompressed"
            )
        if not inflater.eof:
            raise ConfigError(f"{source}: invalid gzip: truncated (the stream does not end)")
        if inflater.unused_data:
            raise ConfigError(
                f"{source}: invalid gzip: {len(inflater.unused_data)} byte(s) after the end of "
                "the stream"
            )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None


def load_documents(text: str, source: str = "<config>") -> list[object]:
    """The documents of a config text. A text opening with ``{`` is one JSON document (JSON is
    YAML; the operator renders JSON because reading 10,000 tenants takes ~20 ms as JSON and ~1 s
    even with libyaml); anything else is read as YAML, one or many documents."""
    try:
        if text.lstrip().startswith("{"):
            try:
                return [json.loads(text)]
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{source}: invalid JSON: {exc}") from None
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None
    except RecursionError:  # PyYAML and json build nested collections recursively
        raise ConfigError(f"{source}: invalid YAML: nested too deeply") from None
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise ConfigError(f"{source}: invalid YAML: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Rendering and overrides


def policy_to_dict(policy: PolicyConfig) -> dict[str, object]:
    """camelCase mapping of every policy parameter (the inverse of :func:`parse_policy`);
    ``enforcement`` only when it is ``Shadow`` (a document without it reads as ``Enforce``, and
    documents rendered before shadow mode existed keep their bytes and content hash)."""
    out = {key: getattr(policy, attr) for key, (attr, _) in POLICY_FIELDS.items()}
    if policy.enforcement == "Enforce":
        del out["enforcement"]
    return out


def tenant_to_dict(tenant: TenantConfig) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, (attr, _) in TENANT_FIELDS.items():
        value = getattr(tenant, attr)
        if key == "apiKeySha256":
            if value:
                out[key] = list(value)
        elif value is not None:  # an unset enforcement or limit is left out (the default)
            out[key] = value
    return out


def config_to_document(config: Config) -> dict[str, object]:
    """The config document (``kind: TokenfairConfig``) that :func:`parse_documents` reads back."""
    doc: dict[str, object] = {"apiVersion": API_VERSION, "kind": CONFIG_KIND}
    if config.version:
        doc["version"] = config.version
    doc["policy"] = policy_to_dict(config.policy)
    if config.budget_store is not None:
        doc["budgetStore"] = budget_store_to_dict(config.budget_store)
    doc["tenants"] = [tenant_to_dict(t) for t in config.tenants]
    return doc


def apply_overrides(config: Config, assignments: Iterable[str]) -> Config:
    """Apply ``--set key=value`` overrides: a policy key (``maxBatchWaitMs=5000``) or a tenant
    field (``tenants.tenant_batch_rag.weight=2``). Values are YAML scalars."""
    policy_values = policy_to_dict(config.policy)
    tenant_values = {t.tenant_id: tenant_to_dict(t) for t in config.tenants}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {shown(assignment)}: expected key=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            raise ConfigError(f"--set {key}: value {shown(raw)} is not a YAML scalar") from None
        if key.startswith("tenants."):
            tenant_id, dot, field_name = key.removeprefix("tenants.").rpartition(".")
            if not dot or tenant_id not in tenant_values:
                known = ", ".join(tenant_values)
                raise ConfigError(f"--set {key}: unknown tenant (known: {known})")
            if field_name not in TENANT_FIELDS or field_name == "tenantId":
                fields = ", ".join(k for k in TENANT_FIELDS if k != "tenantId")
                raise ConfigError(f"--set {key}: unknown tenant field (known: {fields})")
            tenant_values[tenant_id][field_name] = value
        elif key in POLICY_FIELDS:
            policy_values[key] = value
        else:
            raise ConfigError(
                f"--set {key}: unknown parameter (policy: {', '.join(POLICY_FIELDS)}; "
                "tenants: tenants.<id>.<field>)"
            )
    try:
        policy = parse_policy(policy_values, "--set")
    except ConfigError as exc:  # "--set.maxBatchWaitMs: …" reads better as a flag
        raise ConfigError(str(exc).replace("--set.", "--set ", 1)) from None
    tenants = [
        parse_tenant(values, f"--set tenants.{tid}") for tid, values in tenant_values.items()
    ]
    return build_config(policy, tenants, config.version, config.budget_store)


def replace_policy(config: Config, **changes: Any) -> Config:
    """A copy of ``config`` with policy attributes changed (validated)."""
    policy = dataclasses.replace(config.policy, **changes)
    return build_config(policy, config.tenants, config.version, config.budget_store)
