"""The paper's comparison on your data and budget: one training run per (variant, seed).

`python -m delta_jax.compare --config configs/X.yaml --variants baseline,delta --seeds 0,1,2`
(the command line is in __main__.py) plans one ordinary `delta_jax.train` run per pair, trains
the ones not finished yet, then writes the report (report.py).

Every run is the config with `model.residual=<variant> seed=<seed>
output_dir=<output>/<variant>/seed<seed>` on top of the user's overrides, so the runs of one seed
read the same batches in the same order (the global batch of step s is a function of the seed
and s alone) and all runs train the same number of tokens; a seed changes both the
initialisation and the data order, so the spread over seeds is the noise a rerun would show.

A run folder is `finished` when its metrics hold the validation loss of the last step and its
checkpoint of that step exists, `unfinished` when it was started (the trainer resumes it from
its newest checkpoint), `new` otherwise. A finished run trained with another config is refused
rather than mixed into the report.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

from delta_jax.config import RESIDUALS
from delta_jax.train.config import RunConfig, load_config
from delta_jax.train.metrics import read_metrics

logger = logging.getLogger(__name__)

# Set per run by compare; an override of these would make the runs collide or differ.
RUN_KEYS = ("model.residual", "seed", "output_dir")
FINISHED, UNFINISHED, NEW = "finished", "unfinished", "new"


@dataclasses.dataclass(frozen=True)
class PlannedRun:
    """One (variant, seed) training run: its resolved config and the train overrides."""
    variant: str
    seed: int
    config_path: str
    overrides: tuple[str, ...]  # the user's, then RUN_KEYS'
    config: RunConfig

    @property
    def name(self) -> str:
        return f"{self.variant}/seed{self.seed}"

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output_dir)

    def train_command(self, python: str = "python") -> list[str]:
        return [python, "-m", "delta_jax.train", "--config", self.config_path, *self.overrides]


def parse_variants(text: str) -> list[str]:
    variants = [v.strip() for v in text.split(",") if v.strip()]
    unknown = [v for v in variants if v not in RESIDUALS]
    if not variants or unknown:
        raise ValueError(f"--variants {text!r}: expected a comma-separated list of "
                         f"{', '.join(RESIDUALS)}")
    if len(set(variants)) != len(variants):
        raise ValueError(f"--variants {text!r}: a variant is named twice")
    return variants


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ValueError(f"--seeds {text!r}: expected distinct non-negative integers, "
                         "comma-separated, e.g. 0,1,2")
    return seeds


def plan_runs(config_path: str, variants: Sequence[str], seeds: Sequence[int], output: str,
              overrides: Sequence[str] = (), wandb_group: str | None = None
              ) -> list[PlannedRun]:
    """The runs, seed-major (every variant of seed 0, then of seed 1, ...): a comparison cut
    short, or slowed down by other load on the host, still covers every variant alike.
    `wandb_group` puts the runs in one W&B group, each named <variant>/seed<seed>."""
    for item in overrides:
        key = item.partition("=")[0].strip()
        if key in RUN_KEYS:
            raise ValueError(f"override {item!r}: compare sets {key} for each run (use "
                             "--variants, --seeds and --output)")
    runs = []
    for seed in seeds:
        for variant in variants:
            run_overrides = (*overrides, f"model.residual={variant}", f"seed={seed}",
                             f"output_dir={Path(output) / variant / f'seed{seed}'}")
            if wandb_group is not None:
                run_overrides += (f"train.wandb.group={wandb_group}",
                                  f"train.wandb.name={variant}/seed{seed}")
            runs.append(PlannedRun(variant, seed, str(config_path), run_overrides,
                                   load_config(config_path, list(run_overrides))))
    if wandb_group is not None and runs and runs[0].config.train.wandb.project is None:
        raise ValueError(f"--wandb-group {wandb_group}: the runs log to no W&B project; set "
                         "train.wandb.project (in the config or as an override)")
    return runs


def checkpoint_dir(run: PlannedRun) -> Path:
    return Path(run.config.checkpoint.directory or run.output_dir / "checkpoints")


def run_status(run: PlannedRun) -> str:
    """FINISHED, UNFINISHED or NEW (module doc); ValueError if the folder holds a run of
    another config."""
    saved = run.output_dir / "config.yaml"
    if not saved.is_file():
        return NEW
    if difference := config_difference(saved, run.config):
        raise ValueError(f"{run.output_dir}: trained with another config than this comparison's "
                         f"({difference}); use a new --output or the run's own overrides")
    steps = run.config.train.steps
    metrics = run.output_dir / "metrics.jsonl"
    final = [r for r in read_metrics(metrics) if r["step"] == steps and "val_loss" in r
             ] if metrics.is_file() else []
    if final and (checkpoint_dir(run) / str(steps)).is_dir():
        return FINISHED
    return UNFINISHED


def config_difference(saved: Path, cfg: RunConfig) -> str:
    """`key: saved -> now` for the fields of the saved config.yaml that differ, dotted ("" if
    none). Fields the file does not hold (added to delta_jax after the run) are not compared,
    nor train.wandb (where a run is tracked does not change what it trains)."""
    def flatten(tree, prefix=""):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from flatten(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    written = dict(flatten(yaml.safe_load(saved.read_text()) or {}))
    old = dict(flatten(load_config(saved).to_dict()))  # the written values, typed
    new = dict(flatten(cfg.to_dict()))
    return ", ".join(f"{k}: {old[k]!r} -> {new.get(k)!r}" for k in sorted(written)
                     if old.get(k) != new.get(k) and not k.startswith("train.wandb."))


class RunFailed(RuntimeError):
    def __init__(self, run: PlannedRun, returncode: int):
        super().__init__(f"{run.name}: python -m delta_jax.train exited with {returncode} "
                         f"(its output is above; the run folder is {run.output_dir})")
        self.returncode = returncode


def train(run: PlannedRun) -> None:
    """Train (or resume) one run in a child process, its output prefixed with the run's name.

    A child process per run: each gets a fresh JAX runtime, the run is the very command
    `--print-commands` shows, and a SIGTERM to compare reaches the child, which checkpoints
    and exits 75 (docs/recovery.md); RunFailed carries its exit code on.
    """
    command = run.train_command(sys.executable)
    logger.info("%s: %s", run.name, shlex.join(command))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, bufsize=1, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    forward = lambda signum, _frame: child.send_signal(signum)  # noqa: E731
    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for line in child.stdout:
            print(f"[{run.name}] {line}", end="", flush=True)
        returncode = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if returncode:
        raise RunFailed(run, returncode)


def train_all(runs: Sequence[PlannedRun]) -> dict[str, str]:
    """Train every run that is not finished, in order; {run name: status before}."""
    before = {run.name: run_status(run) for run in runs}
    todo = [run for run in runs if before[run.name] != FINISHED]
    logger.info("%d runs: %d finished, %d to resume, %d new", len(runs),
                sum(s == FINISHED for s in before.values()),
                sum(s == UNFINISHED for s in before.values()),
                sum(s == NEW for s in before.values()))
    for number, run in enumerate(todo, 1):
        logger.info("run %d of %d: %s (%s)", number, len(todo), run.name, before[run.name])
        train(run)
    return before
