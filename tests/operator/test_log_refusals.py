"""``chart_support.assert_never_refused``: what the RBAC tests conclude from an operator's log.

A refusal for a namespace being deleted (an earlier test's, which an operator watching every
namespace still sees) is no missing permission; any other 403 is. The log lines below have the
shapes the operator writes: Kopf's text records, whose tracebacks and response bodies continue
over several lines, and JSON records.
"""

# The log samples are real records' shapes, one line each however long.
# ruff: noqa: E501

from __future__ import annotations

import pytest
from chart_support import assert_never_refused, log_records

_TERMINATING = """\
[2026-12-06 04:52:04,123] kopf.objects         [ERROR   ] [tf-old/alpha] Handler 'reconcile' failed with an exception. Will retry.
Traceback (most recent call last):
  File "kopf/_cogs/clients/errors.py", line 148, in check_response
    response.raise_for_status()
aiohttp.client_exceptions.ClientResponseError: 403, message='Forbidden', url='https://127.0.0.1:6443/api/v1/namespaces/tf-old/configmaps'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "kopf/_core/actions/execution.py", line 276, in execute_handler_once
kopf._cogs.clients.errors.APIForbiddenError: ('configmaps "tf-doc" is forbidden: unable to create new content in namespace tf-old because it is being terminated', {'kind': 'Status', 'reason': 'Forbidden', 'details': {'causes': [{'reason': 'NamespaceTerminating'}]}, 'code': 403})
"""

_RBAC = """\
[2026-12-06 04:52:05,001] kopf.objects         [ERROR   ] [tf-new/beta] Handler 'reconcile' failed with an exception. Will retry.
Traceback (most recent call last):
  File "kopf/_core/actions/execution.py", line 276, in execute_handler_once
kopf._cogs.clients.errors.APIForbiddenError: ('configmaps "tf-doc" is forbidden: User "system:serviceaccount:tf:tokenfair-operator" cannot create resource "configmaps" in API group "" in the namespace "tf-new"', {'reason': 'Forbidden', 'code': 403})
"""

_QUIET = "[2026-12-06 04:52:06,000] tokenfair.operator [INFO    ] published config version 7\n"


def test_a_record_continued_over_lines_is_one_record() -> None:
    records = log_records(_QUIET + _TERMINATING + _QUIET)
    assert len(records) == 3
    assert records[1].startswith("[2026-12-06 04:52:04,123]")
    assert "NamespaceTerminating" in records[1]
    assert "Traceback" in records[1]


def test_a_refusal_for_a_namespace_being_deleted_is_no_rbac_refusal() -> None:
    # The chained exception's line says ``403, message='Forbidden'`` without the reason, which
    # only the record's last line gives: the whole record goes, not just that line.
    assert_never_refused(_QUIET + _TERMINATING + _QUIET)


def test_an_rbac_refusal_is_found() -> None:
    with pytest.raises(AssertionError):
        assert_never_refused(_QUIET + _RBAC)


def test_an_rbac_refusal_right_after_a_terminating_one_is_found() -> None:
    with pytest.raises(AssertionError):
        assert_never_refused(_TERMINATING + _RBAC)


def test_an_rbac_refusal_that_also_mentions_a_terminating_namespace_is_found() -> None:
    # One record naming both a missing permission and a namespace going away: the permission
    # is what the test is about.
    both = _RBAC.rstrip("\n") + " (namespace tf-old: NamespaceTerminating)\n"
    with pytest.raises(AssertionError):
        assert_never_refused(both)


def test_a_refusal_in_the_json_format_is_found() -> None:
    line = '{"time": "2026-12-06T04:52:07Z", "level": "ERROR", "message": "PATCH tenantquotas: 403 Forbidden"}\n'
    with pytest.raises(AssertionError):
        assert_never_refused(_QUIET + line)
