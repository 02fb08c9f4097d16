"""Run configuration: YAML files and `section.key=value` overrides -> frozen dataclasses.

A run file has top-level keys `output_dir` and `seed` and one mapping per section (model, data,
train, optimizer, checkpoint, mesh, distributed). Unknown keys are rejected with the list of valid
ones; values are checked against the field types (ints for int fields, "1e-4" is a float, null
for optional fields), so a typo fails before anything is compiled.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from delta_jax.config import ModelConfig, current_fields
from delta_jax.data.corpus import DEFAULT_CACHE_DIR, EMBEDDED
from delta_jax.data.pipeline import PACKINGS
from delta_jax.train.trainable import ALL, check_matches, check_selection

DECAY_MASKS = ("all", "matrices")
WANDB_MODES = ("online", "offline", "disabled")


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    """One source of data.mixture (docs/data.md#mixtures)."""
    name: str  # its metrics' name: val/<name>/loss, train/mix/<name>
    path: str  # as data.path, but a prepared directory (or "embedded", "embedded:code", ...)
    weight: float  # its share of training examples, relative to the other sources' weights


@dataclasses.dataclass(frozen=True)
class DataConfig:
    # "embedded" (the stdlib-docstring corpus, byte tokenizer), a directory written by
    # `python -m delta_jax.data prepare`, or "tfds:NAME?data_dir=...&tokenizer=...". Null
    # (what a config with data.mixture gets) with data.mixture.
    path: str | None = EMBEDDED
    # Instead of data.path: a list of {name, path, weight}, each training example drawn from one
    # source with probability weight / sum of weights, each source validated apart.
    mixture: tuple[MixtureSource, ...] = ()
    cache_dir: str = DEFAULT_CACHE_DIR  # where "embedded" is built and prepared on first use
    validation_split: str = "validation"
    num_threads: int = 2  # grain read-ahead threads per process
    prefetch: int = 4  # batches read ahead
    # How documents share a window (docs/data.md#packing): "documents" keeps each apart
    # (attention, positions, no loss on the token after an EOS); "concat" is the paper's recipe
    # (attention across documents, positions 0..T-1) and what runs saved before this key used.
    packing: str = "documents"


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging (docs/training.md#weights--biases): on when `project` is set."""
    project: str | None = None
    name: str | None = None  # the run's name; None = the output_dir's folder name
    mode: str = "online"  # online, offline (files under <output_dir>/wandb, no network), disabled
    group: str | None = None  # the runs of one study, shown together


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8  # global, in sequences, per optimizer step
    seq_len: int = 256
    grad_accum: int = 1  # microbatches per step; batch_size must divide by it
    # >1: the loss forms the [B,T,V] logits this many vocabulary chunks at a time and never
    # whole (train/loss.py); must divide model.vocab_size. 1: whole logits.
    loss_vocab_chunks: int = 1
    log_every: int = 10
    eval_every: int = 100  # validation perplexity; 0 = only at the end
    eval_batches: int = 8  # global validation batches per evaluation (fewer if the split ends)
    routing_every: int = 100  # routing sharpness; 0 = only at the end
    init_from: str | None = None  # a model checkpoint (delta_jax.checkpoint layout) to fine-tune
    # The parameters trained: all; routing (the routing sites' pseudo-queries, their norms, null
    # sources and gates); or parameter-path patterns (train/trainable.py says what they match).
    # The others are frozen: no gradient, no optimizer state, no weight decay.
    trainable: tuple[str, ...] = (ALL,)
    peak_tflops: float | None = None  # per-device peak for MFU; None = the table in metrics.py
    tensorboard: bool = True
    plots: bool = True
    # Consecutive steps with a non-finite loss or gradient (each skipped: parameters and
    # optimizer state untouched) after which the run stops; see docs/recovery.md.
    max_nonfinite_steps: int = 10
    # For tests only: steps (1-based) whose loss is made NaN inside the jitted step.
    inject_nan_steps: tuple[int, ...] = ()
    # Compiled programs kept here (`python -m delta_jax.train` sets it up), so that a restart
    # loads the step instead of compiling it; null = no cache (docs/training.md#restarts).
    compilation_cache_dir: str | None = "~/.cache/delta_jax/jax"
    # "FIRST,LAST": trace steps FIRST..LAST (1-based) with jax.profiler into
    # <output_dir>/tensorboard, TensorBoard's Profile tab; empty = no trace.
    profile_steps: tuple[int, ...] = ()
    wandb: WandbConfig = WandbConfig()


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    lr: float = 6e-4
    min_lr: float = 6e-5  # the cosine's floor
    warmup_steps: int = 1000
    decay_steps: int | None = None  # warmup included; None = train.steps
    routing_lr: float | None = None  # peak lr of the routing parameters; None = lr
    routing_min_lr: float | None = None  # None = min_lr
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    # "all" decays every parameter (the reference); "matrices" spares norms, embeddings and
    # routing vectors.
    decay: str = "all"


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    # None = <output_dir>/checkpoints; may be a bucket (gs://...) that every host reaches.
    directory: str | None = None
    every: int = 1000  # steps between permanent saves; 0 = only at the end
    keep: int = 3  # newest permanent checkpoints kept
    # A temporary checkpoint once this many minutes have passed since the last save; each
    # replaces the previous temporary one once it is written. 0 = none (docs/recovery.md).
    every_minutes: float = 15.0
    async_save: bool = True
    # Continue from the newest complete checkpoint; false refuses to start over existing ones.
    resume: bool = True
    # A failed read of a checkpoint is tried again this many times, after retry_wait_s, then
    # twice that, ..., before the checkpoint counts as damaged: remote stores fail transiently.
    read_retries: int = 2
    retry_wait_s: float = 2.0


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    # Devices per axis within one TPU slice or GPU node (ICI, NVLink); one may be -1 (the rest
    # of the slice). On one slice these are the mesh.
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # Slices (or nodes) each axis spans over the data-centre network (DCN); one may be -1 (the
    # slices left). An axis's size is its in-slice part times this. By default every slice goes
    # on data, so a config written for one slice runs on N unchanged, data N times larger.
    dcn_data: int = -1
    dcn_fsdp: int = 1
    dcn_tensor: int = 1

    @property
    def per_slice(self) -> tuple[int, int, int]:
        return self.data, self.fsdp, self.tensor

    @property
    def across_slices(self) -> tuple[int, int, int]:
        return self.dcn_data, self.dcn_fsdp, self.dcn_tensor


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    # jax.distributed.initialize(); with the three fields below unset, SLURM and Cloud TPU
    # detect themselves. launch/local.sh sets them for processes on one machine.
    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None


@dataclasses.dataclass(frozen=True)
class RunConfig:
    output_dir: str = "runs/default"
    seed: int = 0  # parameter init and data order
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()

    def __post_init__(self):
        t, o = self.train, self.optimizer
        checks = [
            (t.steps >= 1, "train.steps", t.steps, "an integer >= 1"),
            (t.batch_size >= 1, "train.batch_size", t.batch_size, "an integer >= 1"),
            (t.seq_len >= 1, "train.seq_len", t.seq_len, "an integer >= 1"),
            (t.grad_accum >= 1 and t.batch_size % t.grad_accum == 0, "train.grad_accum",
             t.grad_accum, f"a divisor of train.batch_size={t.batch_size}"),
            (t.loss_vocab_chunks >= 1
             and self.model.vocab_size % t.loss_vocab_chunks == 0, "train.loss_vocab_chunks",
             t.loss_vocab_chunks, f"a divisor of model.vocab_size={self.model.vocab_size}"),
            (t.log_every >= 1, "train.log_every", t.log_every, "an integer >= 1"),
            (t.max_nonfinite_steps >= 1, "train.max_nonfinite_steps", t.max_nonfinite_steps,
             "an integer >= 1"),
            (check_selection(t.trainable) is None, "train.trainable", ",".join(t.trainable),
             check_selection(t.trainable)),
            (o.decay in DECAY_MASKS, "optimizer.decay", o.decay, " or ".join(DECAY_MASKS)),
            (self.data.packing in PACKINGS, "data.packing", self.data.packing,
             " or ".join(PACKINGS)),
            (not (self.data.packing == "documents" and self.model.attention == "cudnn"),
             "data.packing", self.data.packing,
             "concat with model.attention=cudnn (cuDNN's attention takes no segment ids; "
             "or use attention xla or splash)"),
            (t.wandb.mode in WANDB_MODES, "train.wandb.mode", t.wandb.mode,
             " or ".join(WANDB_MODES)),
            (o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps, "an integer >= 0"),
            (self.checkpoint.keep >= 1, "checkpoint.keep", self.checkpoint.keep,
             "an integer >= 1"),
            (self.checkpoint.every_minutes >= 0, "checkpoint.every_minutes",
             self.checkpoint.every_minutes, "a number of minutes >= 0 (0: no temporary "
             "checkpoints)"),
            (t.profile_steps == () or (len(t.profile_steps) == 2
                                       and 1 <= t.profile_steps[0] <= t.profile_steps[1]),
             "train.profile_steps", t.profile_steps, "FIRST,LAST with 1 <= FIRST <= LAST, or "
             "empty"),
            (self.checkpoint.read_retries >= 0, "checkpoint.read_retries",
             self.checkpoint.read_retries, "an integer >= 0"),
            (self.checkpoint.retry_wait_s >= 0, "checkpoint.retry_wait_s",
             self.checkpoint.retry_wait_s, "a number of seconds >= 0"),
        ] + [(sizes.count(-1) <= 1 and all(n == -1 or n >= 1 for n in sizes), "mesh", sizes,
               f"{part} sizes >= 1 with at most one -1") for part, sizes in (
                  ("in-slice (data, fsdp, tensor)", self.mesh.per_slice),
                  ("across-slice (dcn_data, dcn_fsdp, dcn_tensor)", self.mesh.across_slices))]
        for ok, key, value, expected in checks:
            if not ok:
                raise ValueError(f"{key}={value!r} is invalid: expected {expected}")
        _check_mixture(self.data)
        check_matches(self.model, t.trainable)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_mixture(data: DataConfig) -> None:
    """data.path xor data.mixture; the sources named apart, with positive weights."""
    if data.mixture and data.path is not None:
        raise ValueError(f"data.path={data.path!r} and data.mixture are exclusive: give one "
                         "(a config with data.mixture has no data.path)")
    if not data.mixture and data.path is None:
        raise ValueError("data.path=None is invalid: expected a prepared directory, embedded or "
                         "tfds:NAME (or a data.mixture)")
    names = [s.name for s in data.mixture]
    for i, source in enumerate(data.mixture):
        if not source.name or "/" in source.name or source.name in names[:i]:
            raise ValueError(f"data.mixture[{i}].name={source.name!r} is invalid: expected a "
                             "unique name without '/' (it names the source's metrics)")
        if not source.weight > 0:
            raise ValueError(f"data.mixture[{i}].weight={source.weight!r} is invalid: expected "
                             "a number > 0")
        if source.path.startswith("tfds:"):
            raise ValueError(f"data.mixture[{i}].path={source.path!r} is invalid: expected a "
                             "prepared directory (a TFDS stream is not random access; prepare "
                             "its text with `python -m delta_jax.data prepare`)")


def _coerce(value: Any, kind: Any, key: str, where: str) -> Any:
    """`value` (from YAML, or a string from the command line) as type `kind`, or an error."""
    def fail():
        name = getattr(kind, "__name__", str(kind))
        raise ValueError(f"{where}: {key}={value!r} is invalid: expected {name}")

    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `X | None`
        if value is None or (isinstance(value, str) and value.lower() in ("null", "none", "~")):
            return None
        (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is tuple:  # tuple[X, ...]: a YAML list or "a,b,c"
        (item, _) = typing.get_args(kind)
        if isinstance(value, str):
            value = [v for v in value.strip("[]() ").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            fail()
        if dataclasses.is_dataclass(item):  # a list of mappings, such as data.mixture
            return tuple(_build_item(item, v, f"{key}[{i}]", where)
                         for i, v in enumerate(value))
        return tuple(_coerce(v, item, key, where) for v in value)
    if kind is bool:
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        if not isinstance(value, bool):
            fail()
        return value
    if kind in (int, float):
        if isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                fail()
        accepted = int if kind is int else (int, float)  # an int is a valid float, not vice versa
        if isinstance(value, bool) or not isinstance(value, accepted):
            fail()
        return kind(value)
    if kind is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            fail()
        return str(value)
    raise TypeError(f"unsupported config field type {kind!r} for {key}")


def _build_item(cls, value: Any, key: str, where: str):
    if not isinstance(value, dict):
        raise ValueError(f"{where}: {key} must be a mapping of {cls.__name__} fields, got "
                         f"{value!r}")
    if missing := [f.name for f in dataclasses.fields(cls) if f.name not in value
                   and f.default is dataclasses.MISSING]:
        raise ValueError(f"{where}: {key} lacks {', '.join(missing)}")
    return _build(cls, value, f"{key}.", where)


def _build(cls, values: dict[str, Any], prefix: str, where: str):
    if cls is ModelConfig:  # a run config written before a field was renamed or retired
        values = current_fields(values, where)
    if cls is DataConfig and values.get("mixture") and "path" not in values:
        values = {**values, "path": None}  # the default path is for runs without a mixture
    types_ = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(types_))
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(prefix + k for k in unknown)}; "
                         f"valid keys: {', '.join(prefix + k for k in types_)}")
    kwargs = {}
    for key, value in values.items():
        kind = types_[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: {prefix}{key} must be a mapping of "
                                 f"{kind.__name__} fields, got {value!r}")
            kwargs[key] = _build(kind, value, f"{prefix}{key}.", where)
        else:
            kwargs[key] = _coerce(value, kind, prefix + key, where)
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def _set_dotted(tree: dict, dotted: str, value: str) -> None:
    *sections, key = dotted.split(".")
    for section in sections:
        node = tree.setdefault(section, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted}: {section} is not a section")
        tree = node
    tree[key] = value


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """RunConfig from a YAML file (or the defaults) and `section.key=value` overrides.

    Override values are parsed by the field's type, so `optimizer.lr=1e-4` and
    `train.init_from=null` work as written.
    """
    tree: dict[str, Any] = {}
    where = "defaults"
    if path is not None:
        where = str(path)
        try:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(tree, dict):
            raise ValueError(f"{path}: expected a mapping of sections, got {type(tree).__name__}")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r}: expected section.key=value")
        _set_dotted(tree, key.strip(), value.strip())
    if overrides:
        where += " + overrides " + " ".join(overrides)
    return _build(RunConfig, tree, "", where)


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
