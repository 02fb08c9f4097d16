"""Compile one routing site for a TPU topology from this host, with the XLA and the Pallas
path, and print what the compiler reports (per device): HBM of temporaries, arguments and
outputs, and cost_analysis's flops, bytes accessed and optimal_seconds (XLA's cost-model
estimate, not a measurement; a Pallas kernel enters it through its pl.CostEstimate).

    python -m delta_jax.kernels.measure [--topology v5p:2x2x1] [--chips 1|4] [--slots 73]
        [--batch 16] [--length 2048] [--hidden 1280]

Needs libtpu (pip install libtpu==0.0.42.1); no TPU has to be attached. The site routes over
every slot (num_valid traced, = S), in bf16, forward alone and forward with the backward pass
(gradients w.r.t. the buffer and the site's parameters).
"""
from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.config import ModelConfig
from delta_jax.model.protocol import SourceBuffer
from delta_jax.model.routing import RoutingSite
from delta_jax.sharding import make_mesh


def measure(kernel: str, *, topology: str, chips: int, slots: int, batch: int, length: int,
            hidden: int) -> dict[str, dict[str, float]]:
    devices = topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    mesh = make_mesh(fsdp=chips, devices=devices[:chips])
    cfg = ModelConfig(hidden_size=hidden, routing_kernel=kernel)
    graphdef, params = nnx.split(RoutingSite(cfg, nnx.Rngs(0)), nnx.Param)
    tokens = NamedSharding(mesh, P(None, "fsdp"))
    args = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                        sharding=NamedSharding(mesh, P())),
                         params),
            jax.ShapeDtypeStruct((slots, batch, length, hidden), jnp.bfloat16, sharding=tokens),
            jax.ShapeDtypeStruct((slots, batch, length), jnp.float32, sharding=tokens),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))

    def forward(params, values, inv_rms, num_valid):
        return nnx.merge(graphdef, params)(SourceBuffer(values, inv_rms), num_valid)

    def forward_backward(params, values, inv_rms, num_valid):
        loss = lambda *a: jnp.sum(forward(*a, num_valid)[0].astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(params, values, inv_rms)

    report = {}
    with jax.set_mesh(mesh):
        for name, fn in (("forward", forward), ("forward+backward", forward_backward)):
            compiled = jax.jit(fn).lower(*args).compile()
            memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
            report[name] = {
                "temp_GiB": memory.temp_size_in_bytes / 2**30,
                "argument_GiB": memory.argument_size_in_bytes / 2**30,
                "output_GiB": memory.output_size_in_bytes / 2**30,
                "flops": cost.get("flops"),
                "bytes_accessed_GB": cost.get("bytes accessed", 0) / 1e9,
                "optimal_seconds": cost.get("optimal_seconds"),
                "pallas_calls": compiled.as_text().count("tpu_custom_call"),
            }
    return report


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="v5p:2x2x1")
    parser.add_argument("--chips", type=int, default=1)
    parser.add_argument("--slots", type=int, default=73)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=1280)
    args = parser.parse_args(argv)
    shape = {k: getattr(args, k) for k in ("topology", "chips", "slots", "batch", "length",
                                           "hidden")}
    print(json.dumps({kernel: measure(kernel, **shape) for kernel in ("xla", "pallas")},
                     indent=1))


if __name__ == "__main__":
    main()
