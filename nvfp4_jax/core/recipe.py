"""The training recipe: how each operand of a linear layer's three GEMMs is cast.

A linear layer `Y = X @ W^T` (X: [tokens, in], W: [out, in]) runs three GEMMs:

| GEMM  | operands          | NVFP4 recipe (NVFP4_SPEC section 5)              |
| ----- | ----------------- | ------------------------------------------------ |
| Fprop | X, W              | X 1x16 RTNE; W 16x16 RTNE                        |
| Dgrad | dY, W             | dY 1x16 SR; W the same quantized W as Fprop      |
| Wgrad | dY^T, X^T         | both 1x16 along tokens after a 16-point RHT;     |
|       |                   | dY^T SR, X^T RTNE                                |

`Recipe` says, for each of those six operands, the format, the scaling, the
rounding and whether the RHT is applied. The format "bf16" means "kept in high
precision": the GEMM runs unquantized in the layer's compute dtype (bf16 in the
paper's models; a float32 layer stays float32).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Sequence

import jax
import numpy as np

from nvfp4_jax.core import prng
from nvfp4_jax.core.hadamard import rht_matrix

FORMATS = ("nvfp4", "mxfp4", "mxfp8", "bf16")
FOUR_OVER_SIX_MODES = ("none", "weights", "activations", "all")
RESIDUALS = ("codes", "values")
OPERANDS = ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")
_GEMMS = {"fprop": ("fprop_x", "fprop_w"), "dgrad": ("dgrad_dy", "dgrad_w"),
          "wgrad": ("wgrad_dy", "wgrad_x")}

# What each kind of config field holds, and a value for the message's fix.
_KINDS = {"bool": ("a bool", "True"), "int": ("an int", "16"),
          "number": ("a real number", "0.5"), "str": ("a string", "'...'")}


def _is_kind(value: Any, kind: str) -> bool:
  flag = isinstance(value, (bool, np.bool_))
  if kind == "bool":
    return flag
  if kind == "int":  # bool is an int in Python; a flag is not a count.
    return isinstance(value, numbers.Integral) and not flag
  if kind == "number":
    return isinstance(value, numbers.Real) and not flag
  return isinstance(value, str)


def check_field(owner: str, name: str, value: Any, kind: str, *,
                optional: bool = False, example: Any = None) -> None:
  """Raises a TypeError naming `owner.name`, its value and what to pass.

  The one type check of config fields (`Operand`, `Recipe`, `LateSwitch`,
  `TrainConfig`, `GPTConfig`, ...): a bool is a bool (not the string
  "false", which is truthy), an int an int (not a bool or a float), a
  string a string.

  Args:
    owner: the class or function, e.g. "Operand".
    name: the field.
    value: its value.
    kind: "bool", "int", "number" (an int or a float, not a bool) or "str".
    optional: None is allowed too.
    example: a valid value for the message (default: one per kind).
  """
  if (optional and value is None) or _is_kind(value, kind):
    return
  what, default = _KINDS[kind]
  example = default if example is None else repr(example)
  raise TypeError(
      f"{owner}.{name} must be {what}{' or None' if optional else ''}, got "
      f"{value!r} ({type(value).__name__}); pass e.g. {name}={example}.")


def rule_pairs(rules: Any, what: str, target: str, example: str, *,
               is_target: Callable[[Any], bool]) -> tuple[tuple[Any, Any], ...]:
  """`rules` as a tuple of `(pattern, value)` pairs, or an error that names
  the mistake: a dict (order matters: the first match wins), one pair
  without its enclosing tuple (`(("a", r))` is `("a", r)`: a trailing comma
  is missing), a bare string, an entry that is not a pair.

  The one parser of ordered rule tables: `PrecisionRules.rules` (pattern ->
  Recipe) and `MeshRules.tensor_parallel` (pattern -> style).

  Args:
    rules: what the caller passed.
    what: the argument's name for the messages.
    target: what a pattern maps to, for the messages ("Recipe").
    example: a valid table, for the messages.
    is_target: whether a value is a `target` (tells one bare pair from a
      table of two rules).
  """
  form = f"((pattern, {target}), ...), e.g. {example}"
  if isinstance(rules, dict):
    raise TypeError(
        f"{what} must be an ordered tuple of {form}; got a dict {rules!r}. "
        f"Pass tuple(rules.items()) if its order is the order to match in "
        f"(the first match wins).")
  if isinstance(rules, str):
    raise TypeError(f"{what} must be a tuple of {form}; got the string "
                    f"{rules!r}.")
  try:
    entries = tuple(rules)
  except TypeError:
    raise TypeError(f"{what} must be a tuple of {form}; got "
                    f"{rules!r}.") from None
  if len(entries) == 2 and isinstance(entries[0], str) and is_target(
      entries[1]):
    raise TypeError(
        f"{what} got one pair {entries!r} where a tuple of pairs belongs: "
        f"add the trailing comma, (({entries[0]!r}, ...),).")
  out = []
  for rule in entries:
    if isinstance(rule, (str, bytes)) or not hasattr(rule, "__len__") or (
        len(rule) != 2):
      raise ValueError(f"{what}: a rule is a (pattern, {target}) pair, got "
                       f"{rule!r}; write {form}.")
    out.append(tuple(rule))
  return tuple(out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Operand:
  """How one GEMM operand is quantized.

  Attributes:
    format: "nvfp4", "mxfp4", "mxfp8" or "bf16" (not quantized).
    block_2d: 16x16 tile scales (NVFP4 weights only).
    rounding: "nearest" (RTNE) or "stochastic" (E2M1 formats only).
    rht: apply the Random Hadamard Transform first (Wgrad operands only).
    four_over_six: Four-over-Six adaptive block scaling (NVFP4 only; see
      `nvfp4_jax.quantize`).
  """

  format: str = "nvfp4"
  block_2d: bool = False
  rounding: str = "nearest"
  rht: bool = False
  four_over_six: bool = False

  def __post_init__(self):
    check_field("Operand", "format", self.format, "str", example="nvfp4")
    check_field("Operand", "rounding", self.rounding, "str",
                example="nearest")
    for name in ("block_2d", "rht", "four_over_six"):
      check_field("Operand", name, getattr(self, name), "bool")
    if self.format not in FORMATS:
      raise ValueError(f"unknown format {self.format!r}; use one of {FORMATS}.")
    if self.rounding not in ("nearest", "stochastic"):
      raise ValueError(
          f"unknown rounding {self.rounding!r}; use 'nearest' or 'stochastic'.")
    if self.block_2d and self.format != "nvfp4":
      raise ValueError(
          f"block_2d (16x16 scales) is defined for nvfp4 only, not "
          f"{self.format!r}.")
    if self.rounding == "stochastic" and self.format not in ("nvfp4", "mxfp4"):
      raise ValueError(
          f"stochastic rounding is defined for E2M1 formats (nvfp4, mxfp4), "
          f"not {self.format!r}.")
    if self.four_over_six and self.format != "nvfp4":
      raise ValueError(
          f"four_over_six is an NVFP4 block scaling, not defined for "
          f"{self.format!r}; set four_over_six=False.")
    if self.rht and self.format == "bf16":
      raise ValueError("rht on a bf16 (unquantized) operand has no effect; "
                       "set rht=False.")

  @property
  def quantized(self) -> bool:
    """Whether this operand is quantized (its format is not "bf16")."""
    return self.format != "bf16"


_HP = Operand(format="bf16")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Recipe:
  """Per-operand quantization of a linear layer's Fprop, Dgrad and Wgrad GEMMs.

  Build it from a preset (`Recipe.nvfp4()`, `Recipe.bf16()`, ...) or field by
  field. Within one GEMM both operands are quantized to the same format or both
  kept in high precision; the RHT is applied to both Wgrad operands or neither
  (the transform only cancels when both sides carry it).

  Attributes:
    fprop_x, fprop_w, dgrad_dy, dgrad_w, wgrad_dy, wgrad_x: `Operand`s.
    rht_size: Hadamard size of the Wgrad RHT (16 in the recipe).
    rht_sign_vector: its sign vector; None = `default_sign_vector(rht_size)`.
    residuals: how the forward pass saves the quantized operands the
      backward pass multiplies (Wgrad's `q(rht(X^T))`, and Dgrad's weight
      where it is Fprop's): "codes" (4.5 bits per element; decoded by a
      dequantize pass before the emulated GEMM) or "values" (their exact
      bf16 block values, 16 bits per element, multiplied as they are: no
      dequantize pass). The numbers are the same; "values" trades activation
      memory for speed, and applies where the GEMM is the exact emulation
      (Hopper, CPU) and to NVFP4 operands. Where a native FP4 GEMM runs
      (Blackwell) the codes are saved and a `UserWarning` says so: the
      choice is resolved once per layer call, against the GEMM backend
      (`nvfp4_jax.training.dot_general.saved_residuals`).
    name: a label for tables and plots.
  """

  fprop_x: Operand = _HP
  fprop_w: Operand = _HP
  dgrad_dy: Operand = _HP
  dgrad_w: Operand = _HP
  wgrad_dy: Operand = _HP
  wgrad_x: Operand = _HP
  rht_size: int = 16
  rht_sign_vector: tuple[int, ...] | None = None
  residuals: str = "codes"
  name: str = "custom"

  def __post_init__(self):
    for op in OPERANDS:
      if not isinstance(getattr(self, op), Operand):
        raise TypeError(f"Recipe.{op} must be an Operand, got "
                        f"{getattr(self, op)!r} "
                        f"({type(getattr(self, op)).__name__}); pass e.g. "
                        f"{op}=Operand(format='nvfp4').")
    check_field("Recipe", "rht_size", self.rht_size, "int")
    check_field("Recipe", "residuals", self.residuals, "str", example="codes")
    check_field("Recipe", "name", self.name, "str", example="my-recipe")
    for gemm, (a, b) in _GEMMS.items():
      fa, fb = getattr(self, a).format, getattr(self, b).format
      if fa != fb:
        raise ValueError(
            f"{gemm}: both operands must use the same format, got {a}={fa!r} "
            f"and {b}={fb!r}.")
    for op in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w"):
      if getattr(self, op).rht:
        raise ValueError(f"rht applies to the Wgrad operands only, not {op}.")
    if self.wgrad_dy.rht != self.wgrad_x.rht:
      raise ValueError("rht must be set on both Wgrad operands or neither.")
    for op in ("fprop_x", "dgrad_dy", "wgrad_dy", "wgrad_x"):
      if getattr(self, op).block_2d:
        raise ValueError(f"block_2d applies to weights only, not {op}.")
    if self.rht_sign_vector is not None:
      object.__setattr__(self, "rht_sign_vector", tuple(self.rht_sign_vector))
    rht_matrix(self.rht_sign_vector, self.rht_size)  # Validates both.
    if self.residuals not in RESIDUALS:
      raise ValueError(
          f"unknown residuals {self.residuals!r}; use 'codes' (4.5 bits per "
          f"saved element) or 'values' (bf16 block values: no dequantize "
          f"pass in the backward pass, 16 bits per saved element).")

  def __repr__(self) -> str:
    gemms = ", ".join(t.replace(",", "/") for t in self.tag.split(" "))
    saved = "" if self.residuals == "codes" else f"; {self.residuals}"
    return f"Recipe({self.name!r}: {gemms}{saved})"

  @property
  def tag(self) -> str:
    """Per-GEMM operand formats in one line without "/" (for name scopes):
    "fprop=nvfp4,nvfp4-16x16 dgrad=nvfp4-sr,nvfp4-16x16 wgrad=..."."""
    def fmt(op: Operand) -> str:
      tags = [op.format]
      if op.block_2d:
        tags.append("16x16")
      if op.rounding == "stochastic":
        tags.append("sr")
      if op.rht:
        tags.append(f"rht{self.rht_size}")
      if op.four_over_six:
        tags.append("4o6")
      return "-".join(tags)
    return " ".join(f"{g}={fmt(getattr(self, a))},{fmt(getattr(self, b))}"
                    for g, (a, b) in _GEMMS.items())

  def gemm_format(self, gemm: str) -> str:
    """The format of "fprop", "dgrad" or "wgrad"."""
    return getattr(self, _GEMMS[gemm][0]).format

  @property
  def quantized(self) -> bool:
    """Whether any GEMM is quantized."""
    return any(self.gemm_format(g) != "bf16" for g in _GEMMS)

  @property
  def needs_key(self) -> bool:
    """Whether any operand uses stochastic rounding."""
    return any(getattr(self, op).rounding == "stochastic" for op in OPERANDS)

  @property
  def forward_needs_key(self) -> bool:
    """Whether an operand quantized in the forward pass rounds stochastically
    (X or the weight: then the forward pass itself needs a key)."""
    return any(getattr(self, op).rounding == "stochastic"
               for op in ("fprop_x", "fprop_w", "wgrad_x"))

  def operand_keys(self, key: jax.Array | None
                   ) -> dict[str, jax.Array | None]:
    """The stochastic-rounding key of every operand; None where it rounds to
    nearest (or no key is given). The one place a layer's key is split.

    One threefry call draws every operand's seed words: operand `OPERANDS[i]`
    gets the seeds key (`prng.seeds_key`) of `jax.random.bits(key, (6, 2),
    uint32)[i]`, whether or not the others round stochastically.
    """
    if key is None or not self.needs_key:
      return dict.fromkeys(OPERANDS)
    keys = dict(zip(OPERANDS, prng.operand_seeds(key, len(OPERANDS))))
    return {op: keys[op] if getattr(self, op).rounding == "stochastic"
            else None for op in OPERANDS}

  def replace(self, **changes) -> "Recipe":
    """This recipe with the given fields changed (`dataclasses.replace`)."""
    return dataclasses.replace(self, **changes)

  def with_bf16_forward(self) -> "Recipe":
    """This recipe with its Fprop GEMM in high precision (the late switch)."""
    return self.replace(fprop_x=_HP, fprop_w=_HP,
                        name=f"{self.name}+bf16_fwd")

  # Presets -----------------------------------------------------------------

  @classmethod
  def nvfp4(cls, *, rht: bool = True, stochastic_rounding: bool = True,
            two_d_weights: bool = True, rht_size: int = 16,
            rht_sign_vector: Sequence[int] | None = None,
            four_over_six: str | bool = "none",
            residuals: str = "codes") -> "Recipe":
    """The paper's NVFP4 recipe (NVFP4_SPEC section 5).

    Args:
      rht: RHT on the Wgrad operands (TE: `not disable_rht`).
      stochastic_rounding: SR on the gradient operands (TE: `not
        disable_stochastic_rounding`).
      two_d_weights: 16x16 weight scales (TE: `not disable_2d_quantization`).
      rht_size: Hadamard size (16 in the paper).
      rht_sign_vector: RHT signs; default TE's vector.
      four_over_six: Four-over-Six block scaling on "none", "weights",
        "activations" (X and dY) or "all" operands (True: "all").
      residuals: "codes" or "values" (see `Recipe`).
    """
    for name, value in (("rht", rht), ("stochastic_rounding",
                                       stochastic_rounding),
                        ("two_d_weights", two_d_weights)):
      check_field("Recipe.nvfp4", name, value, "bool")
    fos = four_over_six
    if isinstance(fos, (bool, np.bool_)):
      fos = "all" if fos else "none"
    if not isinstance(fos, str) or fos not in FOUR_OVER_SIX_MODES:
      raise ValueError(f"four_over_six={four_over_six!r}; use one of "
                       f"{FOUR_OVER_SIX_MODES} (or True/False).")
    on_w, on_a = fos in ("weights", "all"), fos in ("activations", "all")
    grad_round = "stochastic" if stochastic_rounding else "nearest"
    w = Operand(format="nvfp4", block_2d=two_d_weights, four_over_six=on_w)
    return cls(
        fprop_x=Operand(format="nvfp4", four_over_six=on_a), fprop_w=w,
        dgrad_dy=Operand(format="nvfp4", rounding=grad_round,
                         four_over_six=on_a), dgrad_w=w,
        wgrad_dy=Operand(format="nvfp4", rounding=grad_round, rht=rht,
                         four_over_six=on_a),
        wgrad_x=Operand(format="nvfp4", rht=rht, four_over_six=on_a),
        rht_size=rht_size, rht_sign_vector=rht_sign_vector,
        residuals=residuals,
        name="nvfp4" if fos == "none" else f"nvfp4-4o6-{fos}")

  @classmethod
  def bf16(cls) -> "Recipe":
    """Every GEMM in high precision: the layer is exactly `nn.Dense`."""
    return cls(name="bf16")

  @classmethod
  def bf16_forward(cls, **nvfp4_kwargs) -> "Recipe":
    """BF16 Fprop, NVFP4 Dgrad and Wgrad: the paper's forward-only late switch."""
    return cls.nvfp4(**nvfp4_kwargs).with_bf16_forward()

  @classmethod
  def mxfp4(cls, *, stochastic_rounding: bool = True) -> "Recipe":
    """MXFP4 everywhere (blocks of 32, UE8M0 scales), SR on gradients."""
    check_field("Recipe.mxfp4", "stochastic_rounding", stochastic_rounding,
                "bool")
    grad_round = "stochastic" if stochastic_rounding else "nearest"
    q = Operand(format="mxfp4")
    g = Operand(format="mxfp4", rounding=grad_round)
    return cls(fprop_x=q, fprop_w=q, dgrad_dy=g, dgrad_w=q, wgrad_dy=g,
               wgrad_x=q, name="mxfp4")

  @classmethod
  def mxfp8(cls) -> "Recipe":
    """MXFP8 (E4M3, blocks of 32, UE8M0 scales) in all three GEMMs."""
    q = Operand(format="mxfp8")
    return cls(fprop_x=q, fprop_w=q, dgrad_dy=q, dgrad_w=q, wgrad_dy=q,
               wgrad_x=q, name="mxfp8")

  @classmethod
  def from_name(cls, name: str) -> "Recipe":
    """A preset by name: "nvfp4", "bf16", "bf16_forward", "mxfp4", "mxfp8"."""
    presets = {"nvfp4": cls.nvfp4, "bf16": cls.bf16,
               "bf16_forward": cls.bf16_forward, "mxfp4": cls.mxfp4,
               "mxfp8": cls.mxfp8}
    if not isinstance(name, str) or name not in presets:
      raise ValueError(
          f"unknown recipe {name!r}; use one of {sorted(presets)} (or build "
          f"a Recipe, e.g. Recipe.nvfp4(rht=False)).")
    return presets[name]()


PRESET_NAMES = ("nvfp4", "bf16", "bf16_forward", "mxfp4", "mxfp8")


def as_recipe(recipe: Any, prefix: str = "", name: str = "recipe"
              ) -> Recipe | None:
  """A layer's or op's `recipe=` argument as a `Recipe` (None stays None).

  `prefix` starts the error message (e.g. "layer 'mlp/up': "); `name` is
  the argument's name. Accepts a `Recipe` or a preset's name ("nvfp4", "bf16", "bf16_forward",
  "mxfp4", "mxfp8": `Recipe.from_name`), the one place such an argument is
  resolved.

  Raises:
    ValueError: an unknown preset name.
    TypeError: anything else, naming the value and how to pass a recipe.
  """
  if recipe is None or isinstance(recipe, Recipe):
    return recipe
  if isinstance(recipe, str):
    if recipe not in PRESET_NAMES:
      raise ValueError(
          f"{prefix}{name}={recipe!r} is not a recipe preset; use one of "
          f"{PRESET_NAMES} or a Recipe (e.g. Recipe.nvfp4(rht=False)).")
    return Recipe.from_name(recipe)
  raise TypeError(
      f"{prefix}{name} must be a Recipe or a preset name {PRESET_NAMES}, "
      f"got {recipe!r} ({type(recipe).__name__}); pass e.g. "
      f"{name}=Recipe.nvfp4() or {name}='bf16'.")
