"""A request as the core receives it, in a module of its own.

``Request`` is a msgspec ``Struct`` (frozen, not tracked by the cyclic collector): built in
~0.06 µs where a frozen dataclass took ~1.3 µs (its ``__init__`` sets each field through
``object.__setattr__``), and decoded from a trace line without an intermediate object. The
trace schema (``tokenfair.records.codec.TraceLine``) subclasses it with each field's rules, so a
validated line *is* a request. mypyc cannot compile a ``Struct``: this module stays interpreted
when the core is compiled (``tokenfair.native``); the compiled modules read its fields as
attributes, as they read a dataclass's slots. No ``from __future__ import annotations``: msgspec
would resolve each string annotation through a ``typing.ForwardRef`` compiled from source.
"""

import msgspec

from tokenfair.config import PriorityClass


class Request(msgspec.Struct, frozen=True, gc=False):
    """One request record of a trace (see docs/records.md). Times in ms, sizes in tokens.

    Equal to another request when the types and every field are equal; hashable (frozen).
    ``gc=False``: it holds only strings and numbers, so the cyclic collector never scans it.
    """

    request_id: str
    tenant_id: str
    arrival_ms: float
    prefill_tokens: int
    decode_tokens: int
    priority_class: PriorityClass
