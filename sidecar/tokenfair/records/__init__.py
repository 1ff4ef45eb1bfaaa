"""The record format: the contract between whatever writes request and decision records and
whatever reads them (docs/records.md).

Below ``sim``, ``server`` and ``loadgen``, which all write or read records, above ``config`` and
``core`` (tests/test_layout.py):

* :mod:`~tokenfair.records.schema` — the schemas (msgspec structs): a request record
  (``TraceLine``) and a decision record (``RecordLine``);
* :mod:`~tokenfair.records.codec` — decoding, validating and wording the errors, and the one
  encoder of every record line;
* :mod:`~tokenfair.records.reading` — the per-line loop of a validating read (compiled with the
  core: docs/native.md);
* :mod:`~tokenfair.records.live` — the sidecar's record of a request (decision, outcome, usage),
  written by ``server/record_writer.py``.

This module imports nothing: ``reading`` is compiled, and what it imports is hashed with it
(``tokenfair/native.py``).
"""
