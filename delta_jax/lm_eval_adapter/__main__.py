"""lm-eval's own command line (it sets up its logging) with the "delta_jax" model registered."""
from lm_eval.__main__ import cli_evaluate

import delta_jax.lm_eval_adapter  # noqa: F401  (the import registers the model)

if __name__ == "__main__":
    cli_evaluate()
