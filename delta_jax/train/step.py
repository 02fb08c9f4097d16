"""The jitted train step, the validation step and the routing probe.

Conventions: B global batch, A microbatches (gradient accumulation), T sequence, V vocab, L
layers, N sources of a site. Batches are {"input_ids", "labels"} int32 [B, T] with labels already
shifted; with documents packing (data/pipeline.py) they also hold "segment_ids" and "positions"
[B, T], and labels of IGNORE_LABEL (< 0) take no loss. Every function here is jax.jit with
explicit in/out shardings; the train step donates the state. Call them under
`jax.set_mesh(mesh)` so that the model's activation constraints apply.
"""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from delta_jax.sharding import batch_sharding
from delta_jax.train.loss import vocab_chunked_cross_entropy
from delta_jax.train.state import TrainState
from delta_jax.train.trainable import ALL, merge, split

Batch = dict[str, jax.Array]


def is_packed(batch: Batch) -> bool:
    """Whether `batch` holds documents packing's fields (and maybe ignored labels)."""
    return "segment_ids" in batch


def token_losses(graphdef: nnx.GraphDef, params: dict, batch: Batch, vocab_chunks: int = 1
                 ) -> tuple[jax.Array, jax.Array]:
    """The model's next-token CE on `batch`: (float32 [B,T], 0 where the label is ignored;
    whether each token counts, bool [B,T]). With `vocab_chunks` > 1 (train.loss_vocab_chunks)
    the [B,T,V] logits are never formed: the head runs that many vocabulary columns at a time
    (train/loss.py)."""
    model = nnx.merge(graphdef, nnx.State(params))
    output = model.forward(batch["input_ids"], positions=batch.get("positions"),
                           segment_ids=batch.get("segment_ids"))
    labels = batch["labels"]
    counted = labels >= 0
    safe = jnp.where(counted, labels, 0)
    if vocab_chunks > 1:
        head = model.head()
        ce = vocab_chunked_cross_entropy(output.hidden.astype(head.dtype), head, safe,
                                         vocab_chunks)
    else:
        ce = optax.softmax_cross_entropy_with_integer_labels(
            output.logits.astype(jnp.float32), safe)
    return jnp.where(counted, ce, 0.0), counted


def _loss(graphdef: nnx.GraphDef, params: dict, batch: Batch, tokens: jax.Array,
          vocab_chunks: int = 1) -> jax.Array:
    """The microbatch's CE summed over its counted tokens / `tokens` (float32 []: the mean count
    per microbatch, so that averaging over microbatches weighs every token of the batch alike);
    concat batches, where every token counts, take the plain mean."""
    ce, _ = token_losses(graphdef, params, batch, vocab_chunks)
    return ce.sum() / tokens if is_packed(batch) else ce.mean()


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation,
                    lr_schedules: dict[str, optax.Schedule], grad_accum: int,
                    state_shardings: TrainState, mesh: Mesh,
                    inject_nan_steps: tuple[int, ...] = (),
                    loss_vocab_chunks: int = 1,
                    trainable: tuple[str, ...] = (ALL,)) -> Callable:
    """(state, batch [B,T]) -> (state, metrics {loss, grad_norm, lr, routing_lr: float32 [],
    skipped: int32 [] (1 when the update was skipped)}).

    A step whose loss or gradients are not finite leaves the parameters and the optimizer state
    as they were (the step counter still advances: its batch is consumed). `inject_nan_steps`
    (tests only) makes the loss of those steps (1-based) NaN. `loss_vocab_chunks` > 1 computes
    the loss without the [B,T,V] logits, that many vocabulary chunks at a time (train/loss.py).

    Only the parameters `trainable` selects (train.trainable; train/trainable.py) are
    differentiated, clipped (grad_norm is theirs), updated and decayed; the frozen ones enter
    the loss as constants, so XLA computes no weight gradient for them, and leave unchanged.

    With grad_accum A the batch is split into A microbatches of B/A rows that are run one after
    another under a scan and whose gradients are averaged (so the loss is the mean over the
    batch, like one pass over B rows). Microbatch a takes rows a, A + a, 2A + a, ...: each
    device's contiguous block of rows splits locally, without moving data between devices.
    With ignored labels (documents packing) the loss is the mean over the batch's counted tokens.
    """
    grad_fn = jax.value_and_grad(  # (trainable, frozen, batch, tokens): w.r.t. trainable alone
        lambda t, f, b, n: _loss(graphdef, merge(t, f), b, n, loss_vocab_chunks))
    trainable_shardings = split(state_shardings.params, trainable)[0]
    micro_sharding = NamedSharding(mesh, P(None, ("data", "fsdp"), None))

    def step(state: TrainState, batch: Batch):
        micro = {k: jax.lax.with_sharding_constraint(
            v.reshape(-1, grad_accum, v.shape[-1]).swapaxes(0, 1), micro_sharding)
            for k, v in batch.items()}  # [A, B/A, T]
        # Counted tokens per microbatch on average (documents packing; at least 1).
        tokens = jnp.maximum(jnp.sum(batch["labels"] >= 0), 1).astype(jnp.float32) / grad_accum

        params, frozen = split(state.params, trainable)

        # The float32 gradient sum is sharded like the parameters (FSDP keeps it distributed).
        def shard_like_params(tree):
            return jax.lax.with_sharding_constraint(tree, trainable_shardings)

        def accumulate(carry, microbatch):
            loss, grads = grad_fn(params, frozen, microbatch, tokens)
            total_loss, total_grads = carry
            total_grads = jax.tree.map(lambda t, g: t + g.astype(jnp.float32), total_grads, grads)
            return (total_loss + loss, shard_like_params(total_grads)), None

        zeros = shard_like_params(
            jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
        (loss, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros), micro)
        grads = jax.tree.map(lambda g, p: (g / grad_accum).astype(p.dtype), grads, params)
        if inject_nan_steps:
            poison = jnp.where(jnp.isin(state.step + 1, jnp.array(inject_nan_steps)),
                               jnp.nan, 0.0)
            loss = loss + poison
            grads = jax.tree.map(lambda g: g + poison.astype(g.dtype), grads)
        grad_norm = optax.global_norm(grads)
        # The norm is NaN/inf iff some gradient is; a non-finite loss alone also skips.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        updated = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        metrics = {"loss": loss / grad_accum, "grad_norm": grad_norm,
                   "lr": lr_schedules["base"](state.step),
                   "routing_lr": lr_schedules["routing"](state.step),
                   "skipped": (~finite).astype(jnp.int32)}
        return TrainState(step=state.step + 1, params=merge(keep(updated, params), frozen),
                          opt_state=keep(opt_state, state.opt_state)), metrics

    replicated = NamedSharding(mesh, P())
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding(mesh)),
                   out_shardings=(state_shardings, replicated), donate_argnums=0)


def make_eval_step(graphdef: nnx.GraphDef, param_shardings: dict, mesh: Mesh,
                   loss_vocab_chunks: int = 1) -> Callable:
    """(params, batch [B,T]) -> (summed token CE float32 [], counted tokens int32 []): divide
    the sums over batches by the counts. `loss_vocab_chunks` as in make_train_step."""
    def evaluate(params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
        ce, counted = token_losses(graphdef, params, batch, loss_vocab_chunks)
        return ce.sum(), counted.sum(dtype=jnp.int32)

    return jax.jit(evaluate, in_shardings=(param_shardings, batch_sharding(mesh)),
                   out_shardings=NamedSharding(mesh, P()))


def make_routing_probe(graphdef: nnx.GraphDef, param_shardings: dict, mesh: Mesh) -> Callable:
    """(params, inputs {"input_ids" [B,T], and with documents packing "segment_ids",
    "positions" [B,T]}) -> {"max_weight", "entropy", "normalized_entropy": [L,2]
    (NaN at unused sites), "final_*": [] (block, full), "mean_weights": a list, one [N] per used
    site in call order (the last is the final site), of weights averaged over tokens}, and with
    routing gates their values: "gate" [L,2], "final_gate" [] (how far each site has moved from
    its base toward the routed input; all zero right after a preserving conversion)."""
    def probe(params: dict, inputs: Batch) -> dict:
        model = nnx.merge(graphdef, nnx.State(params))
        routing = model.forward(inputs["input_ids"], positions=inputs.get("positions"),
                                segment_ids=inputs.get("segment_ids"),
                                return_routing=True).routing
        stats = routing.statistics()
        stats["mean_weights"] = [w.mean(axis=(1, 2)) for w in routing.calls()]
        layers = params["layers"]
        if "gate" in layers["attn_site"]:
            stats["gate"] = jnp.stack([layers["attn_site"]["gate"], layers["mlp_site"]["gate"]],
                                      axis=1).astype(jnp.float32)
        if "gate" in params.get("final_site", {}):
            stats["final_gate"] = params["final_site"]["gate"].astype(jnp.float32)
        return stats

    return jax.jit(probe, in_shardings=(param_shardings, batch_sharding(mesh)),
                   out_shardings=NamedSharding(mesh, P()))
