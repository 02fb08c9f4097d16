"""Comparing two different compiled programs in float32.

Two programs that compute the same sums (a routing model with its gates at zero and the plain
Qwen3, a rebuilt state and a kept one) are not bitwise equal by any XLA guarantee: its CPU
fusions may reassociate a reduction differently on another machine. Such tests assert equality
to float32 rounding, scaled to the largest value compared; a test that runs one program twice
(a resume) keeps asserting bitwise equality.
"""
import jax
import numpy as np

# About 80 float32 ulps of the largest value: reassociated sums of the tests' sizes stay far
# below it (1.3e-6 seen), while any real change of the function is orders of magnitude above.
FLOAT32_RELATIVE = 1e-5


def assert_float32_equal(actual, expected, err_msg: str = "") -> None:
    """Every leaf of `actual` equals `expected`'s to float32 rounding: |a - b| <=
    FLOAT32_RELATIVE * max|b| elementwise, per leaf."""
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves), err_msg
    for a, b in zip(actual_leaves, expected_leaves):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert a.shape == b.shape, (err_msg, a.shape, b.shape)
        scale = float(np.abs(b).max()) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=0, atol=FLOAT32_RELATIVE * scale + 1e-30,
                                   err_msg=err_msg)
