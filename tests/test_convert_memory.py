"""load_pretrained streams: peak host memory stays near the model plus its largest tensor."""
import sys

import pytest

from delta_jax import ModelConfig
from delta_jax.hf.measure_load import measure


@pytest.mark.slow
def test_peak_host_memory_of_a_load(tmp_path):
    # Qwen3-0.6B geometry cut to 6 layers and a 32k vocabulary (~0.5 GB in float32). The file is
    # stored in float32, so a loader that held the file's tensors next to the model would need
    # twice the model; a streaming one needs the model plus about one stacked tensor.
    cfg = ModelConfig.qwen3_0_6b(residual="baseline", num_layers=6, vocab_size=32000)
    result = measure(cfg, "float32", tmp_path / "model")
    grown = result["peak_rss_after"] - result["peak_rss_before"]
    print(f"\nload of {result['model_bytes'] / 2**20:.0f} MiB: peak RSS grew by "
          f"{grown / 2**20:.0f} MiB in {result['load_seconds']} s", file=sys.stderr)
    assert result["model_bytes"] < grown < 1.6 * result["model_bytes"]
