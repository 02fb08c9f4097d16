"""Training metrics: analytic FLOPs and MFU, the progress line, metrics.jsonl, TensorBoard and
Weights & Biases (train.wandb, optional).

Every process prints the progress line (so a diverging host shows); only process 0 writes files
and logs to W&B.
metrics.jsonl holds one JSON object per step that logged anything (training scalars every
train.log_every steps, validation and routing statistics at their own intervals); NaN becomes
null.
"""
from __future__ import annotations

import json
import math
import secrets
from pathlib import Path
from typing import Any

import numpy as np

from delta_jax.config import ModelConfig
from delta_jax.model.schedule import schedule

# The W&B client this code is tested with (requirements-test.txt, pyproject's `wandb` extra).
WANDB_INSTALL = "pip install wandb==0.31.0"

# Dense bf16 peak FLOP/s per device (vendor datasheets, without sparsity). Matched as a substring
# of jax.Device.device_kind, first hit wins; anything else (CPUs) needs train.peak_tflops.
PEAK_FLOPS = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10", 125e12),
    ("TPU v6", 918e12),  # Trillium ("TPU v6 lite")
    ("TPU v5 lite", 197e12),  # v5e
    ("TPU v5", 459e12),  # v5p reports its kind as "TPU v5"
    ("TPU v4", 275e12),
    ("TPU v3", 123e12),
)


def device_peak_flops(device_kind: str, given_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device: `given_tflops` if set, else the table, else None."""
    if given_tflops is not None:
        return given_tflops * 1e12
    for name, flops in PEAK_FLOPS:
        if name.lower() in device_kind.lower():
            return flops
    return None


def memory_total_bytes(memory) -> int:
    """A compiled program's bytes per device by its memory_analysis(): arguments, temporaries,
    outputs not written in place of donated arguments, and code."""
    return (memory.argument_size_in_bytes + memory.temp_size_in_bytes
            + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.generated_code_size_in_bytes)


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs of one training token (forward + backward = 3 x forward; remat not counted).

    Forward: 2 per weight of every matmul (attention projections, MLP, the output head), causal
    attention scores and values at 2 * 2 * T * H * hd / 2 per layer, and each routing site's
    logits and mix at 2 * 2 * N * D for its N sources.
    """
    d, h, k, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer_weights = d * (h + 2 * k) * hd + h * hd * d + 3 * d * cfg.intermediate_size
    forward = 2 * (cfg.num_layers * layer_weights + d * cfg.vocab_size)
    forward += cfg.num_layers * 2 * seq_len * h * hd
    plan = schedule(cfg)
    sources = int(plan.site_sources(cfg).sum()) + plan.final_sources()
    forward += 4 * sources * d
    return 3.0 * forward


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return _jsonable(value.tolist())
    if isinstance(value, (np.floating, float)):
        return None if not math.isfinite(float(value)) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


def validated_sources(record: dict[str, Any]) -> list[str]:
    """The names of the mixture sources whose validation loss `record` holds (val/NAME/loss)."""
    return [key.split("/")[1] for key in record if key.startswith("val/")
            and key.endswith("/loss")]


def progress_line(step: int, total: int, record: dict[str, Any]) -> str:
    """
    `step 120/400 | loss 2.3456 | lr 1.2e-03 | gnorm 0.53 | 12,345 tok/s | mfu 41.2% | eta 3m05s`.
    """
    parts = [f"step {step}/{total}"]
    if "loss" in record:
        def num(key, fmt):  # null: every step of the window was skipped as non-finite
            return "nan" if record[key] is None else format(record[key], fmt)

        parts += [f"loss {num('loss', '.4f')}", f"lr {record['lr']:.2e}",
                  f"gnorm {num('grad_norm', '.3f')}", f"{record['tokens_per_s']:,.0f} tok/s"]
        if record.get("skipped"):
            parts.append(f"skipped {record['skipped']}")
        if record.get("mfu") is not None:
            parts.append(f"mfu {100 * record['mfu']:.1f}%")
        parts.append(f"eta {format_duration(record['eta_s'])}")
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f} val_ppl {record['val_ppl']:.2f}")
    if sources := validated_sources(record):
        parts.append("val_loss " + " ".join(f"{name} {record[f'val/{name}/loss']:.4f}"
                                            for name in sources))
    return " | ".join(parts)


class MetricsWriter:
    """The progress line on every process; metrics.jsonl and TensorBoard events if `write_files`."""

    def __init__(self, output_dir: Path, *, write_files: bool, tensorboard: bool,
                 resume_step: int, wandb: WandbLogger | None = None):
        """A run resumed at `resume_step` keeps the records up to it and drops later ones (written
        after the checkpoint it resumes from); a fresh run (0) starts an empty file. `wandb`
        (process 0's) gets every record too."""
        self.write_files, self._wandb = write_files, wandb
        self.path = output_dir / "metrics.jsonl"
        self._tb = None
        if write_files:
            kept = [r for r in (read_metrics(self.path) if self.path.exists() else [])
                    if resume_step and r["step"] <= resume_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self._file = self.path.open("a")
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, step: int, total: int, record: dict[str, Any]) -> None:
        record = _jsonable({"step": step, **record})
        # stdout rather than the log: the progress lines are the run's output.
        print(progress_line(step, total, record), flush=True)
        if self.write_files:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
            if self._tb is not None:
                self._tensorboard(step, record)
            if self._wandb is not None:
                self._wandb.log(step, scalars(record))

    def _tensorboard(self, step: int, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self._tb.add_scalar(tag, value, step)
        self._tb.flush()

    def close(self) -> None:
        if self.write_files:
            self._file.close()
            if self._tb is not None:
                self._tb.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as {tag: number}: train/KEY, eval/KEY (validation, a mixture's
    sources as eval/val/NAME/loss), routing/STAT[/layerL_SITE]; nulls left out."""
    tags = {}
    for key, value in record.items():
        if key == "routing":
            for stat, v in value.items():
                if not isinstance(v, list):  # final_* of the block modes
                    if v is not None:
                        tags[f"routing/{stat}"] = v
                    continue
                for layer, sites in enumerate(v):
                    for site, x in zip(("attn", "mlp"), sites):
                        if x is not None:  # the unused layer-0 site of the delta modes
                            tags[f"routing/{stat}/layer{layer}_{site}"] = x
        elif key != "step" and isinstance(value, (int, float)):
            tags[f"{'eval' if key.startswith('val') else 'train'}/{key}"] = value
    return tags


def require_wandb(project: str) -> None:
    """An ImportError naming the install command if the wandb package is missing."""
    try:
        import wandb  # noqa: F401
    except ImportError as e:
        raise ImportError(f"train.wandb.project={project!r} needs the wandb package, which is "
                          f"not installed ({e}); install it: {WANDB_INSTALL}") from e


class WandbLogger:
    """One W&B run per output_dir (a resumed run continues it: its id is kept in
    <output_dir>/wandb/run_id): the run config, each metrics record's scalars (the TensorBoard
    tags) at its step, and the end-of-run plots as images. Offline runs write
    <output_dir>/wandb/offline-run-*/ (`wandb sync` uploads them later)."""

    def __init__(self, cfg, output_dir: Path, config: dict[str, Any]):
        import wandb

        self._wandb = wandb
        id_file = output_dir / "wandb" / "run_id"
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if not id_file.is_file():
            id_file.write_text(secrets.token_hex(8) + "\n")
        self.run = wandb.init(project=cfg.project, name=cfg.name or output_dir.name,
                              group=cfg.group, mode=cfg.mode, dir=str(output_dir),
                              config=config, id=id_file.read_text().strip(), resume="allow")

    def log(self, step: int, tags: dict[str, float]) -> None:
        self.run.log(tags, step=step)

    def finish(self, step: int, plots: dict[str, str]) -> None:
        """Log the PNGs {name: path} at `step` and close the run."""
        if plots:
            self.run.log({f"plots/{name}": self._wandb.Image(path)
                          for name, path in plots.items()}, step=step)
        self.run.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a torn last line (the process was killed mid-write) is
    dropped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines[:-1]]
    try:
        records += [json.loads(line) for line in lines[-1:]]
    except json.JSONDecodeError:
        pass
    return records
