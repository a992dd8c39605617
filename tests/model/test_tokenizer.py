"""The character tokenizer and the tokenizer.json files it writes."""

import json
import string

import pytest
from transformers import AutoTokenizer

from pivotrl.model import Tokenizer, char_tokenizer

TEXTS = [
    "12+345=357",
    "The quick brown fox\njumps over 13 lazy dogs.",
    "  two leading spaces, two trailing  ",
    "\n\nblank lines\n\n",
    string.digits + string.ascii_letters + string.punctuation + " \n",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return char_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("tok")
    tok.save(path)
    return path


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert len(ids) == len(text) + 1  # one token per character, plus <bos>
    assert tok.decode(ids) == text


def test_bos_prepended(tok):
    ids = tok.encode("ab")
    assert tok.bos_token_id is not None
    assert ids[0] == tok.bos_token_id
    assert tok.bos_token_id not in ids[1:]
    assert tok.encode("ab", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids, skip_special_tokens=False) == "<bos>ab"


def test_special_ids(tok):
    assert tok.vocab_size == 99  # 3 specials + 95 printable characters + newline
    assert len(tok.eos_token_ids) == 1
    eos = tok.eos_token_ids[0]
    assert tok.tok.id_to_token(eos) == "<eos>"
    assert tok.tok.id_to_token(tok.pad_token_id) == "<pad>"
    assert len({eos, tok.pad_token_id, tok.bos_token_id}) == 3
    assert eos not in tok.encode(TEXTS[-1])
    assert tok.decode([*tok.encode("hi"), eos]) == "hi"


def test_distinct_ids_per_character(tok):
    chars = string.printable[:95] + "\n"
    ids = [tok.encode(c, add_special_tokens=False) for c in chars]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(chars)
    specials = {tok.pad_token_id, tok.bos_token_id, *tok.eos_token_ids}
    assert not specials & {i[0] for i in ids}


def test_save_load_equal(tok, saved):
    again = Tokenizer.load(saved)
    assert again.eos_token_ids == tok.eos_token_ids
    assert again.pad_token_id == tok.pad_token_id
    assert again.bos_token_id == tok.bos_token_id
    assert again.vocab_size == tok.vocab_size
    assert again.tok.get_vocab() == tok.tok.get_vocab()
    for text in TEXTS:
        assert again.encode(text) == tok.encode(text)
        assert again.decode(again.encode(text)) == text


def test_generation_config_eos_first(tok, tmp_path):
    """eos ids from generation_config.json come first; the tokenizer_config one is added if missing."""
    tok.save(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 8]}))
    assert Tokenizer.load(tmp_path).eos_token_ids == [7, 8, tok.eos_token_ids[0]]
    assert Tokenizer.load(tmp_path, eos_from_config=[9]).eos_token_ids == [7, 8, tok.eos_token_ids[0]]


def test_eos_from_model_config(tok, tmp_path):
    tok.save(tmp_path)
    meta = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del meta["eos_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(meta))
    assert Tokenizer.load(tmp_path, eos_from_config=[5]).eos_token_ids == [5]
    with pytest.raises(ValueError, match="end-of-sequence"):
        Tokenizer.load(tmp_path)


def test_transformers_encodes_identically(tok, saved):
    theirs = AutoTokenizer.from_pretrained(saved)
    assert theirs.bos_token == "<bos>"
    assert theirs.eos_token == "<eos>"
    assert theirs.pad_token == "<pad>"
    for text in TEXTS:
        assert theirs(text)["input_ids"] == tok.encode(text)
        assert theirs.decode(tok.encode(text), skip_special_tokens=True) == text


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)
