"""Walking a traced program equation by equation, once per call site.

`str(jaxpr)` prints a sub-program that several equations share (a jitted
function called with the same shapes and settings, e.g. the NVFP4 layer of
every block: `dot_general`'s `_layer`) once, so counting names in the text
counts distinct programs, not calls. These helpers visit a shared
sub-program at each equation that calls it.
"""

from __future__ import annotations

import collections
from typing import Iterator

import jax
from jax.extend.core import jaxprs_in_params


def eqns(jaxpr) -> Iterator:
  """Every equation of `jaxpr` (a Jaxpr or ClosedJaxpr) and of its
  sub-programs, a sub-program's once per equation that holds it."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for sub in jaxprs_in_params(eqn.params):
      yield from eqns(sub)


def jit_names(fn, *args) -> collections.Counter:
  """How many times each jitted function (by name) is called in the program
  `fn(*args)` traces to, counted per call site."""
  return collections.Counter(
      str(e.params["name"]) for e in eqns(jax.make_jaxpr(fn)(*args))
      if e.primitive.name in ("jit", "pjit"))
