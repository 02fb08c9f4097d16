"""The tools on a device mesh: perplexity, greedy decoding, routing statistics, log-likelihoods and
save_pretrained with the parameters sharded over 8 fake CPU devices give the one-device numbers;
--mesh's syntax; two processes through launch/local.sh evaluate and convert as one process does.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from delta_jax import ModelConfig, init_model
from delta_jax.analyze import routing_statistics
from delta_jax.checkpoint import load_checkpoint, save_checkpoint
from delta_jax.convert import orbax_to_hf
from delta_jax.convert.__main__ import main as convert_main
from delta_jax.data.tokenizers import get_tokenizer
from delta_jax.eval import perplexity, read_stream
from delta_jax.eval.__main__ import main as eval_main
from delta_jax.generate import generate
from delta_jax.hf.save import save_pretrained
from delta_jax.loading import load_model
from delta_jax.scoring import loglikelihood
from delta_jax.sharding import make_mesh

REPO = Path(__file__).resolve().parents[1]
TEXT = Path(__file__).parent / "data" / "udhr_article1.txt"
# (data, fsdp, tensor): batches of 4 split over fsdp alone, or over data alone (4 % 8 != 0)
MESHES = {"fsdp4_tensor2": (1, 4, 2), "data2_fsdp4": (2, 4, 1)}
PROMPTS = [[1, 2, 3], [5, 6, 7, 8, 9], [40], [100, 101, 102, 103]]
REQUESTS = [([1, 2, 3], [4, 5]), ([7], [8, 9, 10]), ([33, 34, 35, 36], [37]), ([2], [2, 2])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # vocab 264 holds the byte tokenizer's 257 ids.
    model = init_model(ModelConfig.tiny(vocab_size=264, residual="delta", init_std=0.2), seed=0)
    path = tmp_path_factory.mktemp("sharded") / "ckpt"
    save_checkpoint(model, path)
    return path


@pytest.fixture(scope="module")
def one_device(checkpoint):
    return load_model(checkpoint)


@pytest.fixture(scope="module", params=list(MESHES.values()), ids=list(MESHES))
def sharded(checkpoint, request):
    return load_model(checkpoint, mesh=make_mesh(*request.param))


@pytest.fixture(scope="module")
def stream():
    return read_stream([TEXT], tokenizer=get_tokenizer("byte"), max_tokens=200)


def test_parameters_are_sharded(sharded):
    weight = sharded.layers.mlp.gate_proj[...]  # [L, D, F]: embed -> fsdp, mlp -> tensor
    mesh = weight.sharding.mesh
    fsdp, tensor = mesh.shape["fsdp"], mesh.shape["tensor"]
    assert weight.sharding.spec == P(None, "fsdp", "tensor" if tensor > 1 else None)
    assert weight.addressable_shards[0].data.shape == (4, 32 // fsdp, 64 // tensor)


def test_perplexity_matches_one_device(sharded, one_device, stream):
    # 7 windows in batches of 4: one full batch, one padded
    want = perplexity(one_device, stream, seq_len=32, batch_size=4)
    got = perplexity(sharded, stream, seq_len=32, batch_size=4)
    assert (got["tokens"], got["windows"]) == (want["tokens"], want["windows"]) == (199, 7)
    np.testing.assert_allclose(got["nll"], want["nll"], rtol=1e-5)
    np.testing.assert_allclose(got["bits_per_byte"], want["bits_per_byte"], rtol=1e-5)


def test_greedy_tokens_match_one_device(sharded, one_device):
    want = generate(one_device, PROMPTS, max_new_tokens=8, keep_logits=True)
    got = generate(sharded, PROMPTS, max_new_tokens=8, keep_logits=True)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_routing_statistics_match_one_device(sharded, one_device, stream):
    want = routing_statistics(one_device, stream, seq_len=32, max_windows=6, batch_size=4)
    got = routing_statistics(sharded, stream, seq_len=32, max_windows=6, batch_size=4)
    assert [r["site"] for r in got["sites"]] == [r["site"] for r in want["sites"]]
    for name in ("max_weight", "entropy", "mean_weights"):
        np.testing.assert_allclose(np.hstack([r[name] for r in got["sites"]]),
                                   np.hstack([r[name] for r in want["sites"]]), rtol=1e-5,
                                   atol=1e-6)


def test_loglikelihoods_match_one_device(sharded, one_device):
    want = loglikelihood(one_device, REQUESTS, batch_size=4, pad_multiple=8)
    got = loglikelihood(sharded, REQUESTS, batch_size=4, pad_multiple=8)
    np.testing.assert_allclose([s for s, _ in got], [s for s, _ in want], rtol=1e-5)
    assert [g for _, g in got] == [g for _, g in want]


def test_lm_eval_adapter_takes_the_mesh_sizes(checkpoint, one_device):
    pytest.importorskip("lm_eval")
    from delta_jax.lm_eval_adapter import DeltaJaxLM

    # lm-eval passes --model_args values as strings (fsdp=4,tensor=2)
    lm = DeltaJaxLM(pretrained=str(checkpoint), tokenizer="byte", batch_size=4, max_length=64,
                    fsdp="4", tensor="2")
    assert lm.model.layers.mlp.gate_proj[...].sharding.spec == P(None, "fsdp", "tensor")
    want = loglikelihood(one_device, REQUESTS, batch_size=4, max_length=64)
    np.testing.assert_allclose([s for s, _ in lm._loglikelihood_tokens(REQUESTS)],
                               [s for s, _ in want], rtol=1e-5)


def test_save_pretrained_writes_the_one_device_bytes(sharded, one_device, tmp_path):
    one = save_pretrained(one_device, tmp_path / "one", max_shard_size="100KB")
    many = save_pretrained(sharded, tmp_path / "many", max_shard_size="100KB")
    names = sorted(p.name for p in one.iterdir())
    assert names == sorted(p.name for p in many.iterdir()) and len(names) == 4  # 2 shards
    for name in names:
        assert (one / name).read_bytes() == (many / name).read_bytes(), name


def test_eval_cli_mesh(checkpoint, capsys):
    args = ["--model", str(checkpoint), "--data", str(TEXT), "--tokenizer", "byte",
            "--seq-len", "32", "--batch-size", "4", "--max-tokens", "200"]
    want = eval_main(args)
    capsys.readouterr()
    got = eval_main([*args, "--mesh", "1,-1,2"])
    out, err = capsys.readouterr()
    assert json.loads(out)["nll"] == got["nll"]
    np.testing.assert_allclose(got["nll"], want["nll"], rtol=1e-5)
    assert "parameters on mesh data 1 x fsdp 4 x tensor 2 (8 devices, 1 processes)" in err


@pytest.mark.parametrize("mesh, message", [
    ("1,4,1", "--mesh 1,4,1: mesh data=1 x fsdp=4 x tensor=1 = 4 devices, but 8 are available"),
    ("1,4", "--mesh 1,4: expected three device counts DATA,FSDP,TENSOR"),
    ("0,8,1", "--mesh 0,8,1: expected three device counts"),
    ("-1,-1,2", "--mesh -1,-1,2: expected three device counts"),
    ("1,3,-1", "--mesh 1,3,-1: mesh tensor=-1: 8 devices do not split over the other axes' 3"),
])
def test_bad_mesh_exits_2(checkpoint, capsys, mesh, message):
    with pytest.raises(SystemExit) as exit_info:
        eval_main(["--model", str(checkpoint), "--data", str(TEXT), f"--mesh={mesh}"])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_hf_to_orbax_on_a_mesh(one_device, tmp_path, capsys):
    hf = save_pretrained(one_device, tmp_path / "hf")
    assert convert_main(["hf-to-orbax", str(hf), str(tmp_path / "ckpt"), "--mesh", "1,4,2"]) == 0
    restored = load_checkpoint(tmp_path / "ckpt")
    np.testing.assert_array_equal(restored.layers.self_attn.q_proj[...],
                                  one_device.layers.self_attn.q_proj[...])


# Two processes, one fake CPU device each: the parameters span both (fsdp 2).
def _launch(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run([str(REPO / "launch/local.sh"), "2", *args],
                          env={**env, "CPU_DEVICES": "2", "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "parameters on mesh data 1 x fsdp 2 x tensor 1 (2 devices, 2 processes)" in done.stdout
    return done


def test_two_processes_evaluate_as_one(checkpoint, one_device, stream, tmp_path):
    out = tmp_path / "eval.json"
    done = _launch("--module", "delta_jax.eval", "--model", str(checkpoint), "--data", str(TEXT),
                   "--tokenizer", "byte", "--seq-len", "32", "--batch-size", "4",
                   "--max-tokens", "200", "--mesh", "1,2,1", "--output", str(out))
    got = json.loads(out.read_text())
    want = perplexity(one_device, stream, seq_len=32, batch_size=4)
    np.testing.assert_allclose(got["nll"], want["nll"], rtol=1e-5)
    assert got["tokens"] == want["tokens"]
    assert "[p0] {" in done.stdout and "[p1] {" not in done.stdout  # process 0 alone reports


@pytest.mark.slow
def test_two_processes_convert_to_the_same_bytes(checkpoint, tmp_path):
    _launch("--module", "delta_jax.convert", "orbax-to-hf", str(checkpoint), str(tmp_path / "two"),
            "--mesh", "1,2,1", "--max-shard-size", "100KB")
    orbax_to_hf(checkpoint, tmp_path / "one", max_shard_size="100KB")
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir()) and len(names) == 4
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging
