"""The attention kernels of ModelConfig.attention: splash (Pallas interpret mode on CPU) against
XLA's, alone, sharded and in whole models; cuDNN's errors off GPU; what auto picks where, and
splash compiled for TPU by auto (cuDNN by auto for H100s: tests/test_plan_gpu.py)."""
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from delta_jax import ModelConfig, init_model
from delta_jax.model.attention_kernels import auto_kernel, causal_attention, splash_block
from delta_jax.plan import kernel_flops
from delta_jax.sharding import make_mesh

# float32 throughout: both kernels compute the same softmax, differing only in summation order
# (splash's online softmax over 128..512-wide kv blocks), observed ~1e-6 on outputs.
TOL = dict(rtol=1e-5, atol=2e-5)


def qkv(batch, seq, heads, kv_heads, head_dim, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq, heads, head_dim))
    k = jax.random.normal(keys[1], (batch, seq, kv_heads, head_dim))
    v = jax.random.normal(keys[2], (batch, seq, kv_heads, head_dim))
    return q, k, v


def attention_and_grads(kind, q, k, v, segment_ids=None):
    """-> (out [B,T,H,hd], (dq, dk, dv)) for a loss that weighs every output differently."""
    scale = q.shape[-1] ** -0.5
    attend = lambda q, k, v: causal_attention(q, k, v, kind=kind, scale=scale,
                                              segment_ids=segment_ids)
    loss = lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))
    return jax.jit(attend)(q, k, v), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


def assert_close_tree(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.mark.parametrize("seq,head_dim", [(128, 8), (256, 64)])
def test_splash_matches_xla(seq, head_dim):
    q, k, v = qkv(2, seq, 4, 2, head_dim)
    assert_close_tree(attention_and_grads("splash", q, k, v),
                      attention_and_grads("xla", q, k, v), **TOL)


@pytest.mark.parametrize("mesh_axes", [(2, 2, 2), (1, 2, 4)], ids=["kv-split", "kv-repeated"])
@pytest.mark.slow
def test_splash_under_a_mesh_matches_xla(mesh_axes):
    """shard_map over batch and heads; on tensor=4 the 2 kv heads are repeated to 4."""
    q, k, v = qkv(2, 128, 4, 2, 16, seed=1)
    expected = attention_and_grads("xla", q, k, v)
    with jax.set_mesh(make_mesh(*mesh_axes)):
        assert_close_tree(attention_and_grads("splash", q, k, v), expected, **TOL)


def packed_segments(batch, seq, seed=0):
    """[B,T] int32 segment ids of documents of random lengths (1 to T/5) packed in each row."""
    rng = np.random.default_rng(seed)
    rows = [np.cumsum(np.isin(np.arange(seq), np.cumsum(rng.integers(1, seq // 5, seq))))
            for _ in range(batch)]
    return jnp.asarray(np.stack(rows), jnp.int32)


def test_splash_with_segment_ids_matches_xla():
    q, k, v = qkv(2, 256, 4, 2, 16, seed=2)
    segments = packed_segments(2, 256)
    assert len(np.unique(segments[0])) > 4
    packed = attention_and_grads("splash", q, k, v, segments)
    assert_close_tree(packed, attention_and_grads("xla", q, k, v, segments), **TOL)
    # and the segments matter: a document's first token sees only itself
    first = np.flatnonzero(np.diff(np.asarray(segments[0]))) + 1
    np.testing.assert_allclose(packed[0][0, first[0], 0], v[0, first[0], 0], rtol=1e-5)


@pytest.mark.parametrize("mesh_axes", [(2, 2, 2), (1, 2, 4)], ids=["kv-split", "kv-repeated"])
@pytest.mark.slow
def test_splash_with_segment_ids_under_a_mesh_matches_xla(mesh_axes):
    q, k, v = qkv(2, 128, 4, 2, 16, seed=3)
    segments = packed_segments(2, 128, seed=1)
    expected = attention_and_grads("xla", q, k, v, segments)
    with jax.set_mesh(make_mesh(*mesh_axes)):
        assert_close_tree(attention_and_grads("splash", q, k, v, segments), expected, **TOL)


def test_cudnn_refuses_segment_ids():
    q, k, v = qkv(1, 8, 4, 2, 8)
    with pytest.raises(ValueError, match=r"attention='cudnn' cannot take segment ids.*"
                                         r"data.packing=concat"):
        causal_attention(q, k, v, kind="cudnn", scale=1.0,
                         segment_ids=jnp.zeros((1, 8), jnp.int32))


def test_splash_block_sizes():
    assert [splash_block(t) for t in (128, 256, 384, 1024, 2048 + 128)] == [128, 256, 128, 512,
                                                                           128]
    with pytest.raises(ValueError, match=r"attention='splash'.*block size 128, got T=100"):
        splash_block(100)


def model_loss_and_grads(cfg, ids, params_from):
    """Loss and parameter gradients of `cfg`'s model carrying `params_from`'s parameters."""
    graphdef, _, rest = nnx.split(init_model(cfg, 3), nnx.Param, ...)
    params = nnx.state(params_from, nnx.Param)

    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(ids[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean(), logits

    return jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(params)


@pytest.mark.parametrize("residual,runtime", [
    ("baseline", {}), ("delta", {}),
    pytest.param("delta_block", dict(remat="save_dots", layer_driver="scan"),  # under remat
                 marks=pytest.mark.slow),
], ids=["baseline", "delta", "delta_block-remat"])
def test_model_with_splash_matches_xla(residual, runtime):
    cfg = ModelConfig.tiny(init_std=0.2, residual=residual, **runtime)
    ids = jax.random.randint(jax.random.key(1), (2, 129), 0, cfg.vocab_size)
    model = init_model(cfg, 3)
    (loss, logits), grads = model_loss_and_grads(cfg.replace(attention="splash"), ids, model)
    (loss_x, logits_x), grads_x = model_loss_and_grads(cfg, ids, model)
    np.testing.assert_allclose(loss, loss_x, rtol=1e-6)
    np.testing.assert_allclose(logits, logits_x, rtol=1e-5, atol=1e-5)
    assert_close_tree(grads, grads_x, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_decoding_keeps_the_xla_path():
    """A splash model decodes at any length: the cached path never calls the kernel."""
    cfg = ModelConfig.tiny(init_std=0.2, residual="delta")
    ids = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
    xla = init_model(cfg, 3)
    splash = init_model(cfg.replace(attention="splash"), 3)
    expected = xla.forward(ids).logits
    out = splash.forward(ids[:, :5], cache=splash.init_cache(2, 8))
    out = splash.forward(ids[:, 5:], cache=out.cache).logits
    np.testing.assert_allclose(out, expected[:, 5:], rtol=1e-5, atol=1e-5)


def test_cudnn_off_gpu_names_field_value_and_the_gpu():
    model = init_model(ModelConfig.tiny(attention="cudnn", dtype="bfloat16"), 0)
    with pytest.raises(ValueError, match=r"ModelConfig.attention='cudnn' needs an NVIDIA GPU"
                                         r".*platform 'cpu'"):
        model(jnp.zeros((1, 8), jnp.int32))


@pytest.mark.parametrize("overrides,message", [
    (dict(attention="flash"), r"ModelConfig.attention='flash' is invalid: expected one of auto, "
                              r"xla, splash, cudnn"),
    (dict(attention="cudnn"), r"attention='cudnn' is invalid with dtype='float32'"),
])
def test_attention_config_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.tiny(**overrides)


def test_attention_is_a_runtime_field():
    cfg = ModelConfig.tiny()
    assert cfg.architecture() == cfg.replace(attention="splash").architecture()


@pytest.mark.parametrize("platform,seq_len,head_dim,dtype,segments,kernel", [
    ("tpu", 2048, 64, "bfloat16", False, "splash"),
    ("tpu", 512, 8, "float32", True, "splash"),    # splash takes segment ids and float32
    ("tpu", 320, 64, "bfloat16", False, "xla"),    # no splash block divides T
    ("gpu", 2048, 128, "bfloat16", False, "cudnn"),
    ("cuda", 2048, 64, "float16", False, "cudnn"),
    ("gpu", 2048, 64, "float32", False, "xla"),    # cuDNN's fused attention is 16-bit only
    ("gpu", 2048, 64, "bfloat16", True, "xla"),    # cuDNN takes no segment ids
    ("gpu", 2048, 256, "bfloat16", False, "xla"),  # over what every GPU generation takes
    ("gpu", 2048, 12, "bfloat16", False, "xla"),   # not a multiple of 8
    ("cpu", 2048, 64, "bfloat16", False, "xla"),
])
def test_auto_takes_the_platforms_kernel_where_the_inputs_allow(platform, seq_len, head_dim,
                                                                dtype, segments, kernel):
    assert auto_kernel(platform, seq_len=seq_len, head_dim=head_dim, dtype=dtype,
                       segments=segments) == kernel


@pytest.mark.slow
def test_auto_is_the_default_and_runs_xla_on_cpu():
    cfg = ModelConfig.tiny(residual="delta")
    assert cfg.attention == "auto"
    # T = 128, where splash (interpret mode) would run too and differ in the last bits
    ids = jax.random.randint(jax.random.key(1), (2, 128), 0, cfg.vocab_size)
    auto, xla = (init_model(cfg.replace(attention=kind), 0) for kind in ("auto", "xla"))
    np.testing.assert_array_equal(auto(ids), xla(ids))


needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason="libtpu is not installed: no TPU compiler to compile splash for v5p")


@needs_libtpu
@pytest.mark.parametrize("seq_len,splash_calls", [
    (512, True), pytest.param(320, False, marks=pytest.mark.slow)])
def test_auto_compiles_splash_into_the_train_step_for_tpu(seq_len, splash_calls):
    """The whole train step of a small model with attention auto (the default), compiled for
    v5p:2x2x1 under an fsdp x tensor mesh: splash lowers to Mosaic (not interpret mode) inside
    shard_map where its block divides T, and XLA's attention runs where none does."""
    from attention_aot import compile_train_step, tpu_devices

    sizes = dict(vocab_size=256, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=128, intermediate_size=512, residual="delta", remat="none")
    compiled = compile_train_step(
        [f"model.{k}={v}" for k, v in sizes.items()]
        + [f"train.seq_len={seq_len}", "train.batch_size=4"],
        tpu_devices("v5p:2x2x1"), dict(data=1, fsdp=2, tensor=2))
    hlo = compiled.as_text()
    assert ("tpu_custom_call" in hlo) is splash_calls
    # The planner counts each call's matmuls from this text: per layer two forward calls (2
    # [T,T] matmuls each; the lean driver recomputes the layer in its backward pass), a dq (3)
    # and a dkv (4), here on 2 rows and 2 heads a device; one 512 block covers the square.
    square = 2 * 2 * 2 * seq_len * seq_len * 128
    counted = kernel_flops.splash_attention_flops(hlo, rows=2, seq_len=seq_len, heads=2,
                                                  head_dim=128, block=512)
    assert counted == (2 * 11 * square if splash_calls else 0)
    assert kernel_flops.attention_kernel_in(hlo) == ("splash" if splash_calls else "xla")
