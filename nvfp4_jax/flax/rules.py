"""Per-layer precision rules: module-path regex -> Recipe, first match wins.

    rules = nvfp4_jax.PrecisionRules(
        rules=((r"block_(0|1)/", nvfp4_jax.Recipe.bf16()),),
        default=nvfp4_jax.Recipe.nvfp4(),
        late_switch=nvfp4_jax.LateSwitch(step=9000, mode="forward"))
    print(rules.resolve(params))          # which recipe each layer runs

    def loss_fn(params, batch, step, key):
      with nvfp4_jax.precision_rules(rules, step=step):
        logits = model.apply({"params": params}, batch,
                             rngs={"nvfp4": jax.random.fold_in(key, step)})

A layer's path is its module names joined by "/" ("block_3/mlp/up"); patterns
use `re.search`. Embeddings, the output head, norms and attention's batched
GEMMs are not NVFP4 layers and stay in high precision by construction.

The late switch (paper Appendix D) moves every quantized layer to BF16 -- or
only its forward GEMM -- from a given step. The step is a traced value and the
layers select with `lax.cond`, so the switch never recompiles the train step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Iterable, Iterator

import jax

from nvfp4_jax.core.recipe import Recipe
from nvfp4_jax.core.recipe import check_field
from nvfp4_jax.core.recipe import rule_pairs
from nvfp4_jax.core.scope import ScopeStack

SWITCH_MODES = ("all", "forward")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LateSwitch:
  """Switch quantized layers to high precision from `step` on.

  Attributes:
    step: the first step that runs in high precision.
    mode: "all" (every GEMM of the layer in BF16) or "forward" (only Fprop in
      BF16, the backward GEMMs stay quantized).
  """

  step: int
  mode: str = "all"

  def __post_init__(self):
    if (not isinstance(self.step, int) or isinstance(self.step, bool)
        or self.step < 0):
      raise ValueError(f"LateSwitch.step must be an int >= 0, got "
                       f"{self.step!r}; pass e.g. step=9000.")
    check_field("LateSwitch", "mode", self.mode, "str", example="forward")
    if self.mode not in SWITCH_MODES:
      raise ValueError(
          f"unknown LateSwitch mode {self.mode!r}; use one of {SWITCH_MODES}.")

  def apply(self, recipe: Recipe) -> Recipe:
    """The recipe a layer running `recipe` switches to."""
    if not recipe.quantized:
      return recipe
    return Recipe.bf16() if self.mode == "all" else recipe.with_bf16_forward()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrecisionRules:
  """Ordered precision rules for NVFP4 layers.

  Attributes:
    rules: `(pattern, Recipe)` pairs; the first pattern that `re.search`es a
      layer's path decides its recipe.
    default: the recipe of layers no rule matches.
    late_switch: optional `LateSwitch` schedule.
  """

  rules: tuple[tuple[str, Recipe], ...] = ()
  default: Recipe = Recipe.nvfp4()
  late_switch: LateSwitch | None = None

  def __post_init__(self):
    rules = rule_pairs(self.rules, "PrecisionRules.rules", "Recipe",
                       "((r'block_0/', Recipe.bf16()),)",
                       is_target=lambda v: isinstance(v, Recipe))
    for pattern, recipe in rules:
      try:
        re.compile(pattern)
      except (re.error, TypeError) as e:
        raise ValueError(f"bad rule pattern {pattern!r}: {e}") from None
      if not isinstance(recipe, Recipe):
        raise TypeError(
            f"rule {pattern!r} maps to {type(recipe).__name__} {recipe!r}, "
            f"not a Recipe; use e.g. Recipe.bf16() (a preset by name: "
            f"Recipe.from_name('bf16')).")
    if not isinstance(self.default, Recipe):
      raise TypeError(f"default must be a Recipe, got {self.default!r}.")
    if self.late_switch is not None and not isinstance(self.late_switch,
                                                       LateSwitch):
      raise TypeError(f"late_switch must be a LateSwitch, got "
                      f"{self.late_switch!r}.")
    object.__setattr__(self, "rules", rules)

  @classmethod
  def high_precision(cls) -> "PrecisionRules":
    """Every NVFP4 layer in high precision (each is then exactly `nn.Dense`)."""
    return cls(default=Recipe.bf16())

  def match(self, path: str) -> int | None:
    """Index of the first rule matching `path`, or None."""
    for i, (pattern, _) in enumerate(self.rules):
      if re.search(pattern, path):
        return i
    return None

  def recipe_for(self, path: str) -> Recipe:
    """The recipe (before any late switch) of the layer at `path`."""
    i = self.match(path)
    return self.default if i is None else self.rules[i][1]

  def recipe_at(self, path: str, step: int | None = None, *,
                recipe: Recipe | None = None) -> Recipe:
    """The recipe the layer at `path` runs at a concrete training `step`.

    The one place that combines the rules with the late switch: layers (which
    select between `recipe_at(path)` and `recipe_at(path, switch.step)` with a
    `lax.cond` on the traced step), the trainer's diagnostics and reports all
    call it.

    Args:
      path: the layer's module path.
      step: the step; None means "before any late switch".
      recipe: the layer's own recipe, overriding the rules' choice for it (the
        late switch still applies).
    """
    if recipe is None:
      recipe = self.recipe_for(path)
    switch = self.late_switch
    if switch is None or step is None or step < switch.step:
      return recipe
    return switch.apply(recipe)

  def unused_rules(self, paths: Iterable[str]) -> list[str]:
    """Patterns that decide no layer among `paths` (shadowed ones included)."""
    used = {self.match(p) for p in paths}
    return [pat for i, (pat, _) in enumerate(self.rules) if i not in used]

  def resolve(self, params: Any, *, layer_paths: Iterable[str] | None = None,
              strict: bool = True) -> Any:
    """The recipe of every layer, as a pytree shaped like `params`.

    Args:
      params: a model's parameters (a nested dict, a top-level "params"
        collection is unwrapped; or an NNX `nnx.State`).
      layer_paths: the paths of the layers the library runs (from tracing:
        `nvfp4_layer_paths`, or the keys `inject_nnx` returns). Without them
        every sub-dict holding a 2-D "kernel" counts as one -- a guess that
        never counts convolutions (their kernels have 3 or more dims) but
        misses `DenseGeneral`/`Einsum` kernels and counts heads whose sizes
        cannot be quantized.
      strict: raise if a rule matches no layer.

    Returns:
      A nested dict with `params`' structure: each leaf of an NVFP4 layer is
      replaced by that layer's `Recipe`, every other leaf by None (high
      precision by construction).

    Raises:
      ValueError: with `strict`, naming the rules that matched nothing.
    """
    if hasattr(params, "to_pure_dict"):  # nnx.State
      params = params.to_pure_dict()
    if isinstance(params, dict) and set(params) == {"params"}:
      params = params["params"]
    params = jax.tree_util.tree_map(lambda x: x, params)  # FrozenDict -> dict.
    layers = (set(_kernel_paths(params)) if layer_paths is None
              else set(layer_paths))
    if strict:
      unused = self.unused_rules(layers)
      if unused:
        raise ValueError(
            f"precision rules matched no layer: {unused}. Layer paths look "
            f"like {sorted(layers)[:4]}; fix the patterns or pass "
            f"strict=False.")

    def walk(node, path):
      if isinstance(node, dict):
        is_layer = path in layers
        return {k: (self.recipe_for(path) if is_layer and not isinstance(v, dict)
                    else walk(v, f"{path}/{k}" if path else k))
                for k, v in node.items()}
      return None
    return walk(params, "")

  def summary(self, params: Any, **kwargs) -> str:
    """A printable table: layer path -> recipe name (before a late switch).

    Takes `resolve`'s arguments; pass `layer_paths` from tracing to list
    exactly the layers the library runs.
    """
    resolved = self.resolve(params, **kwargs)
    rows = []

    def walk(node, path):
      for k, v in node.items():
        if isinstance(v, dict):
          walk(v, f"{path}/{k}" if path else k)
        elif isinstance(v, Recipe) and k == "kernel":
          rows.append((path, v.name))
    walk(resolved, "")
    width = max((len(p) for p, _ in rows), default=4)
    return "\n".join(f"{p:<{width}}  {n}" for p, n in rows)


def _kernel_paths(params: Any, path: str = "") -> Iterator[str]:
  if isinstance(params, dict):
    if getattr(params.get("kernel"), "ndim", None) == 2:
      yield path
    for k, v in params.items():
      if isinstance(v, dict):
        yield from _kernel_paths(v, f"{path}/{k}" if path else k)


def paper_rules(num_blocks: int, *, first: int = 2, last_fraction: float = 0.15,
                block_name: str = "block_{}", recipe: Recipe | None = None,
                late_switch: LateSwitch | None = None) -> PrecisionRules:
  """The paper's selective precision: first and last blocks in BF16.

  The paper keeps the first 2 and the last 8 of 62 blocks in BF16; this keeps
  the first `first` and the last `ceil(last_fraction * num_blocks)` blocks.

  Args:
    num_blocks: number of transformer blocks, named `block_name.format(i)`.
    first: leading blocks in BF16.
    last_fraction: fraction of trailing blocks in BF16.
    block_name: module-name template of the blocks, with one `{}` for the
      block index ("block_{}", "encoderblock_{}").
    recipe: the recipe of every other layer (default `Recipe.nvfp4()`).
    late_switch: optional `LateSwitch`.

  Returns:
    The `PrecisionRules`: one rule giving those blocks `Recipe.bf16()` (none
    if no block is kept), `recipe` as the default.

  Raises:
    TypeError: an argument of the wrong type.
    ValueError: out-of-range counts, or a `block_name` without exactly one
      `{}` (it would name the same module for every block).
  """
  check_field("paper_rules", "num_blocks", num_blocks, "int", example=12)
  check_field("paper_rules", "first", first, "int", example=2)
  check_field("paper_rules", "last_fraction", last_fraction, "number",
              example=0.15)
  check_field("paper_rules", "block_name", block_name, "str",
              example="block_{}")
  try:
    names_ok = block_name.format(0) != block_name.format(1)
  except (IndexError, KeyError, ValueError):
    names_ok = False
  if not names_ok:
    stem = re.sub(r"[{}]", "", block_name).rstrip("_") or "block"
    raise ValueError(
        f"paper_rules: block_name={block_name!r} must hold one '{{}}' where "
        f"the block index goes, e.g. {stem + '_{}'!r} for modules named "
        f"like {stem + '_3'!r}; "
        f"without it every rule names the same module and no block stays in "
        f"BF16.")
  if num_blocks < 1 or first < 0 or not 0 <= last_fraction <= 1:
    raise ValueError(
        f"paper_rules needs num_blocks >= 1, first >= 0 and last_fraction in "
        f"[0, 1]; got {num_blocks}, {first}, {last_fraction}.")
  last = math.ceil(last_fraction * num_blocks - 1e-9)
  hp = sorted(set(range(min(first, num_blocks)))
              | set(range(num_blocks - last, num_blocks)))
  rules = []
  if hp:
    names = "|".join(re.escape(block_name.format(i)) for i in hp)
    rules.append((f"(^|/)({names})(/|$)", Recipe.bf16()))
  default = {} if recipe is None else {"default": recipe}
  return PrecisionRules(rules=tuple(rules), late_switch=late_switch, **default)


# ----------------------------------------------------------------------------
# The rules in scope while a model is traced.
# ----------------------------------------------------------------------------

_SCOPE: ScopeStack["_Scope"] = ScopeStack()


@dataclasses.dataclass(frozen=True)
class _Scope:
  rules: PrecisionRules
  step: Any


@contextlib.contextmanager
def precision_rules(rules: PrecisionRules, *, step: Any = None):
  """Makes `rules` govern the NVFP4 layers traced inside the block.

  Use it inside the (jitted) function that applies the model, so the rules are
  part of what is traced.

  Args:
    rules: the `PrecisionRules`.
    step: the training step (a traced int32 or a Python int). Needed by a
      `late_switch`, and it also seeds the stochastic rounding of layers that
      get no "nvfp4" RNG stream.

  Yields:
    `rules`.

  Raises:
    TypeError: `rules` is not a `PrecisionRules`.
  """
  if not isinstance(rules, PrecisionRules):
    raise TypeError(f"precision_rules needs PrecisionRules, got {rules!r}.")
  with _SCOPE.push(_Scope(rules, step)):
    yield rules


def current_scope() -> _Scope | None:
  """The innermost `precision_rules` scope, or None."""
  return _SCOPE.current()
