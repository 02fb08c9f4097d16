"""delta_jax: Delta Attention Residuals (arXiv 2605.18855) on Qwen3 in JAX/Flax NNX.

The public names resolve lazily, so that `python -m delta_jax.data` and its worker processes do
not pay for importing jax and flax.
"""
import importlib

_EXPORTS = {
    "ModelConfig": "delta_jax.config",
    "CausalLM": "delta_jax.model",
    "ModelOutput": "delta_jax.model",
    "Routing": "delta_jax.model",
    "count_params": "delta_jax.model",
    "init_model": "delta_jax.model",
    "from_state_dict": "delta_jax.hf.state_dict",
    "to_state_dict": "delta_jax.hf.state_dict",
    "load_model": "delta_jax.loading",
    "load_pretrained": "delta_jax.hf.load",
    "save_pretrained": "delta_jax.hf.save",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'delta_jax' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
