"""Tokenizers from local Hugging Face files (``tokenizer.json``), plus the
character-level tokenizer that the bundled models are built with.

Only the fast-tokenizer JSON format is read: it is data, not code.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"


class Tokenizer:
    """Text <-> token ids, with the stop tokens the engine needs."""

    def __init__(self, tok: HFTokenizer, eos_token_ids: list[int], pad_token_id: int, bos_token_id: int | None) -> None:
        self.tok = tok
        self.eos_token_ids = eos_token_ids
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @classmethod
    def load(cls, path: str | Path, eos_from_config: list[int] | None = None) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast-tokenizer files are supported)")
        tok = HFTokenizer.from_file(str(file))
        meta = {}
        if (path / "tokenizer_config.json").is_file():
            meta = json.loads((path / "tokenizer_config.json").read_text())

        def token_id(key: str) -> int | None:
            value = meta.get(key)
            if isinstance(value, dict):  # older files store AddedToken dicts
                value = value.get("content")
            return tok.token_to_id(value) if isinstance(value, str) else None

        eos: list[int] = []
        gen = path / "generation_config.json"
        if gen.is_file():
            raw = json.loads(gen.read_text()).get("eos_token_id")
            eos = [raw] if isinstance(raw, int) else list(raw or [])
        eos = eos or list(eos_from_config or [])
        if (tid := token_id("eos_token")) is not None and tid not in eos:
            eos.append(tid)
        if not eos:
            raise ValueError(
                f"{path}: no end-of-sequence token in generation_config.json, config.json or tokenizer_config.json"
            )
        pad = token_id("pad_token")
        return cls(tok, eos, eos[0] if pad is None else pad, token_id("bos_token"))

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(path / "tokenizer.json"))
        inv = {v: k for k, v in self.tok.get_vocab().items()}
        meta = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": inv[self.eos_token_ids[0]],
            "pad_token": inv[self.pad_token_id],
            "bos_token": None if self.bos_token_id is None else inv[self.bos_token_id],
            "model_max_length": 4096,
        }
        (path / "tokenizer_config.json").write_text(json.dumps(meta, indent=2) + "\n")


def char_tokenizer() -> Tokenizer:
    """One token per printable ASCII character (plus newline), <bos> prepended.

    Small vocabularies keep the bundled models tiny; the file it writes is an
    ordinary tokenizer.json that transformers loads too.
    """
    specials = [PAD, BOS, EOS]
    chars = list(string.printable[:95]) + ["\n"]  # digits, letters, punctuation, space
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.add_special_tokens(specials)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return Tokenizer(tok, [vocab[EOS]], vocab[PAD], vocab[BOS])
