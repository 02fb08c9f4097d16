"""Greedy generation matches transformers' generate on a tiny random Qwen3 saved to disk."""
import numpy as np
import pytest

from delta_jax.generate import generate
from delta_jax.loading import load_model, load_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

NEW = 10
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 9], [77]]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    config = transformers.Qwen3Config(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, intermediate_size=64, tie_word_embeddings=False,
        rope_theta=1e6, max_position_embeddings=64, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # peaked logits and non-trivial norms, so a wrong detail changes tokens
        for p in model.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("hf") / "qwen3-tiny"
    model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path, model


def _hf_greedy(model, prompts):
    """Left-padded batch through transformers' generate, do_sample=False."""
    length = max(map(len, prompts))
    ids = torch.tensor([[0] * (length - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return out[:, length:].numpy()


def test_greedy_matches_transformers(hf_folder):
    path, hf_model = hf_folder
    model, tokenizer = load_model(path), load_tokenizer(path)
    assert tokenizer is None and model.config.residual == "baseline"
    ours = generate(model, PROMPTS, max_new_tokens=NEW)
    # Batched with left padding, and each prompt alone.
    np.testing.assert_array_equal(ours.tokens, _hf_greedy(hf_model, PROMPTS))
    for b, prompt in enumerate(PROMPTS):
        np.testing.assert_array_equal(ours.tokens[b], _hf_greedy(hf_model, [prompt])[0])
