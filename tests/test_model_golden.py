"""Parity with the reference PyTorch implementation's golden outputs (tests/golden)."""
import json
from pathlib import Path

import chex
import jax.numpy as jnp
import numpy as np
import optax

from delta_jax import from_state_dict

GOLDEN = Path(__file__).parent / "golden"
VARIANTS = ["baseline", "block", "full", "delta", "delta_block"]
# Routing weights agree within 1e-5, as golden/README.md expects, except in `full`, whose golden
# model sits at float32's noise floor: its N(0,1) pseudo-queries over 2L+1 raw states make the
# weights so sensitive that, evaluated exactly (float64), rounding the parameters by half an ulp
# (x(1 + 6e-8 N(0,1))) moves them by up to 9e-6 and the logits by 2e-5. The reference's float32
# output is itself 3.3e-6 from the float64 value; ours differs from the reference's by 6e-6 to
# 1.3e-5 depending on the driver, jit and the machine.
ROUTING_ATOL = {"full": 2e-5}


def load_golden(mode: str):
    data = np.load(GOLDEN / f"golden_{mode}.npz")
    meta = json.loads((GOLDEN / f"golden_{mode}.json").read_text())
    hf_config = dict(meta["config"])
    if mode == "baseline":
        hf_config["model_type"] = "qwen3"
    else:
        hf_config.update(model_type="qwen3_attnres", attnres_mode=mode,
                         attnres_num_blocks=meta["num_blocks"])
    state_dict = {k[len("sd/"):]: data[k] for k in data.files if k.startswith("sd/")}
    routes = [data[k] for k in sorted(k for k in data.files if k.startswith("route/"))]
    return hf_config, state_dict, data, routes


class TestGolden(chex.TestCase):
    """Logits within 1e-4, loss within 1e-5, every routing weight within 1e-5 (full: 2e-5)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_all_variants_and_drivers(self):
        for mode in VARIANTS:
            hf_config, state_dict, data, routes = load_golden(mode)
            for driver in ("scan", "unrolled"):
                model = from_state_dict(hf_config, state_dict, layer_driver=driver)
                ids = jnp.asarray(data["input_ids"], jnp.int32)

                @self.variant
                def forward(ids):
                    out = model.forward(ids, return_routing=True)
                    logits, routing, hidden = out.logits, out.routing, out.hidden
                    loss = optax.softmax_cross_entropy_with_integer_labels(
                        logits[:, :-1], ids[:, 1:]).mean()
                    return logits, loss, routing, hidden

                logits, loss, routing, hidden = forward(ids)
                where = f"{mode}/{driver}"
                chex.assert_shape(logits, (2, 8, 128))
                chex.assert_shape(hidden, (2, 8, 32))
                np.testing.assert_allclose(logits, data["logits"], atol=1e-4, rtol=0, err_msg=where)
                np.testing.assert_allclose(hidden, data["final_hidden"], atol=1e-4, rtol=0,
                                           err_msg=where)
                np.testing.assert_allclose(loss, data["loss"], atol=1e-5, rtol=0, err_msg=where)
                calls = routing.calls()
                assert len(calls) == len(routes), where
                for i, (ours, theirs) in enumerate(zip(calls, routes)):
                    chex.assert_shape(ours, theirs.shape)
                    np.testing.assert_allclose(ours, theirs, atol=ROUTING_ATOL.get(mode, 1e-5),
                                               rtol=0,
                                               err_msg=f"{where} routing call {i}")
