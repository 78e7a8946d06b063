"""A thread-local stack of values in force while a model is traced.

`precision_rules`, `mesh_rules` and `default_implementation` each hold one:
a `with` block pushes its value, the innermost value is in force, and the
stack is restored however the block ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Generic, Iterator, TypeVar

T = TypeVar("T")


class ScopeStack(Generic[T]):
  """Values pushed by nested `with stack.push(value):` blocks, per thread."""

  def __init__(self):
    self._local = threading.local()

  def _stack(self) -> tuple[T, ...]:
    return getattr(self._local, "stack", ())

  @contextlib.contextmanager
  def push(self, value: T) -> Iterator[T]:
    """Within the block, `current()` is `value`."""
    stack = self._stack()
    self._local.stack = stack + (value,)
    try:
      yield value
    finally:
      self._local.stack = stack

  def current(self) -> T | None:
    """The innermost value in force, or None outside every block."""
    stack = self._stack()
    return stack[-1] if stack else None
