"""`implementation=` dispatch between the pure-jnp reference and the kernels.

Every op with kernels takes `implementation=`: "xla" is the pure-jnp
reference (the truth, and the CPU default); the other names select kernels
(see each op's docstring). `None` picks per platform: the first entry of the
op's preference list for that platform that supports the call, falling back
when a kernel raises `NotImplementedError` (unsupported backend, shape or
dtype). An explicit name never falls back: its `NotImplementedError` reaches
the caller.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax

_OVERRIDE = threading.local()


def platform() -> str:
  """The default backend's platform: "cpu", "gpu", "tpu"."""
  return jax.default_backend()


@contextlib.contextmanager
def default_implementation(name: str) -> Iterator[None]:
  """Within the block, `implementation=None` tries `name` first.

  Applies while tracing: wrap the `jax.jit`/first call, e.g.
  `with default_implementation("xla"): step(...)` runs the pure-jnp reference
  everywhere (for comparisons and benchmarks) without touching model code.
  Ops without that implementation, or that cannot run it, fall back to "xla".
  """
  stack = getattr(_OVERRIDE, "stack", [])
  _OVERRIDE.stack = stack + [name]
  try:
    yield
  finally:
    _OVERRIDE.stack = stack


def dispatch(op: str, implementations: Mapping[str, Callable[..., Any]],
             implementation: str | None,
             preferred: Mapping[str, Sequence[str]], *args, **kwargs) -> Any:
  """Runs `implementations[implementation](*args, **kwargs)`.

  Args:
    op: the op's name, for error messages.
    implementations: name -> callable; must contain "xla".
    implementation: a name, or None for the platform's preference.
    preferred: platform -> names to try in order when `implementation` is
      None; platforms not listed use ("xla",).

  Raises:
    ValueError: unknown implementation name.
    NotImplementedError: the named implementation does not support the call.
  """
  if implementation is None:
    stack = getattr(_OVERRIDE, "stack", [])
    order = (tuple(stack[-1:]) if stack else
             tuple(preferred.get(platform(), ()))) + ("xla",)
    for name in order[:-1]:
      if name not in implementations:
        continue
      try:
        return implementations[name](*args, **kwargs)
      except NotImplementedError:
        continue
    return implementations["xla"](*args, **kwargs)
  if implementation not in implementations:
    raise ValueError(
        f"{op}: unknown implementation {implementation!r}; use one of "
        f"{tuple(implementations)} or None (the platform's default).")
  return implementations[implementation](*args, **kwargs)
