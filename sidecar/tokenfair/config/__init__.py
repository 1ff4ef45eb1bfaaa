"""The config contract (``tokenfair.config``): what the operator renders and the sidecar reads.

Modules:

* :mod:`tokenfair.config.document` — the policy and tenants (typed, frozen), YAML and manifest
  loading, overrides, the API-key digest; every bad value raises :class:`ConfigError` naming the
  field and the rule it broke;
* :mod:`tokenfair.config.fields` — the value parsers (one rule each: numbers, integers,
  ratios, booleans, strings, choices) and the table-driven reader every section and the
  ``tokenfair sidecar`` flags use, :class:`ConfigError` and :func:`shown`;
* :mod:`tokenfair.config.budget_store` — the ``budgetStore:`` section (pool-wide budgets) and
  the split of a tenant's budgets over ``n`` replicas;
* :mod:`tokenfair.config.files` — every file a user names is opened there, and only if it is a
  regular file (never a FIFO, a device, a directory), reads bounded in size;
* :mod:`tokenfair.config.wire` — the names both sides of the config feed use (the published
  data keys, the document server's headers and query parameters, the environment the injector
  sets, the metric families the operator scrapes) and the generation's rule: the operator
  imports them from here, never from the server.

The modules import one another one way only: ``document`` -> ``budget_store`` -> ``fields``
(tests/test_layout.py).

The names below are the contract's public surface; import them from here.
"""

from __future__ import annotations

from tokenfair.config.document import (
    CONFIG_KIND,
    MAX_DOCUMENT_BYTES,
    MAX_VERSION_CHARS,
    POLICY_FIELDS,
    PRIORITY_CLASSES,
    TENANT_FIELDS,
    Config,
    PolicyConfig,
    PriorityClass,
    TenantConfig,
    api_key_digest,
    apply_overrides,
    build_config,
    config_to_document,
    document_text,
    load_config,
    load_documents,
    load_tenants_file,
    loads_config,
    parse_documents,
    parse_policy,
    parse_tenant,
    read_config_file,
    replace_policy,
)
from tokenfair.config.fields import SHOWN_CHARS, ConfigError, shown

__all__ = [
    "CONFIG_KIND",
    "MAX_DOCUMENT_BYTES",
    "MAX_VERSION_CHARS",
    "POLICY_FIELDS",
    "PRIORITY_CLASSES",
    "SHOWN_CHARS",
    "TENANT_FIELDS",
    "Config",
    "ConfigError",
    "PolicyConfig",
    "PriorityClass",
    "TenantConfig",
    "api_key_digest",
    "apply_overrides",
    "build_config",
    "config_to_document",
    "document_text",
    "load_config",
    "load_documents",
    "load_tenants_file",
    "loads_config",
    "parse_documents",
    "parse_policy",
    "parse_tenant",
    "read_config_file",
    "replace_policy",
    "shown",
]
