"""Pallas kernels (TPU; interpreted on other backends)."""
