"""README's quick-start code runs as written and trains; the docs' copy is
the same code, and the numerics page's example runs."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"
DOCS = README.parent / "docs"


def _blocks(path, after=""):
  text = path.read_text()
  return re.findall(r"```python\n(.*?)```", text[text.index(after):], re.S)


def test_readme_quickstart_runs():
  # The first Python block of the quick-start section.
  text = README.read_text()
  text = text[text.index("## Replace `nn.Dense`, jit the step"):]
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  ns = {}
  exec(compile(blocks[0], "README.md", "exec"), ns)  # pylint: disable=exec-used
  x = jax.random.normal(jax.random.key(2), (32, 256))
  y = jnp.arange(32) % 10
  params, opt_state = ns["params"], ns["opt_state"]
  losses = []
  for step in range(6):
    params, opt_state, loss = ns["train_step"](params, opt_state, x, y,
                                               jnp.int32(step))
    losses.append(float(loss))
  assert losses[-1] < losses[0]


def test_docs_quickstart_is_readmes():
  heading = "## Replace `nn.Dense`, jit the step"
  assert _blocks(DOCS / "layers.md", heading)[0] == _blocks(README, heading)[0]


def test_numerics_example_runs():
  import nvfp4_jax as nv  # pylint: disable=g-import-not-at-top
  block = _blocks(DOCS / "numerics.md", "## Numerics")[0]
  x, w, g = (jax.random.normal(jax.random.key(i), (32, 64)) for i in range(3))
  ns = {"nv": nv, "x": x, "w": w[:, :32].T @ w, "g": g,
        "k": jax.random.key(3)}
  exec(compile(block, "docs/numerics.md", "exec"), ns)  # pylint: disable=exec-used
  assert ns["x_hat"].shape == (64, 32)  # rht(x.T)'s
  values, scale = ns["values_bf16"], ns["tensor_scale"]
  assert jnp.array_equal(values.astype(jnp.float32) * scale, ns["x_hat"])
  assert ns["m"].fmt == "mxfp4"


def test_test_processes_share_a_gpu():
  """README's GPU test command runs several processes on one GPU: the test
  configuration turns JAX's preallocation off in each, unless the user set
  it (checked in fresh interpreters, as each xdist worker starts)."""
  def preallocate(value):
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    if value is not None:
      env["XLA_PYTHON_CLIENT_PREALLOCATE"] = value
    out = subprocess.run(
        [sys.executable, "-c", "import os, conftest; "
         "print(os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"],
        cwd=pathlib.Path(__file__).parents[1], env=env, capture_output=True,
        text=True, check=True)
    return out.stdout.strip()
  assert preallocate(None) == "false"
  assert preallocate("true") == "true"
