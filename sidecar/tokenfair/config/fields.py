"""Config values: one parser per rule, and the table-driven reader every config section uses.

A field table maps a YAML key to ``(attribute, parser)``; a parser takes the name to report
(``policy.totalKvBlocks``, ``sidecar.maxInFlight``, ``--max-in-flight``) and the value, and
returns the typed value or raises :class:`ConfigError` naming the field and the rule it broke,
the value shown bounded by :func:`shown`. The policy and tenant tables
(:mod:`tokenfair.config.document`), the ``sidecar:`` section and the ``tokenfair sidecar``
flags (:mod:`tokenfair.server.runtime_settings`, :mod:`tokenfair.commands.sidecar`) all read
through :func:`read_fields` and the parsers below: one behaviour per rule, wherever a value
comes from.

The rules for numbers:

* ``true``/``false`` is never a number (Python's ``bool`` is an ``int``; YAML's ``yes`` too);
* a number is finite and at most :data:`MAX_INTEGER` (2^53) in magnitude: every integer up to
  it is an exact float, and the core mixes integers with floats;
* **an integer field takes any integral number**: ``2``, and ``2.0`` or ``1.0e+3`` as YAML and
  JSON tools write them, are integers; ``2.5`` is refused (``must be an integer``). It is the
  rule of the CRDs' ``type: integer`` fields (the Kubernetes API server accepts ``2.0`` there:
  JSON has one number type), so a value ``kubectl apply`` takes is one the sidecar takes;
* a command-line value is read as a number by Python's ``int``, else ``float`` syntax
  (:func:`flag_number`), then checked by the same parser as the YAML key it overrides.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any, Final

Parser = Callable[[str, object], Any]
"""``parser(name, value) -> parsed value``; raises :class:`ConfigError` naming ``name``."""
FieldTable = Mapping[str, tuple[str, Parser]]
"""YAML key -> (attribute, parser)."""


class ConfigError(ValueError):
    """A config input broke a rule; the message names the field and the rule."""


MAX_INTEGER: Final = 2**53
"""Largest magnitude of a number field: every integer up to it is an exact float, and the core
mixes integers with floats (budgets, occupancy). Larger ones (e.g. 400 digits) are refused by
name."""


def _too_large(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INTEGER


class _BoundedRepr(reprlib.Repr):
    """``repr`` cut to a few levels, items and characters; an integer beyond
    :data:`MAX_INTEGER` by its size (``repr`` of one of over 4,300 digits raises)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxtuple = self.maxlist = self.maxarray = 3
        self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 3
        self.maxstring = self.maxother = 40
        self.maxlong = 40

    def repr_int(self, x: int, level: int) -> str:
        if _too_large(x):
            return f"<an integer of {abs(x).bit_length()} bits>"
        return super().repr_int(x, level)


_SHOWN: Final = _BoundedRepr()
SHOWN_CHARS: Final = 120
"""The most characters :func:`shown` gives a value."""


def shown(value: object) -> str:
    """A value as an error message shows it: its ``repr``, bounded (2 levels, 3 items a level,
    40 characters a string, :data:`SHOWN_CHARS` in all), so a value from a YAML alias bomb
    (nested lists of millions of items, built from a few lines) makes a short message, quickly.
    Every value in a config error message goes through it."""
    try:
        text = _SHOWN.repr(value)
    except Exception:  # a repr that fails
        return f"<a value of type {type(value).__name__}>"
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


# ---------------------------------------------------------------------------------------------
# Parsers: one behaviour each.


def _too_large_error(name: str, value: object) -> ConfigError:
    return ConfigError(f"{name}: must be at most {MAX_INTEGER} in magnitude (got {shown(value)})")


def number(name: str, value: object) -> float:
    """Any finite number of magnitude at most :data:`MAX_INTEGER`, as a float; never a bool."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}: must be a number (got {shown(value)})")
    if _too_large(value):  # float() of it may overflow; its repr may be thousands of digits
        raise _too_large_error(name, value)
    if not math.isfinite(value):
        raise ConfigError(f"{name}: must be finite (got {shown(value)})")
    if abs(value) > MAX_INTEGER:
        raise _too_large_error(name, value)
    return float(value)


def integer(name: str, value: object) -> int:
    """An integral number (``2``, or ``2.0`` as YAML and JSON tools write it) of magnitude at
    most :data:`MAX_INTEGER`, as an int; never a bool, never ``2.5``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name}: must be an integer (got {shown(value)})")
    if isinstance(value, float):
        if not value.is_integer():  # 2.5, inf, nan
            raise ConfigError(f"{name}: must be an integer (got {shown(value)})")
        if abs(value) > MAX_INTEGER:
            raise _too_large_error(name, value)
        return int(value)
    if _too_large(value):
        raise _too_large_error(name, value)
    return value


def positive(name: str, value: object) -> float:
    """A number > 0."""
    result = number(name, value)
    if result <= 0:
        raise ConfigError(f"{name}: must be > 0 (got {shown(value)})")
    return result


def non_negative(name: str, value: object) -> float:
    """A number >= 0."""
    result = number(name, value)
    if result < 0:
        raise ConfigError(f"{name}: must be >= 0 (got {shown(value)})")
    return result


def positive_int(name: str, value: object) -> int:
    """An integer (see :func:`integer`) > 0."""
    result = integer(name, value)
    if result <= 0:
        raise ConfigError(f"{name}: must be > 0 (got {shown(value)})")
    return result


def ratio(name: str, value: object) -> float:
    """A number in (0, 1]."""
    result = number(name, value)
    if not 0 < result <= 1:
        raise ConfigError(f"{name}: must be in (0, 1] (got {shown(value)})")
    return result


def share(name: str, value: object) -> float:
    """A number in [0, 0.5]."""
    result = number(name, value)
    if not 0 <= result <= 0.5:
        raise ConfigError(f"{name}: must be in [0, 0.5] (got {shown(value)})")
    return result


def number_in(low: float, high: float) -> Parser:
    """A parser of a number in ``[low, high]``."""

    def parse(name: str, value: object) -> float:
        result = number(name, value)
        if not low <= result <= high:
            raise ConfigError(f"{name}: must be in [{low:g}, {high:g}] (got {shown(value)})")
        return result

    return parse


def integer_in(low: int, high: int) -> Parser:
    """A parser of an integer (see :func:`integer`) in ``[low, high]``."""

    def parse(name: str, value: object) -> int:
        result = integer(name, value)
        if not low <= result <= high:
            raise ConfigError(f"{name}: must be in [{low}, {high}] (got {shown(value)})")
        return result

    return parse


MAX_IN_FLIGHT: Final = 100_000
"""Most requests a sidecar lets its backend run at once."""

in_flight_limit: Final = integer_in(1, MAX_IN_FLIGHT)
"""The requests the backend runs at once, an integer in [1, :data:`MAX_IN_FLIGHT`]: the
``sidecar.maxInFlight`` key, the ``--max-in-flight`` flag, and the operator's injector (its
annotation and its setting, which it passes on as the flag), one rule for all four."""


def boolean(name: str, value: object) -> bool:
    """``true`` or ``false``; never a number or a string."""
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: must be true or false (got {shown(value)})")
    return value


def string(name: str, value: object) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: must be a non-empty string (got {shown(value)})")
    return value


def one_of(options: Collection[str]) -> Parser:
    """A parser of one of ``options`` (strings, listed in the message in their order)."""
    choices = tuple(options)

    def parse(name: str, value: object) -> str:
        for option in choices:
            if value == option:
                return option
        raise ConfigError(f"{name}: must be one of {', '.join(choices)} (got {shown(value)})")

    return parse


# ---------------------------------------------------------------------------------------------
# The reader


def unknown_keys(where: str, data: Mapping[str, object], known: Iterable[str]) -> None:
    """Refuse the keys of ``data`` that are not ``known``, naming them (and the known ones)."""
    names = set(known)
    unknown = sorted(shown(key) if not isinstance(key, str) else key
                     for key in data if key not in names)  # fmt: skip
    if unknown:
        raise ConfigError(
            f"{where}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(names))})"
        )


def read_fields(
    where: str, data: Mapping[str, object], table: FieldTable, also: Iterable[str] = ()
) -> dict[str, Any]:
    """``attribute -> parsed value`` for the keys of ``table`` that ``data`` holds, each parsed
    under the name ``where.key``; a key in neither ``table`` nor ``also`` (keys read elsewhere)
    is refused, naming it. Keys left out keep the caller's defaults."""
    unknown_keys(where, data, [*table, *also])
    return {attr: parse(f"{where}.{key}", data[key]) for key, (attr, parse) in table.items()
            if key in data}  # fmt: skip


def flag_number(text: str) -> object:
    """A command-line value for a number field (an ``argparse`` ``type``): the text as Python's
    ``int``, else ``float`` reads it (``2``, ``2.0``, ``1e-2``), else the text itself, which the
    field's parser then refuses by name (``--time-scale: must be a number (got 'fast')``). Never
    raises: every refusal comes from the one parser of the field."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    return text
