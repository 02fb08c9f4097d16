"""AdamW after global-norm clipping, warmup + cosine schedules, and the routing parameters' own lr.

The chain is adamw written out (scale_by_adam -> add_decayed_weights -> scale by -lr) so that the
two learning rates share one Adam state: a single (mu, nu) tree shaped like the parameters, which
keeps the optimizer state's shardings those of the parameters. Decoupled weight decay is scaled by
each group's lr, exactly as optax.adamw does.

Parameter trees here are the pure dicts of `nnx.state(model, nnx.Param).to_pure_dict()`.
"""
from __future__ import annotations

import jax
import optax

from delta_jax.train.config import OptimizerConfig
from delta_jax.train.trainable import is_routing


def _keys(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", k)) for k in path)


def param_groups(params) -> dict:
    """The same tree with "routing" or "base" at every leaf."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "routing" if is_routing(_keys(path)) else "base", params)


def decay_mask(params, mode: str) -> dict:
    """The same tree with True where weight decay applies.

    "all": every parameter (the reference). "matrices": not norm scales, the embedding, nor
    routing parameters (pseudo-queries, their norms, null sources, gates).
    """
    if mode == "all":
        return jax.tree.map(lambda _: True, params)
    if mode != "matrices":
        raise ValueError(f"optimizer.decay={mode!r} is invalid: expected all or matrices")

    def decays(path, _):
        keys = _keys(path)
        return not (is_routing(keys) or keys[0] == "embed_tokens" or keys[-1] == "scale")

    return jax.tree_util.tree_map_with_path(decays, params)


def lr_schedule(peak: float, floor: float, warmup_steps: int, decay_steps: int) -> optax.Schedule:
    """0 -> peak linearly over warmup_steps, then cosine to `floor` at decay_steps (which counts
    the warmup); `floor` afterwards."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak, warmup_steps=warmup_steps,
        decay_steps=max(decay_steps, warmup_steps + 1), end_value=floor)


def schedules(cfg: OptimizerConfig, total_steps: int) -> dict[str, optax.Schedule]:
    """{"base": schedule, "routing": schedule}."""
    decay_steps = cfg.decay_steps or total_steps
    routing_lr = cfg.lr if cfg.routing_lr is None else cfg.routing_lr
    routing_min = cfg.min_lr if cfg.routing_min_lr is None else cfg.routing_min_lr
    return {"base": lr_schedule(cfg.lr, cfg.min_lr, cfg.warmup_steps, decay_steps),
            "routing": lr_schedule(routing_lr, routing_min, cfg.warmup_steps, decay_steps)}


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    lrs = schedules(cfg, total_steps)
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=lambda p: decay_mask(p, cfg.decay)),
        optax.multi_transform({name: optax.scale_by_learning_rate(lr)
                               for name, lr in lrs.items()}, param_groups),
    )
