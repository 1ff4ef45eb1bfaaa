"""The one field-table parser (``tokenfair.config.fields``) and the one backend registry.

Behaviours under test:

* each value parser has one behaviour, given by its accept/refuse table: ``true``/``false`` is
  never a number; a number is finite and at most 2^53 in magnitude; an integer field takes an
  integral number (``2``, ``2.0``) as an ``int`` and refuses ``2.5``; every refusal names the
  field and the rule, the value shown bounded;
* the table-driven reader refuses an unknown key by name and parses each known one under
  ``where.key``;
* the same bad value is refused by the same rule from a YAML policy, a ``sidecar:`` section and
  a ``tokenfair sidecar`` flag — read from real YAML files and a real ``tokenfair sidecar``
  process (which stops with the message before it listens) — and an integral float is taken
  by all three; ``maxInFlight`` is one rule (``in_flight_limit``: 1..100,000) wherever it comes
  from, the operator's injector included (tests/operator/test_operator_inject.py);
* the integer rule keeps the CRDs' contract: every ``type: integer`` field of the CRDs takes its
  minimum written as a float and refuses a fraction above it; every number field refuses a bool;
* the backend names are listed once, in ``tokenfair.server.runtime_settings.BACKEND_NAMES``
  (below the registry ``tokenfair.server.backends.BACKENDS``, which builds one per name): the
  classes' names, the ``sidecar:`` key's rule, the ``--backend`` choices and help, the default.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import yaml
from repo_paths import REPO_ROOT
from sidecar_support import keyed_config

from tokenfair.config import (
    POLICY_FIELDS,
    TENANT_FIELDS,
    ConfigError,
    config_to_document,
    fields,
    load_config,
    parse_policy,
    parse_tenant,
)
from tokenfair.config.fields import MAX_INTEGER, SHOWN_CHARS, Parser

BIG = 10**400  # float() of it overflows; its repr is 400 digits


def refusal(parse: Parser, value: object, name: str = "f") -> str:
    with pytest.raises(ConfigError) as caught:
        parse(name, value)
    return str(caught.value)


# parser -> (accepted: input -> output, refused: input -> rule in the message)
TABLES: dict[str, tuple[Parser, dict[Any, Any], list[tuple[object, str]]]] = {
    "number": (
        fields.number,
        {0: 0.0, -1.5: -1.5, 7: 7.0, MAX_INTEGER: float(MAX_INTEGER), -MAX_INTEGER: -(2.0**53)},
        [
            (True, "must be a number"),
            (False, "must be a number"),
            ("1", "must be a number"),
            (None, "must be a number"),
            ([1], "must be a number"),
            (math.inf, "must be finite"),
            (math.nan, "must be finite"),
            (MAX_INTEGER + 1, "must be at most 9007199254740992 in magnitude"),
            (-BIG, "must be at most 9007199254740992 in magnitude"),
            (1e300, "must be at most 9007199254740992 in magnitude"),
        ],
    ),
    "integer": (
        fields.integer,
        {
            0: 0,
            -3: -3,
            2.0: 2,
            1e3: 1000,
            MAX_INTEGER: MAX_INTEGER,
            float(MAX_INTEGER): MAX_INTEGER,
        },
        [
            (True, "must be an integer"),
            (2.5, "must be an integer"),
            (math.inf, "must be an integer"),
            (math.nan, "must be an integer"),
            ("2", "must be an integer"),
            (MAX_INTEGER + 1, "must be at most 9007199254740992 in magnitude"),
            (BIG, "must be at most 9007199254740992 in magnitude"),
            (1e300, "must be at most 9007199254740992 in magnitude"),
        ],
    ),
    "positive": (
        fields.positive,
        {1e-9: 1e-9, 3: 3.0},
        [(0, "must be > 0"), (-0.5, "must be > 0"), (True, "must be a number")],
    ),
    "non_negative": (
        fields.non_negative,
        {0: 0.0, 2.5: 2.5},
        [(-1e-9, "must be >= 0"), (False, "must be a number")],
    ),
    "positive_int": (
        fields.positive_int,
        {1: 1, 64.0: 64},
        [
            (0, "must be > 0"),
            (-2.0, "must be > 0"),
            (1.5, "must be an integer"),
            (True, "must be an integer"),
            (-BIG, "must be at most 9007199254740992 in magnitude"),
        ],
    ),
    "ratio": (
        fields.ratio,
        {1: 1.0, 0.25: 0.25},
        [(0, "must be in (0, 1]"), (1.01, "must be in (0, 1]"), (True, "must be a number")],
    ),
    "share": (
        fields.share,
        {0: 0.0, 0.5: 0.5},
        [(-0.1, "must be in [0, 0.5]"), (0.51, "must be in [0, 0.5]")],
    ),
    "number_in": (
        fields.number_in(1, 10),
        {1: 1.0, 10.0: 10.0},
        [(0.5, "must be in [1, 10]"), (11, "must be in [1, 10]"), (True, "must be a number")],
    ),
    "integer_in": (
        fields.integer_in(1, 10),
        {1: 1, 10.0: 10},
        [(0, "must be in [1, 10]"), (11, "must be in [1, 10]"), (5.5, "must be an integer")],
    ),
    "boolean": (
        fields.boolean,
        {True: True, False: False},
        [
            (1, "must be true or false"),
            (0, "must be true or false"),
            ("true", "must be true or false"),
        ],
    ),
    "string": (
        fields.string,
        {"x": "x", " padded ": " padded "},
        [("", "must be a non-empty string"), (3, "must be a non-empty string")],
    ),
    "one_of": (
        fields.one_of(("json", "off")),
        {"json": "json", "off": "off"},
        [("xml", "must be one of json, off"), (None, "must be one of json, off")],
    ),
}
ACCEPTED = [
    (kind, value, out) for kind, (_, table, _) in TABLES.items() for value, out in table.items()
]
REFUSED = [(kind, value, rule) for kind, (_, _, table) in TABLES.items() for value, rule in table]


@pytest.mark.parametrize(("kind", "value", "expected"), ACCEPTED)
def test_each_parser_accepts_its_table(kind: str, value: object, expected: object) -> None:
    parsed = TABLES[kind][0]("f", value)
    assert parsed == expected
    assert type(parsed) is type(expected)  # an integer field gives an int, a number a float


@pytest.mark.parametrize(("kind", "value", "rule"), REFUSED)
def test_each_parser_refuses_its_table_naming_the_field_and_the_rule(
    kind: str, value: object, rule: str
) -> None:
    message = refusal(TABLES[kind][0], value, name="policy.someField")
    assert message.startswith(f"policy.someField: {rule}"), message
    assert message.endswith(f"(got {fields.shown(value)})"), message


def test_a_refused_value_is_shown_bounded() -> None:
    assert refusal(fields.number, BIG).endswith("(got <an integer of 1329 bits>)")
    huge = ["x" * 10_000] * 10_000
    message = refusal(fields.string, huge)
    assert len(message) < 60 + SHOWN_CHARS


def test_the_reader_parses_known_keys_and_refuses_unknown_ones_by_name() -> None:
    table: fields.FieldTable = {
        "maxThings": ("max_things", fields.positive_int),
        "on": ("on", fields.boolean),
    }
    assert fields.read_fields("s", {"maxThings": 3.0}, table) == {"max_things": 3}
    assert fields.read_fields("s", {"extra": 1}, table, also=["extra"]) == {}
    with pytest.raises(ConfigError) as caught:
        fields.read_fields("s", {"maxThing": 3, "of": True}, table)
    assert str(caught.value) == "s: unknown field(s) maxThing, of (known: maxThings, on)"
    with pytest.raises(ConfigError, match=r"^s\.on: must be true or false \(got 1\)$"):
        fields.read_fields("s", {"on": 1}, table)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("2", 2),
        ("2.0", 2.0),
        ("1e-2", 0.01),
        ("-3", -3),
        ("fast", "fast"),
        ("", ""),
        ("true", "true"),
    ],
)
def test_a_number_flag_is_read_by_python_number_syntax_else_kept_as_text(
    text: str, value: object
) -> None:
    read = fields.flag_number(text)
    assert read == value
    assert type(read) is type(value)


# ---------------------------------------------------------------------------------------------
# One rule from three places: YAML policy, the sidecar: section, a flag.


def write_file(
    tmp_path: Path, policy: dict[str, object], section: dict[str, object], name: str = "sidecar"
) -> Path:
    """A real config file: the test tenants, ``policy`` over the defaults, a ``sidecar:``."""
    document = config_to_document(keyed_config())
    document["policy"] = {**cast(dict[str, object], document["policy"]), **policy}
    if section:
        document["sidecar"] = section
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False), encoding="utf-8")
    return path


def parse_flags(path: Path, *argv: str) -> argparse.Namespace:
    from tokenfair.cli import build_parser

    return build_parser({"sidecar"}).parse_args(["sidecar", "--config", str(path), *argv])


def run_sidecar(path: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """A real ``tokenfair sidecar``: a refused value stops it before it listens."""
    command = [sys.executable, "-m", "tokenfair.cli", "sidecar", "--config", str(path), *argv]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def rule_of(message: str, name: str) -> str:
    """The rule part of a refusal: what follows ``name: ``."""
    assert f"{name}: " in message, message
    return message.split(f"{name}: ", 1)[1].strip()


# (policy key with the same rule, or None: the rule itself; sidecar: key, flag, YAML text of the
# value = the flag's text)
SAME_RULE = [
    ("totalKvBlocks", "maxInFlight", "--max-in-flight", "2.5"),
    ("must be in [1, 100000] (got 0)", "maxInFlight", "--max-in-flight", "0"),
    ("must be in [1, 100000] (got -3)", "maxInFlight", "--max-in-flight", "-3"),
    ("must be in [1, 100000] (got 100001)", "maxInFlight", "--max-in-flight", "100001"),
    ("totalKvBlocks", "maxInFlight", "--max-in-flight", "many"),
    ("totalKvBlocks", "maxInFlight", "--max-in-flight", "9007199254740993"),
    ("decodeWeight", "timeScale", "--time-scale", "0"),
    ("decodeWeight", "timeScale", "--time-scale", "-0.5"),
    ("decodeWeight", "timeScale", "--time-scale", "fast"),
    ("decodeWeight", "drainGraceSeconds", "--drain-grace", "1.0e+300"),
]


@pytest.mark.parametrize(("policy_key", "section_key", "flag", "text"), SAME_RULE)
def test_the_same_value_is_refused_by_the_same_rule_from_yaml_section_and_flag(
    tmp_path: Path, policy_key: str, section_key: str, flag: str, text: str
) -> None:
    from tokenfair.commands.sidecar import settings_for
    from tokenfair.server import load_sidecar_file

    value = yaml.safe_load(text)  # what a YAML file holds for `key: <text>`
    if policy_key.startswith("must "):
        rule = policy_key
    else:
        bad_policy = write_file(tmp_path, {policy_key: value}, {})
        with pytest.raises(ConfigError) as from_policy:
            load_config(bad_policy)
        rule = rule_of(str(from_policy.value), f"policy.{policy_key}")

    bad_section = write_file(tmp_path, {}, {section_key: value})
    with pytest.raises(ConfigError) as from_section:
        settings_for(parse_flags(bad_section), load_sidecar_file(bad_section).section)
    assert rule_of(str(from_section.value), f"sidecar.{section_key}") == rule

    good = write_file(tmp_path, {}, {})
    with pytest.raises(ConfigError) as from_flag:
        settings_for(parse_flags(good, flag, text), {})
    assert rule_of(str(from_flag.value), flag) == rule


def test_a_real_sidecar_process_refuses_them_alike(tmp_path: Path) -> None:
    expected = "must be an integer (got 2.5)"
    bad_policy = write_file(tmp_path, {"totalKvBlocks": 2.5}, {}, name="policy")
    bad_section = write_file(tmp_path, {}, {"maxInFlight": 2.5}, name="section")
    good = write_file(tmp_path, {}, {})
    for path, argv, name in [
        (bad_policy, (), "policy.totalKvBlocks"),
        (bad_section, (), "sidecar.maxInFlight"),
        (good, ("--max-in-flight", "2.5"), "--max-in-flight"),
    ]:
        done = run_sidecar(path, *argv)
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("tokenfair sidecar: error: "), done.stderr
        assert f"{name}: {expected}" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_an_integral_float_is_an_integer_from_yaml_section_and_flag(tmp_path: Path) -> None:
    from tokenfair.commands.sidecar import settings_for
    from tokenfair.server import load_sidecar_file

    path = tmp_path / "sidecar.yaml"
    text = yaml.safe_dump(config_to_document(keyed_config()), sort_keys=False)
    text = text.replace("totalKvBlocks: 1600", "totalKvBlocks: 1600.0")
    text += "sidecar:\n  maxInFlight: 8.0\n  maxBodyBytes: 1.0e+6\n"
    path.write_text(text, encoding="utf-8")
    loaded = load_sidecar_file(path)
    assert loaded.config.policy.total_kv_blocks == 1600
    assert type(loaded.config.policy.total_kv_blocks) is int
    settings = settings_for(parse_flags(path), loaded.section)
    assert (settings.max_in_flight, settings.max_body_bytes) == (8, 1_000_000)
    assert type(settings.max_in_flight) is int
    assert type(settings.max_body_bytes) is int
    settings = settings_for(parse_flags(path, "--max-in-flight", "16.0"), loaded.section)
    assert settings.max_in_flight == 16
    assert type(settings.max_in_flight) is int


def test_a_bool_is_never_a_number_in_any_table() -> None:
    from tokenfair.server.runtime_settings import SECTION_FIELDS

    tables = {"policy": POLICY_FIELDS, "tenant": TENANT_FIELDS, "sidecar": SECTION_FIELDS}
    modes_with_off = []
    for where, table in tables.items():
        for key, (_, parse) in table.items():
            name = f"{where}.{key}"
            for flag in (True, False):
                if parse is fields.boolean:  # only a boolean field takes it
                    assert parse(name, flag) is flag
                    continue
                if flag is False and _takes_off(parse, name):
                    # A mode that has `off`: YAML 1.1 reads an unquoted `off` as false, which is
                    # that mode (never a number, never another mode).
                    assert parse(name, flag) == "off"
                    modes_with_off.append(name)
                    continue
                with pytest.raises(ConfigError, match=rf"^{where}\.{key}: must be "):
                    parse(name, flag)
    assert sorted(modes_with_off) == [
        "sidecar.accessLog",
        "sidecar.engineMetrics",
        "sidecar.kvPromptRatio",
    ]


def _takes_off(parse: Callable[[str, object], object], name: str) -> bool:
    """A mode field (one of a few words) of which `off` is one: not a free string."""
    try:
        if parse(name, "off") != "off":
            return False
    except ConfigError:
        return False
    try:
        parse(name, "nosuchmode")
    except ConfigError:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# The CRDs' contract


def crd_spec(name: str) -> dict[str, Any]:
    crd = yaml.safe_load((REPO_ROOT / "crds" / f"tokenfair.io_{name}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    spec: dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


INTEGER_FIELDS = [
    (kind, key, prop)
    for kind, name, table in [
        ("policy", "schedulingpolicies", POLICY_FIELDS),
        ("quota", "tenantquotas", TENANT_FIELDS),
    ]
    for key, prop in crd_spec(name)["properties"].items()
    if key in table and prop.get("type") == "integer"
]


def parse_field(kind: str, key: str, value: object) -> Any:
    if kind == "policy":
        company = {"maxQueuedRequests": 10_000_000, "maxQueuedRequestsPerTenant": 1}
        policy = parse_policy({**company, key: value})
        return getattr(policy, POLICY_FIELDS[key][0])
    base = {"weight": 1.0, "burstServiceTokens": 1, "sustainedServiceTokensPerSecond": 1.0}
    tenant = parse_tenant({**base, key: value}, "spec", default_id="t")
    return getattr(tenant, TENANT_FIELDS[key][0])


def test_the_crds_have_integer_fields() -> None:
    assert {key for _, key, _ in INTEGER_FIELDS} >= {"totalKvBlocks", "burstServiceTokens"}


@pytest.mark.parametrize(
    ("kind", "key", "prop"), INTEGER_FIELDS, ids=[k for _, k, _ in INTEGER_FIELDS]
)
def test_a_crd_integer_field_takes_an_integral_float_and_refuses_a_fraction(
    kind: str, key: str, prop: dict[str, Any]
) -> None:
    lowest = prop["minimum"] + (1 if prop.get("exclusiveMinimum") else 0)
    parsed = parse_field(kind, key, float(lowest))  # what the API server accepts as integer
    assert parsed == lowest
    assert type(parsed) is int
    with pytest.raises(ConfigError, match=rf"{key}: must be an integer \(got {lowest + 0.5}\)"):
        parse_field(kind, key, lowest + 0.5)


# ---------------------------------------------------------------------------------------------
# The backend registry


def test_the_backend_names_are_listed_once_in_the_registry() -> None:
    from tokenfair.cli import build_parser
    from tokenfair.server.backends import BACKENDS, CostModelBackend, OpenAIBackend
    from tokenfair.server.runtime_settings import (
        BACKEND_NAMES,
        UPSTREAM_BACKENDS,
        SidecarSettings,
        settings_from_section,
    )

    assert tuple(BACKENDS) == (CostModelBackend.name, OpenAIBackend.name) == BACKEND_NAMES
    assert {name for name, kind in BACKENDS.items() if kind.needs_upstream} == UPSTREAM_BACKENDS
    assert SidecarSettings().backend in BACKENDS
    parser = build_parser({"sidecar"})
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    backend = next(a for a in sub.choices["sidecar"]._actions if a.dest == "backend")
    assert tuple(backend.choices or ()) == tuple(BACKENDS)
    assert all(name in (backend.help or "") for name in BACKENDS)
    known = ", ".join(BACKENDS)
    with pytest.raises(ConfigError, match=rf"^sidecar\.backend: must be one of {known} "):
        settings_from_section({"backend": "vllm"})
    for name, kind in BACKENDS.items():
        if kind.needs_upstream:
            with pytest.raises(ConfigError, match=f"the {name} backend needs an upstream URL"):
                settings_from_section({"backend": name})
        else:
            assert settings_from_section({"backend": name}).backend == name
