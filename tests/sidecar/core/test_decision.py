"""``Decision`` (``core/jobs.py``) writes its ``__init__`` out (the compiled core would keep a
generated one interpreted); it must still behave as the dataclass it is, on either core.

Behaviours under test: positional and keyword construction with the dataclass's defaults
(``observed`` a fresh dict each time); equality; ``dataclasses.replace``; ``copy``, ``deepcopy``
and ``pickle`` give an equal decision (the deep copy with its own ``observed``).
"""

from __future__ import annotations

import copy
import dataclasses
import pickle

from tokenfair.core import Decision


def decision() -> Decision:
    made = Decision(
        "r1", "t", "batch", 429, "shed_queue_timeout", "queue", 700, 12.5, 0.25, 3.0, 0.0, None, 1.5
    )
    made.observed["max_wait_ms"] = 3500.0
    return made


def test_defaults_are_the_dataclass_fields() -> None:
    made = Decision(
        request_id="r",
        tenant_id="t",
        priority_class="interactive",
        status_code=200,
        reason="admitted",
        gate="dispatch",
        service_tokens=10,
        arrival_ms=1.0,
    )
    # The written-out defaults are the declared ones (a field added to one and not the other
    # fails here).
    declared = {
        f.name: f.default
        for f in dataclasses.fields(Decision)
        if f.default is not dataclasses.MISSING
    }
    assert set(declared) == {
        "kv_occupancy_ratio",
        "queue_wait_ms",
        "ttft_ms",
        "dispatch_ms",
        "retry_after_ms",
        "actual_service_tokens",
        "would_refuse",
    }
    assert {name: getattr(made, name) for name in declared} == declared
    other = dataclasses.replace(made)
    assert made.observed == {}
    assert made.observed is not Decision("r", "t", "batch", 1, "x", "y", 1, 0.0).observed
    assert other == made


def test_replace_copy_deepcopy_and_pickle() -> None:
    original = decision()
    assert dataclasses.replace(original, ttft_ms=4.0).ttft_ms == 4.0
    shallow = copy.copy(original)
    assert shallow == original
    assert shallow.observed is original.observed
    deep = copy.deepcopy(original)
    assert deep == original
    assert deep.observed is not original.observed
    assert pickle.loads(pickle.dumps(original)) == original
