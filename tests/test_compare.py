"""`python -m delta_jax.compare` end to end on a tiny config (2 variants x 2 seeds x 4 steps):
real training runs in child processes, skip-on-rerun, resuming an unfinished run, the report's
numbers against the runs' own metrics, the figures, and the errors."""
import argparse
import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import yaml
from scipy import stats

from delta_jax.compare import (
    FINISHED,
    NEW,
    UNFINISHED,
    parse_seeds,
    parse_variants,
    plan_runs,
    run_status,
)
from delta_jax.compare.__main__ import main
from delta_jax.compare.report import paired_difference
from delta_jax.data.prepare import prepare
from delta_jax.model.causal_lm import count_params
from delta_jax.train.config import load_config
from delta_jax.train.metrics import read_metrics

VARIANTS, SEEDS, STEPS = ("baseline", "delta_block"), (0, 1), 4
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A prepared corpus (docstrings of this interpreter's modules) and the tiny run config."""
    root = tmp_path_factory.mktemp("compare")
    with (root / "docs.jsonl").open("w") as f:
        for module in (json, math, shutil, textwrap, argparse):
            for name in dir(module):
                doc = getattr(getattr(module, name), "__doc__", None)
                if isinstance(doc, str) and len(doc) > 40:
                    f.write(json.dumps({"text": doc}) + "\n")
    prepare([root / "docs.jsonl"], root / "data", validation_fraction=0.2, progress=False)
    config = root / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"vocab_size": 260, "hidden_size": 32, "num_layers": 2, "num_heads": 2,
                  "num_kv_heads": 1, "head_dim": 16, "intermediate_size": 64, "num_blocks": 2},
        "data": {"path": str(root / "data"), "num_threads": 1},
        "train": {"steps": STEPS, "batch_size": 8, "seq_len": 32, "log_every": 1,
                  "eval_every": 2, "eval_batches": 2, "routing_every": 2, "plots": False},
        "optimizer": {"lr": 1e-2, "warmup_steps": 1},
        "checkpoint": {"every": 2, "keep": 3}}))
    return root, config


def losses(report):
    return [(s["variant"], s["val_loss"], s["loss_vs_reference"]) for s in report["variants"]]


def compare_args(config, output, *extra):
    return ["--config", str(config), "--variants", ",".join(VARIANTS),
            "--seeds", ",".join(map(str, SEEDS)), "--output", str(output), *extra]


@pytest.fixture(scope="module")
def compared(setup):
    """The comparison, run once: (output folder, the report main returned, the planned runs)."""
    root, config = setup
    output = root / "runs"
    report = main(compare_args(config, output))
    return output, report, plan_runs(str(config), VARIANTS, SEEDS, str(output))


@pytest.mark.slow
def test_every_pair_is_an_ordinary_finished_train_run(compared):
    output, _, runs = compared
    assert [run.name for run in runs] == ["baseline/seed0", "delta_block/seed0",
                                          "baseline/seed1", "delta_block/seed1"]
    for run in runs:
        folder = output / run.variant / f"seed{run.seed}"
        assert run.output_dir == folder and run_status(run) == FINISHED
        saved = yaml.safe_load((folder / "config.yaml").read_text())
        assert (saved["model"]["residual"], saved["seed"]) == (run.variant, run.seed)
        assert (folder / "checkpoints" / str(STEPS)).is_dir()
    # Same seed, same data order: the configs differ in the residual and the folder alone.
    for seed in SEEDS:
        a, b = (yaml.safe_load((output / v / f"seed{seed}" / "config.yaml").read_text())
                for v in VARIANTS)
        assert a["model"].pop("residual") != b["model"].pop("residual")
        assert a.pop("output_dir") != b.pop("output_dir")
        assert a == b


@pytest.mark.slow
def test_report_agrees_with_the_runs_metrics(compared):
    output, report, runs = compared
    assert json.loads((output / "compare.json").read_text()) == report
    final = {(run.variant, run.seed): next(
        r for r in read_metrics(run.output_dir / "metrics.jsonl")
        if r["step"] == STEPS and "val_loss" in r) for run in runs}
    summaries = {s["variant"]: s for s in report["variants"]}
    assert list(summaries) == list(VARIANTS) and report["missing"] == []
    for variant, summary in summaries.items():
        losses = [final[variant, s]["val_loss"] for s in SEEDS]
        assert summary["seeds"] == list(SEEDS)
        assert summary["val_loss"]["mean"] == pytest.approx(np.mean(losses), abs=1e-12)
        assert summary["val_loss"]["std"] == pytest.approx(np.std(losses, ddof=1), abs=1e-12)
        assert summary["params"] == count_params(runs[VARIANTS.index(variant)].config.model)
        assert summary["tokens_per_s"] > 0
    diffs = [final["delta_block", s]["val_loss"] - final["baseline", s]["val_loss"]
             for s in SEEDS]
    half = stats.t.ppf(0.975, 1) * np.std(diffs, ddof=1) / math.sqrt(2)
    got = summaries["delta_block"]["loss_vs_reference"]
    assert got["mean"] == pytest.approx(np.mean(diffs), abs=1e-12)
    assert (got["low"], got["high"]) == pytest.approx((np.mean(diffs) - half,
                                                      np.mean(diffs) + half), abs=1e-12)
    assert summaries["baseline"]["step_time_ratio"] == pytest.approx(1.0)
    assert summaries["baseline"]["loss_vs_reference"] is None
    # Routing: delta_block alone routes; its statistics come from the analyze code.
    (routing,) = report["routing"]
    assert routing["variant"] == "delta_block" and routing["seeds"] == 2
    assert all(0 < site["max_weight"] <= 1 for site in routing["sites"])
    for name in ("loss.png", "routing.png"):
        assert (output / name).read_bytes()[:8] == PNG
    table = (output / "compare.md").read_text()
    assert "| delta_block | 2 |" in table and f"{got['mean']:+.4f}" in table


@pytest.mark.slow
def test_a_rerun_trains_nothing_and_rebuilds_the_same_report(compared, setup, capsys):
    output, report, runs = compared
    before = {run.name: (run.output_dir / "metrics.jsonl").read_bytes() for run in runs}
    capsys.readouterr()
    again = main(compare_args(setup[1], output))
    assert "[baseline/seed0]" not in capsys.readouterr().out  # no training child ran
    assert {run.name: (run.output_dir / "metrics.jsonl").read_bytes() for run in runs} == before
    assert losses(again) == losses(report)  # its throughput is this run's own
    assert main(compare_args(setup[1], output, "--report-only"))["variants"] == report["variants"]


@pytest.mark.slow
def test_an_unfinished_run_is_resumed_to_the_same_result(compared, setup, capsys):
    """Take the last checkpoint and the metrics after step 2 away: the run is unfinished,
    --print-commands lists it alone, and compare resumes it from step 2 to the same loss."""
    output, report, runs = compared
    run = runs[-1]
    metrics = run.output_dir / "metrics.jsonl"
    records = read_metrics(metrics)
    shutil.rmtree(run.output_dir / "checkpoints" / str(STEPS))
    metrics.write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] <= 2))
    assert run_status(run) == UNFINISHED
    capsys.readouterr()
    main(compare_args(setup[1], output, "--print-commands"))
    (command,) = capsys.readouterr().out.splitlines()
    assert command.startswith("python -m delta_jax.train --config ")
    assert command.endswith(f"model.residual={run.variant} seed={run.seed} "
                            f"output_dir={run.output_dir}")
    again = main(compare_args(setup[1], output))
    assert run_status(run) == FINISHED
    assert read_metrics(metrics)[-1]["val_loss"] == records[-1]["val_loss"]  # bitwise resume
    assert losses(again) == losses(report)  # its throughput is this run's own


@pytest.mark.slow
def test_status_and_refusals(compared, setup, tmp_path):
    output, _, _ = compared
    config = setup[1]
    (fresh,) = plan_runs(str(config), ["delta"], [5], str(tmp_path))
    assert run_status(fresh) == NEW
    (changed,) = plan_runs(str(config), ["baseline"], [0], str(output), ["train.steps=6"])
    with pytest.raises(ValueError, match=r"train.steps: 4 -> 6"):
        run_status(changed)
    # A run saved before a config field existed (here: without checkpoint.read_retries) is
    # compared on the fields it holds.
    older = tmp_path / "older"
    shutil.copytree(output / "baseline" / "seed0", older / "baseline" / "seed0")
    saved = older / "baseline" / "seed0" / "config.yaml"
    tree = yaml.safe_load(saved.read_text())
    del tree["checkpoint"]["read_retries"]
    tree["output_dir"] = str(older / "baseline" / "seed0")
    saved.write_text(yaml.safe_dump(tree))
    (run,) = plan_runs(str(config), ["baseline"], [0], str(older))
    assert run_status(run) == FINISHED
    # where a run is tracked is no change of what it trains
    (tracked,) = plan_runs(str(config), ["baseline"], [0], str(output),
                           ["train.wandb.project=delta"], wandb_group="study")
    assert run_status(tracked) == FINISHED
    with pytest.raises(ValueError, match="compare sets seed"):
        plan_runs(str(config), ["delta"], [0], str(tmp_path), ["seed=3"])
    with pytest.raises(ValueError, match="--variants 'delta,resnet'"):
        parse_variants("delta,resnet")
    with pytest.raises(ValueError, match="distinct non-negative"):
        parse_seeds("0,0")


@pytest.mark.parametrize("args, message", [
    (["--variants", "delta,nope"], "expected a comma-separated list of baseline"),
    (["--report-only"], "none of the 2 runs has finished"),
    (["train.steps=x"], "train.steps='x' is invalid"),
])
def test_command_line_errors_exit_2(setup, tmp_path, capsys, args, message):
    argv = ["--config", str(setup[1]), "--variants", "baseline,delta", "--seeds", "0",
            "--output", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv + args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_paired_difference_interval():
    got = paired_difference({0: 1.0, 1: 2.0, 2: 3.0, 7: 9.0}, {0: 0.5, 1: 1.0, 2: 2.5})
    half = 4.302652729911275 * 0.28867513459481287 / math.sqrt(3)  # t(0.975, 2) * sd / sqrt(n)
    assert got["seeds"] == [0, 1, 2]
    assert got["mean"] == pytest.approx(2 / 3)
    assert (got["low"], got["high"]) == pytest.approx((2 / 3 - half, 2 / 3 + half))
    assert paired_difference({0: 1.0}, {0: 0.25}) == {"seeds": [0], "mean": 0.75, "low": None,
                                                      "high": None}
    assert paired_difference({1: 1.0}, {0: 1.0}) is None


def test_a_failing_run_stops_the_comparison_with_its_exit_code(setup, tmp_path, capsys):
    """A run whose data cannot be read: the trainer's preflight exits 2, compare exits with it."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(setup[1]), "--variants", "baseline", "--seeds", "0",
              "--output", str(tmp_path / "out"), f"data.path={tmp_path / 'missing'}"])
    assert exit_info.value.code == 2
    assert "baseline/seed0: python -m delta_jax.train exited with 2" in capsys.readouterr().err



@pytest.mark.slow
def test_sigterm_reaches_the_running_child_which_checkpoints(setup, tmp_path):
    """SIGTERM to compare (as a scheduler sends it) is passed to the training child: it saves
    its step and exits 75, and so does compare; the run is left unfinished, to be resumed."""
    argv = [sys.executable, "-m", "delta_jax.compare", "--config", str(setup[1]),
            "--variants", "delta", "--seeds", "0", "--output", str(tmp_path),
            "train.steps=2000", "checkpoint.every=0"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("[delta/seed0] step 2/2000"):
            proc.send_signal(signal.SIGTERM)
            break
    output = "".join(seen) + proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, output[-3000:]
    step = int(re.search(r"\[delta/seed0\] SIGTERM received: checkpointed step (\d+)",
                         output)[1])
    (run,) = plan_runs(str(setup[1]), ["delta"], [0], str(tmp_path),
                       ["train.steps=2000", "checkpoint.every=0"])
    assert run_status(run) == UNFINISHED
    assert (run.output_dir / "checkpoints" / str(step)).is_dir()


def test_print_commands_puts_the_study_in_one_wandb_group(setup, tmp_path, capsys):
    """Each printed command logs its run to the group under its own name; the train command
    line reads them as such. Without a W&B project the group is refused."""
    argv = ["--config", str(setup[1]), "--variants", "baseline,delta", "--seeds", "0,1",
            "--output", str(tmp_path / "out"), "--print-commands", "--wandb-group", "study-1"]
    main(argv + ["train.wandb.project=delta", "train.wandb.mode=offline"])
    commands = [shlex.split(line) for line in capsys.readouterr().out.splitlines()]
    assert len(commands) == 4
    tracked = [load_config(c[c.index("--config") + 1], c[c.index("--config") + 2:]).train.wandb
               for c in commands]
    assert {w.group for w in tracked} == {"study-1"} and {w.project for w in tracked} == {"delta"}
    assert [w.name for w in tracked] == ["baseline/seed0", "delta/seed0", "baseline/seed1",
                                         "delta/seed1"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "--wandb-group study-1: the runs log to no W&B project" in capsys.readouterr().err
