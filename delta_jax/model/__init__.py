"""The model: Qwen3 with the five residual variants (SPEC.md)."""
from delta_jax.model.causal_lm import CausalLM, Routing, count_params, init_model

__all__ = ["CausalLM", "Routing", "count_params", "init_model"]
