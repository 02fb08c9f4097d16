"""Tokenizers: byte-level, Qwen3's BPE (against ids produced by Hugging Face's Qwen2/3 tokenizer)
and a tokenizer.json built here."""
import json

import numpy as np
import pytest

from delta_jax.data.tokenizers import get_tokenizer, token_dtype, write_byte_tokenizer

TEXTS = ["", "plain ASCII.", "héllo wörld — ünïcödé ✓", "日本語のテキスト",
         "emoji 🤗 and\ttabs\n\nnewlines"]

# Expected ids from the integration test of transformers' Qwen2 tokenizer (Qwen/Qwen-tokenizer,
# the vocabulary Qwen2, 2.5 and 3 share); <|im_start|>/<|im_end|> ids from a Qwen2 tokenizer test.
QWEN_GOLDEN = [
    ("Transformers (formerly known as pytorch-transformers and pytorch-pretrained-bert) provides "
     "general-purpose architectures (BERT, GPT-2, RoBERTa, XLM, DistilBert, XLNet...) for Natural "
     "Language Understanding (NLU) and Natural Language Generation (NLG) with over 32+ pretrained "
     "models in 100+ languages and deep interoperability between Jax, PyTorch and TensorFlow.",
     [8963, 388, 320, 69514, 3881, 438, 4510, 27414, 32852, 388, 323, 4510, 27414, 21334, 35722,
      1455, 529, 8, 5707, 4586, 58238, 77235, 320, 61437, 11, 479, 2828, 12, 17, 11, 11830, 61437,
      64, 11, 1599, 10994, 11, 27604, 321, 33, 529, 11, 29881, 6954, 32574, 369, 18448, 11434,
      45451, 320, 45, 23236, 8, 323, 18448, 11434, 23470, 320, 30042, 38, 8, 448, 916, 220, 18,
      17, 10, 80669, 4119, 304, 220, 16, 15, 15, 10, 15459, 323, 5538, 94130, 2897, 1948, 619,
      706, 11, 5355, 51, 21584, 323, 94986, 13]),
    ('```python\ntokenizer = AutoTokenizer.from_pretrained("Qwen/Qwen-tokenizer")\n'
     'tokenizer("世界，你好！")```',
     [73594, 12669, 198, 85593, 284, 8979, 37434, 6387, 10442, 35722, 445, 48, 16948, 45274,
      16948, 34841, 3135, 1138, 85593, 445, 99489, 3837, 108386, 6313, 899, 73594]),
    ("<|im_start|>hello<|im_end|>", [151644, 14990, 151645]),
]


def test_byte_tokenizer_is_utf8():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("byte", 257, 256)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.encode_array(text).tolist() == ids
        assert tok.decode(ids) == text
    assert tok.decode([104, 105, 256, 106]) == "hi<|endoftext|>j"
    assert tok.decode([104, 300, 105, 383]) == "h\ufffdi\ufffd"  # a rounded-up vocabulary's


@pytest.mark.parametrize("text,ids", QWEN_GOLDEN,
                         ids=["english", "code_and_chinese", "chat_markers"])
def test_qwen3_matches_reference_ids(text, ids):
    tok = get_tokenizer("qwen3")
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_qwen3_special_tokens():
    tok = get_tokenizer("qwen3")
    assert (tok.eos_id, tok.vocab_size) == (151643, 151669)
    assert tok.encode("<|endoftext|>") == [151643]
    assert tok.encode("<think>\n</think>") == [151667, 198, 151668]
    assert tok.encode("e\u0301") == tok.encode("é")  # NFC, like tokenizer.json's normaliser
    assert token_dtype(tok.vocab_size) == np.uint32 and token_dtype(257) == np.uint16


def _train_tokenizer_json(path, special):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXTS * 20, trainer)
    tok.save(str(path))


def test_tokenizer_json(tmp_path):
    path = tmp_path / "tokenizer.json"
    _train_tokenizer_json(path, ["<pad>", "</s>"])
    tok = get_tokenizer(str(path))
    assert tok.eos_id == 1 and tok.vocab_size == 320
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert get_tokenizer(str(tmp_path)).encode("héllo") == tok.encode("héllo")  # a model folder


def test_tokenizer_json_eos_from_config(tmp_path):
    _train_tokenizer_json(tmp_path / "tokenizer.json", ["<pad>", "</s>", "<eod>"])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eod>"}}))
    assert get_tokenizer(str(tmp_path / "tokenizer.json")).eos_id == 2


def test_tokenizer_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json: no such tokenizer file"):
        get_tokenizer(str(tmp_path / "nope.json"))
    _train_tokenizer_json(tmp_path / "tokenizer.json", ["<pad>"])
    with pytest.raises(ValueError, match="tokenizer.json: cannot tell the EOS token"):
        get_tokenizer(str(tmp_path / "tokenizer.json"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        get_tokenizer(str(tmp_path / "bad"))


def test_byte_tokenizer_as_tokenizer_json(tmp_path):
    """The byte tokenizer written for exports gives the same ids, to us and to transformers."""
    write_byte_tokenizer(tmp_path)
    exported, byte = get_tokenizer(str(tmp_path)), get_tokenizer("byte")
    assert (exported.vocab_size, exported.eos_id) == (byte.vocab_size, byte.eos_id) == (257, 256)
    texts = [*TEXTS, " two  spaces\tand a tab\n", "naïve ✓ 日本語", "\x00\x7f\u00ff"]
    for text in texts:
        assert exported.encode(text) == byte.encode(text), text
        assert exported.decode(byte.encode(text)) == text
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.eos_token_id == 256
    for text in texts:
        assert hf(text, add_special_tokens=False).input_ids == byte.encode(text), text
