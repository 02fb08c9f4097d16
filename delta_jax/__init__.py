"""delta_jax: Delta Attention Residuals (arXiv 2605.18855) on Qwen3 in JAX/Flax NNX."""
from delta_jax.config import ModelConfig
from delta_jax.hf.state_dict import from_state_dict, to_state_dict
from delta_jax.model import CausalLM, Routing, count_params, init_model

__all__ = ["CausalLM", "ModelConfig", "Routing", "count_params", "from_state_dict",
           "init_model", "to_state_dict"]
