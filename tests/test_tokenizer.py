"""Tokenizers: char round trip and an unknown character refused; byte-level BPE training, round trip,
end-of-text handling (a literal "<|endoftext|>" in text stays text), save/load identity."""

from __future__ import annotations

import numpy as np
import pytest

from gptlib.data.tokenizer import (
    EOT,
    BPETokenizer,
    CharTokenizer,
    TokenizerError,
    check_identity,
    load_tokenizer,
)


@pytest.fixture(scope="module")
def bpe(small_text) -> BPETokenizer:
    docs = [d for d in small_text.read_text().split("\n\n") if d]
    return BPETokenizer.train(iter(docs), vocab_size=400)


def test_char_round_trip_and_save_load(tmp_path, small_text):
    text = small_text.read_text()
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text))
    ids = tok.encode_array(text)
    assert ids.shape == (len(text),) and tok.decode(ids) == text
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.identity() == tok.identity()
    assert np.array_equal(again.encode_array(text), ids)


def test_char_unknown_character_is_an_error(small_text):
    strict = CharTokenizer.from_text(small_text.read_text())
    with pytest.raises(
        TokenizerError, match=r"'é' \(U\+00E9\) at position 3 is not in the char vocabulary"
    ):
        strict.encode_array("abcé")


def test_bpe_trains_to_the_requested_vocab_with_eot(bpe):
    assert bpe.kind == "bpe"
    assert bpe.vocab_size == 400
    assert bpe.eot_id == 0 and bpe._tk.id_to_token(0) == EOT


def test_bpe_round_trips_any_text_byte_level(bpe):
    # Characters never seen in training (accents, CJK, emoji, control chars) still round-trip: bytes.
    text = "ROMEO: naïve café — 東京 🚀\ttabs\r\nand\x00nul  double  spaces\n"
    ids = bpe.encode(text)
    assert all(0 <= i < bpe.vocab_size for i in ids)
    assert bpe.decode(ids) == text
    assert bpe.encode("") == []


def test_literal_endoftext_in_text_stays_text(bpe):
    text = f"before{EOT}after"
    ids = bpe.encode(text)
    assert bpe.eot_id not in ids
    assert len(ids) > 3  # spelled out in pieces, not one special token
    assert bpe.decode(ids) == text
    assert all(bpe.eot_id not in x for x in bpe.encode_batch_ids([EOT, text, EOT * 3]))
    assert bpe.decode([bpe.eot_id]) == EOT  # the id itself does decode to the marker


def test_encode_batch_matches_encode(bpe, small_text):
    texts = [t for t in small_text.read_text()[:20000].split("\n\n") if t][:50]
    assert bpe.encode_batch_ids(texts) == [bpe.encode(t) for t in texts]


def test_bpe_save_load_keeps_identity_and_behaviour(bpe, tmp_path):
    path = bpe.save(tmp_path)
    again = load_tokenizer(path)
    assert isinstance(again, BPETokenizer)
    assert again.identity() == bpe.identity()
    check_identity(again, bpe.identity(), "test")
    text = f"O Romeo, {EOT} Romeo!"
    assert again.encode(text) == bpe.encode(text)
    assert again.eot_id not in again.encode(text)  # the literal-EOT behaviour survives a reload


def test_bpe_bad_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="vocab_size=100 is too small"):
        BPETokenizer.train(iter(["abc"]), vocab_size=100)
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": {"type": "BPE", "vocab": 5}}')
    with pytest.raises(TokenizerError, match="not a valid tokenizers file"):
        load_tokenizer(bad)
    bad.write_text("not json")
    with pytest.raises(TokenizerError, match="not valid JSON"):
        load_tokenizer(bad)


def test_bpe_text_that_is_not_valid_unicode_is_a_clear_error(bpe):
    """A lone surrogate (bytes that are not UTF-8, as Python decodes argv and some stdins) was the tokenizers
    library's 'TextInputSequence must be str' TypeError; now a TokenizerError naming the character and position."""
    with pytest.raises(TokenizerError) as e:
        bpe.encode("caf\udce9 au lait")
    assert "(U+DCE9) at position 3 is not valid Unicode" in str(e.value), e.value


def test_bad_char_tokenizer_file_names_the_file(tmp_path):
    f = tmp_path / "tokenizer.json"
    f.write_text('{"kind": "char"}')
    with pytest.raises(
        TokenizerError,
        match=r"tokenizer.json: char vocabulary must be distinct single characters, at least one \(got 0\)",
    ):
        load_tokenizer(f)
    f.write_text('{"kind": "char", "chars": "aba"}')
    with pytest.raises(TokenizerError, match=r"tokenizer.json: char vocabulary must be distinct"):
        load_tokenizer(f)
