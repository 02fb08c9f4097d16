"""delta_jax: Delta Attention Residuals (arXiv 2605.18855) on Qwen3 in JAX/Flax NNX.

The public names resolve lazily, so that `python -m delta_jax.data` and its worker processes do
not pay for importing jax and flax.
"""
import glob
import importlib
import importlib.util
import os
from pathlib import Path


def _no_tpu_here() -> bool:
    """True where libtpu is installed (`make test`, the planner) but no TPU can be attached: no
    Google PCI device (what jax itself probes), no /dev/accel* or /dev/vfio device."""
    if importlib.util.find_spec("libtpu") is None:
        return False
    google = any(Path(vendor).read_text().strip() == "0x1ae0"
                 for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"))
    return not (google or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


# Left to probe for a TPU, jax starts libtpu, which prints initialisation errors (E0000 ...
# TPU_WORKER_HOSTNAMES, "Failed to find host bounds") on a host that has none. There, jax is
# told the platforms it can use; a TPU host and an explicit JAX_PLATFORMS are left alone.
if "JAX_PLATFORMS" not in os.environ and _no_tpu_here():
    os.environ["JAX_PLATFORMS"] = "cuda,cpu"

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
    "load_tokenizer": "delta_jax.loading",
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
