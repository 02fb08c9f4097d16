"""README's tour runs as written after `make demo`: the commands of its "Evaluate, analyse the
routing, generate" block, read from README.md, on a short demo run, then a conversion round
trip of that run. Real processes, real files, the demo's own corpus."""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a training run and a dozen fresh processes: about 3 minutes
REPO = Path(__file__).resolve().parents[1]
STEPS = 12
PROMPT = "Return the "


def readme_commands(heading: str) -> list[list[str]]:
    """The commands of the first ```bash block under `heading` in README.md, continuation
    lines joined and comments dropped."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    joined = block.replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines() if line.strip()]


def python(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`python -m ...` in a fresh process, as a user runs it; fails the test on a non-zero exit."""
    assert args[0] == "python", args
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("XLA_FLAGS", None)  # one CPU device, as on a newcomer's machine
    done = subprocess.run([sys.executable, *args[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, f"{shlex.join(args)}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """A working directory holding what `make demo` leaves, trained for STEPS steps."""
    root = tmp_path_factory.mktemp("tour")
    python(["python", "-m", "delta_jax.train", "--config", str(REPO / "configs/demo.yaml"),
            f"train.steps={STEPS}", "train.eval_every=6", "train.routing_every=6",
            "checkpoint.every=6"], cwd=root)
    return root


def final_val_ppl(run: Path) -> float:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["val_ppl"] for r in records if "val_ppl" in r][-1]


def test_evaluate_analyse_generate_as_written(demo):
    commands = readme_commands("### Evaluate, analyse the routing, generate")
    assert [c[2] for c in commands] == ["delta_jax.eval", "delta_jax.analyze",
                                        "delta_jax.generate"]
    assert all("runs/demo" in c for c in commands)
    eval_out, analyze_out, generate_out = (python(c, demo) for c in commands)
    result = json.loads(eval_out.stdout)
    assert (result["packing"], result["windows"], result["seq_len"]) == ("documents", 312, 128)
    assert "packing: documents, seq_len: 128 (the run's" in eval_out.stderr
    assert "L3.mlp" in analyze_out.stdout
    assert (demo / "analysis" / "heatmap_delta_block.png").is_file()
    assert PROMPT in generate_out.stdout


def test_eval_gives_the_trainer_s_validation_perplexity(demo):
    """docs/evaluation.md: the run's packing and seq_len over the trainer's validation tokens
    (8 batches x 16 windows x 128, one more for the last label) give its final perplexity."""
    done = python(["python", "-m", "delta_jax.eval", "--model", "runs/demo", "--data",
                   "embedded", "--max-tokens", str(8 * 16 * 128 + 1)], demo)
    assert json.loads(done.stdout)["perplexity"] == pytest.approx(final_val_ppl(demo / "runs/demo"),
                                                                rel=1e-6)


def test_conversion_round_trip_keeps_the_model_and_its_tokenizer(demo):
    """orbax-to-hf writes the demo's byte tokenizer with the weights, so generate reads the
    export without --tokenizer and decodes as the run; hf-to-orbax brings it back unchanged."""
    commands = [["python", "-m", "delta_jax.convert", "orbax-to-hf", "runs/demo/checkpoints",
                 "out/demo-hf"],
                ["python", "-m", "delta_jax.convert", "hf-to-orbax", "out/demo-hf",
                 "ckpt/demo"]]
    for command in commands:
        python(command, demo)
    config = json.loads((demo / "out/demo-hf/config.json").read_text())
    assert config["eos_token_id"] == 256 < config["vocab_size"]
    greedy = ["--prompt", PROMPT, "--max-new-tokens", "16", "--greedy", "--json"]
    texts = [json.loads(python(["python", "-m", "delta_jax.generate", "--model", model, *greedy],
                               demo).stdout)["results"][0]["text"]
             for model in ("runs/demo", "out/demo-hf", "ckpt/demo")]
    assert texts[0] == texts[1] == texts[2] and texts[0]
    scores = [json.loads(python(["python", "-m", "delta_jax.eval", "--model", model, "--data",
                                 "embedded", "--seq-len", "128", "--max-tokens", "4097",
                                 "--packing", "documents"], demo).stdout)["perplexity"]
              for model in ("runs/demo", "out/demo-hf", "ckpt/demo")]
    assert scores[1] == pytest.approx(scores[0], rel=1e-6) and scores[2] == scores[1]
