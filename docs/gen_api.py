"""Writes docs/api.md from the groups of `nvfp4_jax.__all__`.

Run after changing `__all__`: `JAX_PLATFORMS=cpu python docs/gen_api.py`
(tests/docs/test_docs.py checks that api.md lists every public name in order).
"""

import importlib
import inspect
import pathlib
import sys
import types

R = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(R))
import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top,wrong-import-position
src = (R/'nvfp4_jax/__init__.py').read_text()
body = src[src.index('__all__ = ('):src.index('\n)\n')]
groups = []; comment = []
for l in body.splitlines()[1:]:
  s = l.strip()
  if s.startswith('#'):
    if groups and not groups[-1][1] :
      groups[-1][0].append(s[1:].strip())
    else:
      groups.append(([s[1:].strip()], []))
  elif s:
    groups[-1][1].append(s.strip('",'))
DATA = {
  'RNG_STREAM': ('The RNG stream linen layers draw their stochastic-rounding keys from (`rngs={"nvfp4": key}`).',),
  'E2M1_MAX': ('The largest E2M1 magnitude.',),
  'E2M1_VALUES': ('The values of the 16 E2M1 codes, code `i` at index `i` (float32; codes 8-15 are the negatives, 8 is -0).', 'numpy.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6])'),
  'E4M3_MAX': ('The largest E4M3 magnitude, the clamp of the block scales.',),
  'MX_BLOCK': ('The block size of the MX formats (MXFP4, MXFP8): 32 elements share an E8M0 scale.',),
  'NVFP4_BLOCK': ('The block size of NVFP4: 16 elements share an E4M3 scale (16x16 tiles for 2D weights).',),
  'TE_SIGN_VECTOR_16': ("TransformerEngine's default sign vector of the 16-point RHT, shared by all layers.",),
}
MODULE_MEMBERS = {
  'export': ['save', 'load', 'apply', 'generate', 'quantized_weights'],
  # Its `__all__`, less the objects `nv.__all__` documents at the top.
  'sharding': [m for m in nv.sharding.__all__
               if getattr(nv, m, None) is not getattr(nv.sharding, m)],
}
MODULE_DATA = {
  'AXES': 'The mesh axes `MeshRules` knows: data parallelism, FSDP, tensor parallelism.',
  'TENSOR_STYLES': "A tensor-parallel layer's styles: Megatron's column (output features split) and row (input features split).",
  'GPT_TENSOR_PARALLEL': "The GPT's tensor-parallel layout, `(path regex, style)` pairs: Megatron's column/row pairs of attention and the MLP.",
}
TITLES = {
  'Layers': 'Layers', 'Quantized arrays.': 'Quantized arrays', 'Ops:': 'Ops',
  'Training:': 'Training', 'Recipe': 'Recipe and precision rules', 'Sharding:': 'Sharding',
  'Numerics:': 'Numerics', 'Tools:': 'Tools',
}
out = ["# API reference\n\n",
       "The public API, `import nvfp4_jax as nv`: every name of `nv.__all__`,\n",
       "grouped as `nvfp4_jax/__init__.py` groups it. The pages on each topic show\n",
       "the names in use.\n\n"]
for desc, names in groups:
  d = ' '.join(desc)
  title = next(v for k, v in TITLES.items() if d.startswith(k))
  out.append(f"## {title}\n\n{d[0].upper() + d[1:]}\n\n```{{eval-rst}}\n.. currentmodule:: nvfp4_jax\n\n.. autosummary::\n\n")
  out += [f"   {n}\n" for n in names]
  out.append("```\n\n")
  for n in names:
    obj = getattr(nv, n)
    if isinstance(obj, types.ModuleType):
      doc = (inspect.getdoc(obj) or '').split('\n\n')[0]
      out.append(f"### `nvfp4_jax.{n}`\n\n{doc}\n\n")
      out.append(f"```{{eval-rst}}\n.. currentmodule:: nvfp4_jax.{n}\n\n.. autosummary::\n\n")
      out += [f"   {m}\n" for m in MODULE_MEMBERS[n]]
      out.append("\n")
      for m in MODULE_MEMBERS[n]:
        o = getattr(obj, m)
        if m in MODULE_DATA:
          out.append(f".. py:data:: nvfp4_jax.{n}.{m}\n   :value: {o!r}\n\n   {MODULE_DATA[m]}\n\n")
          continue
        kind = 'autoclass' if inspect.isclass(o) else 'autofunction'
        out.append(f".. {kind}:: nvfp4_jax.{n}.{m}\n" + ("   :members:\n" if kind == 'autoclass' else '') + "\n")
      out.append(".. currentmodule:: nvfp4_jax\n```\n\n")
      continue
    if inspect.isclass(obj):
      out.append(f"```{{eval-rst}}\n.. autoclass:: {n}\n   :members:\n```\n\n")
    elif callable(obj):
      out.append(f"```{{eval-rst}}\n.. autofunction:: {n}\n```\n\n")
    else:
      value = DATA[n][1] if len(DATA[n]) > 1 else repr(obj)
      out.append(f"```{{eval-rst}}\n.. py:data:: {n}\n   :value: {value}\n\n   {DATA[n][0]}\n```\n\n")
SUBPACKAGES = ('core', 'ops', 'training', 'flax', 'tools')
out.append("## Subpackages\n\nThe library's layers, lowest first (the layout: [layout](layout.md)). "
           "Their public names are the ones above; each subpackage's `__all__` lists "
           "its modules, named here for readers of the source and of tracebacks.\n\n")
for sub in SUBPACKAGES:
  pkg = importlib.import_module(f'nvfp4_jax.{sub}')
  doc = ' '.join((inspect.getdoc(pkg) or '').split('\n\n')[0].split())
  out.append(f"### `nvfp4_jax.{sub}`\n\n{doc}\n\n| module | what it holds |\n| --- | --- |\n")
  for m in pkg.__all__:
    mod = importlib.import_module(f'nvfp4_jax.{sub}.{m}')
    first = ' '.join((inspect.getdoc(mod) or '').split('\n\n')[0].split())
    first = first.replace('|', r'\|')
    out.append(f"| `nvfp4_jax.{sub}.{m}` | {first} |\n")
  out.append("\n")
(R/'docs/api.md').write_text(''.join(out).rstrip('\n') + '\n')
