"""Causal attention kernels behind `ModelConfig.attention`: auto, xla, splash (Pallas TPU),
cudnn.

Conventions: B batch, T sequence, H query heads, K kv heads (H a multiple of K; query head h
reads kv head h // (H/K)), hd head dim. Every kernel maps q [B,T,H,hd], k, v [B,T,K,hd] to
[B,T,H,hd], causal over T, softmax scale `scale`, and with `segment_ids` [B,T] int (packed
documents, data/pipeline.py) only within a segment: query t sees key s iff s <= t and both carry
the same segment id. They differ only in how they compute it:

- xla: `jax.nn.dot_product_attention`, which materialises the [B,H,T,T] logits; runs anywhere.
- splash: jax's Pallas splash attention (flash-style, skips the fully masked blocks above the
  diagonal). On TPU the compiled Mosaic kernel; on any other platform the same kernel in Pallas
  interpret mode, which is exact but very slow: for tests only.
- cudnn: cuDNN's fused flash attention through `jax.nn.dot_product_attention`; NVIDIA GPUs only
  and bfloat16/float16 only (ModelConfig rejects float32 with it). No segment ids: that API
  takes only per-row sequence lengths, and a dense mask would become a [B,1,T,T] bias whose
  gradient cuDNN always computes.

- auto (the default): the platform's kernel where the call's inputs allow it, chosen when the
  call is traced (auto_kernel): splash on TPU, cudnn on an NVIDIA GPU, xla otherwise. A model,
  a checkpoint or a config with auto runs on every platform.

These serve training and prefill without a cache. Decoding with a KV cache stays on the XLA
masked path (layers.Attention): its mask depends on runtime values (cache length, each row's
left-padding start) that splash's static block mask cannot express, and a one-token query
would fill a 128-row kernel block with padding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from delta_jax.sharding import logical_to_spec

# Largest first: 512 is MaxText's default tile (larger tiles amortise the per-block overhead,
# smaller ones skip more of the causal triangle); T need only be a multiple of the smallest.
SPLASH_BLOCKS = (512, 256, 128)


def current_platform() -> str:
    """The platform the code is being traced for: the mesh's devices under `jax.set_mesh` (an
    ahead-of-time TPU topology on a CPU host counts as TPU), else jax's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else mesh.abstract_device
    return device.platform if device is not None else jax.default_backend()


def auto_kernel(platform: str, *, seq_len: int, head_dim: int, dtype, segments: bool) -> str:
    """The kernel `attention: auto` takes for one call: splash on TPU where its block size
    divides T; cudnn on an NVIDIA GPU for bfloat16/float16 without segment ids (packed
    documents) and a head dim it takes (a multiple of 8, at most 128 on every GPU generation);
    xla otherwise. Each choice is compiled by a test for its platform (tests/
    test_model_attention.py): TPU through libtpu, GPU through the compile-only H100s."""
    if platform == "tpu" and seq_len % SPLASH_BLOCKS[-1] == 0:
        return "splash"
    if (platform in ("gpu", "cuda") and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
            and not segments and head_dim % 8 == 0 and head_dim <= 128):
        return "cudnn"
    return "xla"


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, kind: str, scale: float,
                     segment_ids: jax.Array | None = None) -> jax.Array:
    """q [B,T,H,hd], k, v [B,T,K,hd], segment_ids [B,T] int or None (one segment) ->
    [B,T,H,hd] with the kernel named by `kind` (auto: auto_kernel's)."""
    if kind == "auto":
        kind = auto_kernel(current_platform(), seq_len=q.shape[1], head_dim=q.shape[3],
                           dtype=q.dtype, segments=segment_ids is not None)
    if kind == "xla":
        mask = None if segment_ids is None else same_segment(segment_ids)
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, scale=scale,
                                            implementation="xla")
    if kind == "splash":
        return sharded_splash_attention(q, k, v, scale=scale, segment_ids=segment_ids)
    if kind == "cudnn":
        if segment_ids is not None:
            raise ValueError(
                "ModelConfig.attention='cudnn' cannot take segment ids (packed documents): "
                "jax.nn.dot_product_attention's cuDNN path takes only per-row sequence lengths; "
                "use attention='xla' or 'splash', or data.packing=concat")
        platform = current_platform()
        if platform not in ("gpu", "cuda"):
            raise ValueError(
                f"ModelConfig.attention='cudnn' needs an NVIDIA GPU with cuDNN, but this "
                f"computation is traced for platform {platform!r}: use attention='xla' (any "
                "platform) or 'splash' (TPU)")
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                            implementation="cudnn")
    raise ValueError(f"unknown attention kind {kind!r}: expected one of auto, xla, splash, cudnn")


def same_segment(segment_ids: jax.Array) -> jax.Array:
    """[B,T] int -> [B,1,T,T] bool: whether query t and key s lie in the same segment."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def splash_block(seq_len: int) -> int:
    """The largest of SPLASH_BLOCKS dividing T; every splash tile (q and kv, forward, dq, dkv)
    uses it, since the mask's block grid must tile T exactly."""
    for block in SPLASH_BLOCKS:
        if seq_len % block == 0:
            return block
    raise ValueError(
        f"ModelConfig.attention='splash' needs the sequence length to be a multiple of the "
        f"kernel block size {SPLASH_BLOCKS[-1]}, got T={seq_len}: pad or choose another length, "
        "or use attention='xla'")


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                     interpret: bool, segment_ids: jax.Array | None = None) -> jax.Array:
    """q [B,T,H,hd], k, v [B,T,K,hd], segment_ids [B,T] or None -> [B,T,H,hd] on the arrays it
    is given (one device's shard under shard_map). The kernel takes one example as q [H,T,hd],
    k, v [K,T,hd] and handles the grouping itself (its MHA form with K < H), so kv heads are
    never repeated; it has no scale argument, so q is scaled before it. Segment ids go in as
    its SegmentIds (the same ids for queries and keys), masked on top of the causal mask."""
    _, seq_len, num_heads, _ = q.shape
    block = splash_block(seq_len)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              block_q_dq=block, block_kv_dq=block)
    mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((seq_len, seq_len))] * num_heads)
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B,T,N,hd] <-> [B,N,T,hd]
    inputs = (heads_first(q * jnp.asarray(scale, q.dtype)), heads_first(k), heads_first(v))
    if segment_ids is None:
        return heads_first(jax.vmap(kernel)(*inputs))
    segments = splash.SegmentIds(q=segment_ids.astype(jnp.int32),
                                 kv=segment_ids.astype(jnp.int32))
    return heads_first(jax.vmap(kernel)(*inputs, segment_ids=segments))


def sharded_splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, scale: float,
                             segment_ids: jax.Array | None = None) -> jax.Array:
    """q [B,T,H,hd], k, v [B,T,K,hd], segment_ids [B,T] or None -> [B,T,H,hd] with splash, per
    device under a mesh.

    A Pallas kernel sees only what is on its device, so under a mesh it runs inside shard_map:
    batch split over (data, fsdp) and heads over tensor, as `constrain` lays the activations out
    (an axis that does not divide is replicated, the same rule). The sequence stays whole on every
    device: each query block needs all earlier keys. When tensor splits the query heads but not
    the kv heads (e.g. 2 kv heads on tensor=4) each shard would need kv heads it does not hold,
    so kv is repeated to H heads first.
    """
    interpret = current_platform() != "tpu"
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return splash_attention(q, k, v, scale=scale, interpret=interpret,
                                segment_ids=segment_ids)
    mesh_shape = dict(mesh.shape)
    axes = ("batch", None, "act_heads", None)
    q_spec = logical_to_spec(axes, q.shape, mesh_shape)
    if q_spec[2] != logical_to_spec(axes, k.shape, mesh_shape)[2]:
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    kv_spec = logical_to_spec(axes, k.shape, mesh_shape)
    # check_vma off: splash's pallas_call declares its outputs without the varying-axes types
    # that the check needs (jax asks for check_vma=False or typed outputs).
    attend = lambda q, k, v, segment_ids=None: splash_attention(
        q, k, v, scale=scale, interpret=interpret, segment_ids=segment_ids)
    specs = (q_spec, kv_spec, kv_spec)
    args = (q, k, v)
    if segment_ids is not None:  # split over batch like q, whole over the sequence
        specs += (jax.sharding.PartitionSpec(q_spec[0], None),)
        args += (segment_ids,)
    per_device = jax.shard_map(attend, mesh=mesh, in_specs=specs, out_specs=q_spec,
                               check_vma=False)
    return per_device(*args)
