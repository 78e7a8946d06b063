"""README's quick-start code runs as written and trains."""

import pathlib
import re

import jax
import jax.numpy as jnp

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs():
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
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
