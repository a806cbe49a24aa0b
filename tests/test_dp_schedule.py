"""`dp.schedule.after` changes no bit of its argument, whatever the dtype, and keeps the dependency.

What it is for (XLA computing the ghost norms' Gram matrices and the noise draw when their
consumers need them, not as early as possible) is checked on compiled steps by
`tests/test_mesh_memory.py`.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from private_t5.dp import schedule

VALUE = jnp.asarray([[1.5, -2.25], [np.nan, 3.0]], jnp.float32)  # its bits are mixed in


def _bits(x):
  x = np.asarray(x)
  return x.view(np.dtype(f"u{x.dtype.itemsize}"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint32])
def test_after_returns_the_same_bits(dtype):
  if jnp.issubdtype(dtype, jnp.floating):
    x = jnp.asarray([0.0, -0.0, 1.0, -3.5, np.inf, -np.inf, np.nan, 1e-30], dtype)
  else:
    x = jnp.asarray([0, 1, 7, 2**31 - 1, 123456], dtype)
  y = jax.jit(schedule.after)(x, VALUE)
  assert y.dtype == x.dtype and y.shape == x.shape
  np.testing.assert_array_equal(_bits(y), _bits(x))


def test_after_keeps_a_prng_key():
  for key in (jax.random.PRNGKey(7), jax.random.key(7)):
    out = jax.jit(schedule.after)(key, VALUE)
    np.testing.assert_array_equal(jax.random.normal(out, (4,)), jax.random.normal(key, (4,)))


def test_after_depends_on_the_value():
  jaxpr = jax.make_jaxpr(schedule.after)(jnp.ones((3,)), VALUE).jaxpr
  value_var = jaxpr.invars[1]
  assert any(value_var in eqn.invars for eqn in jaxpr.eqns)
