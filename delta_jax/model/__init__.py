"""The model: Qwen3 with the five residual variants (docs/spec.md)."""
from delta_jax.model.causal_lm import (
                                       CausalLM,
                                       ModelOutput,
                                       abstract_model,
                                       count_params,
                                       init_model,
)
from delta_jax.model.routing import Routing

__all__ = ["CausalLM", "ModelOutput", "Routing", "abstract_model", "count_params", "init_model"]
