"""Tables of bad inputs: each case a call, the error it must raise and the
fragments its message must hold (the offending value and the fix).
`tests/ops/test_op_errors.py` and `tests/training/test_bad_inputs.py` run
theirs with these."""

from __future__ import annotations

import pytest


def assert_error(call, error, fragments) -> None:
  """`call()` raises `error` with every one of `fragments` in its message."""
  with pytest.raises(error) as info:
    call()
  message = str(info.value)
  for fragment in fragments:
    assert fragment in message, (fragment, message)


def table_params(table) -> list:
  """`table`'s cases as `pytest.param`s, each with its name as its id."""
  return [pytest.param(*table[name], id=name) for name in table]
