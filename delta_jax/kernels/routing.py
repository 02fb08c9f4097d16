"""A Pallas TPU kernel for a routing site's pass over the source buffer (docs/spec.md sections 2
and 7): logits, softmax and the weighted sum over the buffer slots in one read of the buffer.

Conventions: S buffer slots, B batch, T sequence, D hidden, N = B*T tokens (of one device's
shard under a mesh), tile the tokens of one grid step.

`route_buffer(values [S,B,T,D], inv_rms [S,B,T], wg [D], num_valid)` returns the logits of the
buffer slots ([S,B,T] float32, -inf at slots >= num_valid) and their softmax mix ([B,T,D] float32,
zero with no valid slot). The site (routing.py) combines that mix, as one source whose weight is
the buffer's total weight, with the sources outside the buffer (null, fresh, live) in XLA: cheap
[B,T,D] work.

The kernel: grid (token tiles, S), the slot axis innermost, so a token tile's [tile,D] float32
mix stays in VMEM while the slots stream past (an online softmax: running max and sum). num_valid
is a scalar-prefetch operand: the index map pins every slot >= num_valid to the last valid one,
which the pipeline does not fetch again, and the body skips them, so invalid slots are not read
(with num_valid = 0, slot 0 is fetched once per tile and ignored).
The backward kernel is one more pass over the valid slots (per slot: d_beta = s.d_mix, then
d_s, d_inv_rms and the d_wg partial of the tile) and writes zeros for the rest: slots >=
num_valid get no gradient, which the lean driver relies on (drivers.py).

Per-token scalars travel as [N,S] (tokens on sublanes, slots on lanes): a kernel needs them as
[tile,1] columns to scale [tile,D] rows, and an [S,N] row layout would need an in-kernel
transpose. The kernel picks slot s out of a [tile,S] block with a masked lane reduction.

Numerics: float32 inside the kernel whatever the buffer dtype (bf16 sources are upcast per
block; wg stays float32, where the XLA site rounds it to the buffer dtype), so with a bf16
buffer the two paths differ by bf16 rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from delta_jax.sharding import logical_to_spec

# Block bytes per grid step kept under this (double-buffered in/out blocks and the float32
# temporaries of the backward pass, the larger of the two); the scoped VMEM limit leaves room
# for Mosaic's own scratch. v4's VMEM is 32 MiB, v5e/v5p/v6e have more.
_VMEM_BLOCK_BUDGET = 12 * 2**20
_VMEM_LIMIT = 30 * 2**20
_LANES = 128


def _token_tile(tokens: int, hidden: int, itemsize: int, slots: int) -> int:
    """Rows per grid step: the largest power of two (>= 8, a sublane multiple) whose backward
    blocks fit the budget, or all the tokens when they fit in one such tile. B*T need not be a
    multiple of it: the last tile is then partial, its rows past the end are never written back
    and the backward kernel masks them out of its one sum over tokens (d_wg)."""
    lanes = -(-slots // _LANES) * _LANES  # a [tile,S] float32 block is padded to 128 lanes
    per_token = hidden * (4 * itemsize + 2 * 4 + 3 * 4) + 4 * 2 * lanes * 4
    tile = 1024
    while tile > 8 and tile * per_token > _VMEM_BLOCK_BUDGET:
        tile //= 2
    return tokens if tokens <= tile else tile


def _slot_column(block: jax.Array, slot) -> jax.Array:
    """[tile,S] -> [tile,1]: column `slot` (traced), by a masked lane reduction."""
    lane = jax.lax.broadcasted_iota(jnp.int32, block.shape, 1)
    return jnp.sum(jnp.where(lane == slot, block, 0.0), axis=1, keepdims=True)


def _last_valid(slot, num_valid_ref):
    """Block index of slot `slot`: slots past the valid ones repeat the last valid block, which
    the pipeline then does not fetch again."""
    return jnp.minimum(slot, jnp.maximum(num_valid_ref[0] - 1, 0))


# Forward -----------------------------------------------------------------------------------
def _forward_kernel(num_valid_ref, values_ref, inv_rms_ref, wg_ref, logits_ref, mix_ref,
                    peak_ref, total_ref):
    """One (token tile, slot) step. values [tile,D], inv_rms [tile,S], wg [1,D]; outputs
    resident across the slot axis: logits [tile,S], mix [tile,D] (the running, then the
    normalised, weighted sum); scratch peak, total [tile,1]: the running max and sum."""
    slot = pl.program_id(1)

    @pl.when(slot == 0)
    def _init():
        logits_ref[...] = jnp.full(logits_ref.shape, -jnp.inf, jnp.float32)
        mix_ref[...] = jnp.zeros(mix_ref.shape, jnp.float32)
        peak_ref[...] = jnp.full(peak_ref.shape, -jnp.inf, jnp.float32)
        total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)

    @pl.when(slot < num_valid_ref[0])
    def _accumulate():
        x = values_ref[...].astype(jnp.float32)
        logit = (_slot_column(inv_rms_ref[...], slot)
                 * jnp.sum(x * wg_ref[...], axis=1, keepdims=True))
        lane = jax.lax.broadcasted_iota(jnp.int32, logits_ref.shape, 1)
        logits_ref[...] = jnp.where(lane == slot, logit, logits_ref[...])
        peak = jnp.maximum(peak_ref[...], logit)
        rescale = jnp.exp(peak_ref[...] - peak)  # 0 at the first valid slot (-inf - finite)
        weight = jnp.exp(logit - peak)
        total_ref[...] = rescale * total_ref[...] + weight
        mix_ref[...] = rescale * mix_ref[...] + weight * x
        peak_ref[...] = peak

    @pl.when(slot == pl.num_programs(1) - 1)
    def _normalise():
        total = total_ref[...]
        mix_ref[...] = mix_ref[...] / jnp.where(total > 0, total, 1.0)


def _forward_call(values, inv_rms_t, wg, num_valid, *, interpret: bool):
    """values [S,N,D], inv_rms_t [N,S] f32, wg [D] f32, num_valid [1] int32 ->
    (logits_t [N,S] f32, mix [N,D] f32)."""
    slots, tokens, hidden = values.shape
    tile = _token_tile(tokens, hidden, values.dtype.itemsize, slots)
    per_token = lambda i, s, nv: (i, 0)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(pl.cdiv(tokens, tile), slots),
        in_specs=[pl.BlockSpec((pl.squeezed, tile, hidden),
                               lambda i, s, nv: (_last_valid(s, nv), i, 0)),
                  pl.BlockSpec((tile, slots), per_token),
                  pl.BlockSpec((1, hidden), lambda i, s, nv: (0, 0))],
        out_specs=[pl.BlockSpec((tile, slots), per_token),
                   pl.BlockSpec((tile, hidden), per_token)],
        scratch_shapes=[pltpu.VMEM((tile, 1), jnp.float32)] * 2)
    elements = slots * tokens * hidden
    return pl.pallas_call(
        _forward_kernel,
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct((tokens, slots), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, hidden), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT),
        # Every slot counted (an upper bound when num_valid < S), as the XLA path computes.
        cost_estimate=pl.CostEstimate(
            flops=5 * elements, transcendentals=2 * slots * tokens,
            bytes_accessed=elements * values.dtype.itemsize + 4 * tokens * (hidden + 2 * slots)),
        interpret=interpret,
    )(num_valid, values, inv_rms_t, wg.reshape(1, hidden))


# Backward ----------------------------------------------------------------------------------
def _backward_kernel(num_valid_ref, values_ref, inv_rms_ref, beta_ref, shift_ref, wg_ref,
                     d_mix_ref, d_values_ref, d_inv_rms_ref, d_wg_ref, *, tokens: int):
    """One (token tile, slot) step of the backward pass, for mix = sum_n beta_n s_n with
    beta = softmax(logit) over the valid slots and logit_n = r_n (wg . s_n).

    values [tile,D]; inv_rms, beta, shift [tile,S] with shift_n = d_logit_n (the logits'
    own cotangent) - beta_n (mix . d_mix); wg [1,D]; d_mix [tile,D]. Then
    d_logit_n = beta_n (s_n . d_mix) + shift_n, d_s_n = beta_n d_mix + d_logit_n r_n wg,
    d_r_n = d_logit_n (wg . s_n), d_wg += sum_tokens d_logit_n r_n s_n.
    Outputs: d_values [tile,D] per slot; d_inv_rms [tile,S] and d_wg [1,D] resident.
    `tokens`: N, past which the rows of a partial last tile hold garbage.
    """
    # program_id at the top level: the interpreter does not substitute it inside pl.when.
    first_row, slot = pl.program_id(0) * values_ref.shape[0], pl.program_id(1)

    @pl.when(slot == 0)
    def _init():
        d_inv_rms_ref[...] = jnp.zeros(d_inv_rms_ref.shape, jnp.float32)
        d_wg_ref[...] = jnp.zeros(d_wg_ref.shape, jnp.float32)

    @pl.when(slot < num_valid_ref[0])
    def _valid():
        x = values_ref[...].astype(jnp.float32)
        wg, d_mix = wg_ref[...], d_mix_ref[...]
        beta = _slot_column(beta_ref[...], slot)
        d_logit = (beta * jnp.sum(x * d_mix, axis=1, keepdims=True)
                   + _slot_column(shift_ref[...], slot))
        scaled = d_logit * _slot_column(inv_rms_ref[...], slot)
        d_values_ref[...] = (beta * d_mix + scaled * wg).astype(d_values_ref.dtype)
        lane = jax.lax.broadcasted_iota(jnp.int32, d_inv_rms_ref.shape, 1)
        d_inv_rms_ref[...] = jnp.where(lane == slot,
                                       d_logit * jnp.sum(x * wg, axis=1, keepdims=True),
                                       d_inv_rms_ref[...])
        row = first_row + jax.lax.broadcasted_iota(jnp.int32, scaled.shape, 0)
        d_wg_ref[...] += jnp.sum(jnp.where(row < tokens, scaled * x, 0.0), axis=0,
                                 keepdims=True)

    @pl.when(slot >= num_valid_ref[0])
    def _invalid():  # a slot the site did not see: no gradient
        d_values_ref[...] = jnp.zeros(d_values_ref.shape, d_values_ref.dtype)


def _backward_call(values, inv_rms_t, beta_t, shift_t, wg, d_mix, num_valid, *,
                   interpret: bool):
    """-> (d_values [S,N,D] in values' dtype, d_inv_rms_t [N,S] f32, d_wg [D] f32)."""
    slots, tokens, hidden = values.shape
    tile = _token_tile(tokens, hidden, values.dtype.itemsize, slots)
    tiles = pl.cdiv(tokens, tile)
    per_token = pl.BlockSpec((tile, slots), lambda i, s, nv: (i, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(tiles, slots),
        in_specs=[pl.BlockSpec((pl.squeezed, tile, hidden),
                               lambda i, s, nv: (_last_valid(s, nv), i, 0)),
                  per_token, per_token, per_token,
                  pl.BlockSpec((1, hidden), lambda i, s, nv: (0, 0)),
                  pl.BlockSpec((tile, hidden), lambda i, s, nv: (i, 0))],
        out_specs=[pl.BlockSpec((pl.squeezed, tile, hidden), lambda i, s, nv: (s, i, 0)),
                   per_token,
                   pl.BlockSpec((pl.squeezed, 1, hidden), lambda i, s, nv: (i, 0, 0))])
    elements = slots * tokens * hidden
    d_values, d_inv_rms_t, d_wg = pl.pallas_call(
        functools.partial(_backward_kernel, tokens=tokens),
        grid_spec=grid_spec,
        out_shape=[jax.ShapeDtypeStruct(values.shape, values.dtype),
                   jax.ShapeDtypeStruct((tokens, slots), jnp.float32),
                   jax.ShapeDtypeStruct((tiles, 1, hidden), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=_VMEM_LIMIT),
        cost_estimate=pl.CostEstimate(
            flops=10 * elements, transcendentals=0,
            bytes_accessed=(2 * elements * values.dtype.itemsize
                            + 4 * tokens * (hidden + 4 * slots))),
        interpret=interpret,
    )(num_valid, values, inv_rms_t, beta_t, shift_t, wg.reshape(1, hidden), d_mix)
    return d_values, d_inv_rms_t, jnp.sum(d_wg, axis=(0, 1))


# The differentiable pass -------------------------------------------------------------------
def _on_platform(call, *args, interpret: bool | None):
    """The Mosaic kernel when lowering for TPU, the Pallas interpreter elsewhere (decided at
    lowering time, so a TPU program compiled on a CPU host gets the kernel), unless forced."""
    if interpret is not None:
        return call(*args, interpret=interpret)
    return jax.lax.platform_dependent(*args, tpu=functools.partial(call, interpret=False),
                                      default=functools.partial(call, interpret=True))


def _valid_softmax(logits_t, num_valid):
    """logits_t [N,S] -> beta [N,S]: the softmax over the valid slots (zeros with none)."""
    valid = jnp.arange(logits_t.shape[1]) < num_valid[0]
    peak = jnp.max(jnp.where(valid, logits_t, -jnp.inf), axis=1, keepdims=True)
    peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
    exp = jnp.where(valid, jnp.exp(logits_t - peak), 0.0)
    total = jnp.sum(exp, axis=1, keepdims=True)
    return exp / jnp.where(total > 0, total, 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _route(values, inv_rms_t, wg, num_valid, interpret):
    """values [S,N,D], inv_rms_t [N,S], wg [D], num_valid [1] -> (logits_t [N,S], mix [N,D])."""
    return _on_platform(_forward_call, values, inv_rms_t, wg, num_valid, interpret=interpret)


def _route_forward(values, inv_rms_t, wg, num_valid, interpret):
    logits_t, mix = _route(values, inv_rms_t, wg, num_valid, interpret)
    # The mix is kept in the buffer's dtype: under the scan driver residuals are stacked per
    # layer, and a bf16 buffer's gradient is bf16-accurate anyway.
    return (logits_t, mix), (values, inv_rms_t, wg, num_valid, logits_t,
                             mix.astype(values.dtype))


def _route_backward(interpret, residuals, cotangents):
    values, inv_rms_t, wg, num_valid, logits_t, mix = residuals
    d_logits_t, d_mix = cotangents
    # The softmax's Jacobian needs sum_n beta_n d_beta_n = mix . d_mix before the slots stream
    # past: computed here once per token and folded into the logits' own cotangent.
    beta_t = _valid_softmax(logits_t, num_valid)
    valid = jnp.arange(values.shape[0]) < num_valid[0]
    mix_dot = jnp.sum(mix.astype(jnp.float32) * d_mix, axis=1, keepdims=True)
    shift_t = jnp.where(valid, d_logits_t - beta_t * mix_dot, 0.0)
    d_values, d_inv_rms_t, d_wg = _on_platform(
        _backward_call, values, inv_rms_t, beta_t, shift_t, wg, d_mix, num_valid,
        interpret=interpret)
    return d_values, d_inv_rms_t, d_wg, None


_route.defvjp(_route_forward, _route_backward)


def _route_local(values, inv_rms, wg, num_valid, interpret):
    """route_buffer on one device's shard (tokens are independent, D is whole)."""
    slots, batch, length, hidden = values.shape
    tokens = batch * length
    logits_t, mix = _route(values.reshape(slots, tokens, hidden),
                           inv_rms.reshape(slots, tokens).T, wg, num_valid, interpret)
    return logits_t.T.reshape(slots, batch, length), mix.reshape(batch, length, hidden)


def route_buffer(values: jax.Array, inv_rms: jax.Array, wg: jax.Array, num_valid, *,
                 interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """One pass over the buffer: the slots' logits and their softmax mix (module docstring).

    values [S,B,T,D] (any float dtype), inv_rms [S,B,T] float32, wg [D] float32 (the site's
    w*g), num_valid int (static or traced; clipped to [0, S]) ->
    (logits [S,B,T] float32, r_n (wg . s_n) below num_valid and -inf from it on;
     mix [B,T,D] float32, sum_n softmax(logits)_n s_n, zero when num_valid is 0).
    Differentiable in values, inv_rms and wg; slots >= num_valid get zero gradient.

    interpret: None (default) runs the Mosaic TPU kernel when the program is lowered for TPU
    and the Pallas interpreter on any other backend (CPU tests, GPU); True/False force it.
    Under a mesh the kernel runs per device in a shard_map over the buffer's token sharding.
    """
    num_valid = jnp.clip(jnp.asarray(num_valid, jnp.int32), 0, values.shape[0]).reshape(1)
    wg = wg.astype(jnp.float32)
    route = functools.partial(_route_local, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return route(values, inv_rms, wg, num_valid)
    # The buffer's own sharding of batch and sequence; D stays whole (the logits sum over it).
    batch, seq, _ = logical_to_spec(("batch", "seq", "act_embed"), values.shape[1:],
                                    dict(mesh.shape))
    return jax.shard_map(
        route, mesh=mesh,
        in_specs=(jax.P(None, batch, seq, None), jax.P(None, batch, seq), jax.P(), jax.P()),
        out_specs=(jax.P(None, batch, seq), jax.P(batch, seq, None)),
        check_vma=False)(values, inv_rms, wg, num_valid)
