"""Running the grouped Triton kernels in Triton 3.6's interpreter (no GPU).

`TRITON_INTERPRET=1` runs a `triton.jit` function on NumPy, but as shipped
it takes torch tensors, multiplies bf16 operands as their raw bit patterns,
cannot loop over a loaded bound, cannot see helpers defined in a closure,
runs Triton's jit'd library functions only if it was on when triton was
imported, and has no `tl.dot_scaled`. `kernels(monkeypatch)` patches those (undone
with the test): arguments are `Arr`s (NumPy arrays as device pointers), bf16
dots widen to FP32 (exact), and `tl.dot_scaled` is computed from its
documented semantics: `lhs [M, K/2]` and `rhs [K/2, N]` E2M1 packed along K
(element `2k` in the low nibble) or `[M, K]`, `[K, N]` E4M3, with scales
`[M, K/s]` and `[N, K/s]`: E4M3 (NVFP4) or, as uint8, E8M0 `2^(b - 127)`
(MX), the block size `s` from the scales' shape.
So the kernels' pointers, masks, tile-to-group map and epilogue, and the
operand layout they hand `tl.dot_scaled`, are checked against the reference
offline; the hardware's MMA is not.
"""

from __future__ import annotations

import numpy as np

_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6,
                  -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float64)


class Arr:
  """A NumPy array passed as a pointer (`dtype`: torch's name of its type,
  which Triton's signature mangling reads)."""

  def __init__(self, a, dtype: str):
    self.a = np.ascontiguousarray(a)
    self.dtype = f"torch.{dtype}"

  def data_ptr(self) -> int:
    return self.a.ctypes.data


def kernels(monkeypatch):
  """`(grouped_kernel, grouped_t_kernel)` of `ops/ragged_dot/triton.py`,
  interpreted."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top
  import triton  # pylint: disable=g-import-not-at-top
  import triton.language as tl  # pylint: disable=g-import-not-at-top
  from triton.runtime import interpreter as ti  # pylint: disable=g-import-not-at-top
  from nvfp4_jax.ops.ragged_dot import triton as module  # pylint: disable=g-import-not-at-top
  del triton
  monkeypatch.setenv("TRITON_INTERPRET", "1")
  ex = ti.GridExecutor
  monkeypatch.setattr(ex, "_init_args_hst",
                      lambda self, args, kwargs: (list(args), dict(kwargs)))
  monkeypatch.setattr(ex, "_restore_args_dev", lambda self, *a, **k: None)

  def f32(h):
    return ti.TensorHandle(ti._convert_float(  # pylint: disable=protected-access
        h.data, h.dtype, tl.float32, None).view(np.float32), tl.float32)
  dot = ti.InterpreterBuilder.create_dot

  def create_dot(self, a, b, d, *rest):
    if a.dtype == tl.bfloat16:
      a, b = f32(a), f32(b)
    return dot(self, a, b, d, *rest)
  monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)

  from triton._C.libtriton import ir  # pylint: disable=g-import-not-at-top
  e2m1 = ir.ScaleDotElemTypeTY.E2M1

  def create_dot_scaled(self, lhs, lhs_scale, lhs_fmt, rhs, rhs_scale,
                        rhs_fmt, fast_math, lhs_k_pack, rhs_k_pack, acc):
    del self, fast_math, lhs_k_pack, rhs_k_pack
    assert lhs_fmt == rhs_fmt
    a = np.asarray(lhs.data).view(np.uint8)
    b = np.asarray(rhs.data).view(np.uint8)
    if lhs_fmt == e2m1:
      av = np.stack([_E2M1[a & 15], _E2M1[a >> 4]], -1).reshape(a.shape[0],
                                                                  -1)
      bv = np.stack([_E2M1[b & 15], _E2M1[b >> 4]], 1).reshape(-1,
                                                                b.shape[1])
    else:  # E4M3 bytes.
      e4m3 = lambda x: x.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
      av, bv = e4m3(a), e4m3(b)

    def dec(s):
      b = np.asarray(s.data).view(np.uint8)
      if s.get_element_ty() == tl.uint8:  # E8M0 (fp8 is stored as uint8 too).
        return np.where(b == 255, np.nan, np.exp2(b.astype(np.float64) - 127))
      return b.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    block = av.shape[1] // np.asarray(lhs_scale.data).shape[1]
    sa = np.repeat(dec(lhs_scale), block, axis=1)
    sb = np.repeat(dec(rhs_scale), block, axis=1).T
    out = (av * sa) @ (bv * sb) + acc.data.astype(np.float64)
    return ti.TensorHandle(out.astype(np.float32), acc.dtype.scalar)
  monkeypatch.setattr(ti.InterpreterBuilder, "create_dot_scaled",
                      create_dot_scaled, raising=False)
  dot_scaled = ti.TritonSemantic.dot_scaled

  def semantic_dot_scaled(self, lhs, ls, lf, rhs, rs, rf, *rest):
    c = lambda f: tl.constexpr(f) if isinstance(f, str) else f
    return dot_scaled(self, lhs, ls, c(lf), rhs, rs, c(rf), *rest)
  monkeypatch.setattr(ti.TritonSemantic, "dot_scaled", semantic_dot_scaled)
  set_attr = ti._LangPatchScope.set_attr  # pylint: disable=protected-access

  def patched_set_attr(self, obj, name, value):
    if name == "__index__":  # A loaded scalar is a 1-element array.
      value = lambda t: int(np.asarray(t.handle.data).reshape(-1)[0])
    return set_attr(self, obj, name, value)
  monkeypatch.setattr(ti._LangPatchScope, "set_attr", patched_set_attr)  # pylint: disable=protected-access
  # Triton's own jit'd library functions (tl.zeros, tl.cdiv, ...) were made
  # when triton was imported, perhaps before TRITON_INTERPRET: interpreted.
  from triton.language import standard  # pylint: disable=g-import-not-at-top
  from triton.runtime.jit import JITFunction  # pylint: disable=g-import-not-at-top
  for mod in (tl, standard):
    for name in dir(mod):
      if isinstance(getattr(mod, name), JITFunction):
        monkeypatch.setattr(mod, name,
                            ti.InterpretedFunction(getattr(mod, name).fn))
  fk, tk = module._kernels.__wrapped__()  # pylint: disable=protected-access
  # The helpers the kernels call (closure variables), where the interpreter
  # looks them up: the module's globals.
  fns = [fk.fn, tk.fn]
  while fns:
    fn = fns.pop()
    for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
      monkeypatch.setattr(module, name, cell.cell_contents, raising=False)
      if hasattr(cell.cell_contents, "fn"):
        fns.append(cell.cell_contents.fn)
  return fk, tk
