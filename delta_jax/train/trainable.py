"""Which parameters a run trains (`train.trainable`), and the split of a parameter tree into
its trainable and frozen parts.

A selection is ("all",), ("routing",) (the routing sites' pseudo-queries, their norms, null
sources and gates: the RoutingSite modules) or parameter-path patterns. A path is the parameter's
keys in the pure dict of `nnx.state(model, nnx.Param)` joined by "/", e.g.
"layers/attn_site/query", "final_site/gate", "embed_tokens", "layers/self_attn/q_norm/scale".
A pattern selects a parameter when it matches, by `fnmatch.fnmatchcase` (case-sensitive; `*`
also crosses "/"), the path or the path of a module that holds it: "final_site" and
"final_site/*" both select the final site's parameters, "*_site/query" every pseudo-query. The
layers are stacked ([L, ...] arrays), so a pattern selects a parameter in every layer or none.

Trees here are nested dicts shaped like the parameters (the parameters themselves, their
PartitionSpecs or shardings, gradients): `split` and `merge` only walk the dicts, so any leaf
type works.
"""
from __future__ import annotations

import fnmatch

ALL, ROUTING = "all", "routing"
# Routing parameters live under these modules (the reference names them *res_*).
ROUTING_MODULES = ("attn_site", "mlp_site", "final_site")


def is_routing(path: tuple[str, ...]) -> bool:
    return any(part in ROUTING_MODULES for part in path)


def check_selection(selection: tuple[str, ...]) -> str | None:
    """What is wrong with `selection` as written (None if nothing): the parameters it matches
    are checked by `check_matches`."""
    if not selection:
        return "all, routing or a list of parameter-path patterns"
    if len(selection) > 1 and {ALL, ROUTING} & set(selection):
        return f"{ALL} or {ROUTING} alone, or a list of parameter-path patterns"
    return None


def _selects(selection: tuple[str, ...], path: tuple[str, ...]) -> bool:
    if selection == (ALL,):
        return True
    if selection == (ROUTING,):
        return is_routing(path)
    prefixes = ["/".join(path[:n]) for n in range(1, len(path) + 1)]
    return any(fnmatch.fnmatchcase(prefix, pattern)
               for pattern in selection for prefix in prefixes)


def _paths(tree: dict, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for key, value in tree.items():
        path = (*prefix, str(key))
        paths.extend(_paths(value, path) if isinstance(value, dict) else [path])
    return paths


def trainable_paths(params: dict, selection: tuple[str, ...]) -> list[str]:
    """The '/'-joined paths of the parameters of `params` that `selection` trains; a
    ValueError naming train.trainable and the first pattern that matches no parameter."""
    paths = _paths(params)
    if selection not in ((ALL,), (ROUTING,)):
        for pattern in selection:
            if not any(_selects((pattern,), path) for path in paths):
                raise ValueError(
                    f"train.trainable pattern {pattern!r} matches no parameter; the model's "
                    f"parameters: {', '.join('/'.join(p) for p in paths)}")
    return ["/".join(path) for path in paths if _selects(selection, path)]


def split(tree: dict, selection: tuple[str, ...], prefix: tuple[str, ...] = ()
          ) -> tuple[dict, dict]:
    """(the trainable leaves, the frozen leaves) of a parameter-shaped tree, each as a nested
    dict of the same keys holding only its leaves (modules left empty are dropped)."""
    trainable, frozen = {}, {}
    for key, value in tree.items():
        path = (*prefix, str(key))
        if isinstance(value, dict):
            sub_trainable, sub_frozen = split(value, selection, path)
            if sub_trainable:
                trainable[key] = sub_trainable
            if sub_frozen:
                frozen[key] = sub_frozen
        elif _selects(selection, path):
            trainable[key] = value
        else:
            frozen[key] = value
    return trainable, frozen


def merge(trainable: dict, frozen: dict) -> dict:
    """The whole tree again from `split`'s two parts."""
    merged = dict(frozen)
    for key, value in trainable.items():
        merged[key] = merge(value, frozen[key]) if key in frozen else value
    return merged


def check_matches(model_cfg, selection: tuple[str, ...]) -> None:
    """`trainable_paths`'s ValueError if `selection` selects nothing of the model of
    `model_cfg` (a ModelConfig) or has a pattern that matches nothing; patterns are checked
    against the model's abstract parameters (shapes only, nothing allocated)."""
    if selection == (ALL,):
        return
    if selection == (ROUTING,):
        if not model_cfg.has_routing:
            raise ValueError(f"train.trainable={ROUTING!r} selects no parameter of this model: "
                             f"model.residual={model_cfg.residual!r} has no routing sites")
        return
    from delta_jax.train.state import abstract_graph_and_params  # the model, only for patterns

    trainable_paths(abstract_graph_and_params(model_cfg)[1].to_pure_dict(), selection)
