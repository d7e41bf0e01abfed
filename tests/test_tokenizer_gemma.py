"""Gemma's SentencePiece vocabulary from GGUF metadata against SentencePiece itself.

No Gemma tokenizer.model is available offline, so a small one is trained here with Gemma's settings (BPE, byte
fallback, no dummy prefix, whitespace kept, identity normalization, user-defined whitespace runs and turn markers,
gemma's special ids) and written as llama.cpp's convert_hf_to_gguf.py writes one (_create_vocab_sentencepiece:
SentencePiece's pieces, scores and types, then tokenizer_config's added tokens: special ones CONTROL, the others
USER_DEFINED with "▁" respelled as " ", both with score -1000; add_space_prefix false). The oracle is
SentencePiece encoding the same text; transformers' GGUF reader agrees too, except on whitespace runs longer than
the longest whitespace token, which it rebuilds from merges in file order (llama.cpp, like SentencePiece, matches
the user-defined runs whole, longest first).
"""

from __future__ import annotations

import io

import pytest
from test_tokenizer import TEXTS, _close, _tokenizer_gguf_writer

from ir.tokenizer import Tokenizer

spm = pytest.importorskip("sentencepiece")
gguf = pytest.importorskip("gguf")

USER_DEFINED = ["<start_of_turn>", "<end_of_turn>", "▁▁", "▁▁▁", "▁▁▁▁", "\n\n"]
SPECIAL_IDS = {0, 1, 2, 3, 4, 5}  # <pad> <eos> <bos> <unk> and the turn markers: tokenizer_config says special
EXTRA = ["a  b   c    d", "x\n\ny\n\n\nz", "<start_of_turn>user\nhi<end_of_turn>\n", "  two", "tab\t\tx", "▁literal"]
LONG_RUN = "a     e"  # five spaces: longer than the longest whitespace token


@pytest.fixture(scope="module")
def sp_model():
    corpus = [t for t in TEXTS if t.strip()] * 3 + [
        "The quick brown fox jumps over the lazy dog.", "Hello world, hello there.",
        "def f(x):\n    return x  # comment\n", "  indented  twice  "] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus), model_writer=buf, model_type="bpe", vocab_size=600, byte_fallback=True,
        add_dummy_prefix=False, remove_extra_whitespaces=False, normalization_rule_name="identity", split_digits=True,
        allow_whitespace_only_pieces=True, character_coverage=1.0, pad_id=0, eos_id=1, bos_id=2, unk_id=3,
        bos_piece="<bos>", eos_piece="<eos>", user_defined_symbols=USER_DEFINED, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=buf.getvalue())


def converted_vocab(sp) -> tuple[list[str], list[float], list[int]]:
    """llama.cpp's _create_vocab_sentencepiece, with gemma's added_tokens_decoder (ids 0-9)."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(sp.get_score(i))
        types.append(2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1)
    for i in range(4 + len(USER_DEFINED)):
        special = i in SPECIAL_IDS
        types[i], scores[i] = (3 if special else 4), -1000.0
        tokens[i] = tokens[i] if special else tokens[i].replace("▁", " ")
    return tokens, scores, types


def write_vocab_gguf(path, sp, arch: str) -> dict:
    tokens, scores, types = converted_vocab(sp)
    writer = _tokenizer_gguf_writer(path, arch)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    for add, value in ((writer.add_bos_token_id, 2), (writer.add_eos_token_id, 1), (writer.add_unk_token_id, 3),
                       (writer.add_pad_token_id, 0), (writer.add_add_bos_token, True),
                       (writer.add_add_eos_token, False), (writer.add_add_space_prefix, False)):
        add(value)
    _close(writer)
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()}


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_gguf_vocabulary_matches_sentencepiece(sp_model, tmp_path, arch):
    ours = Tokenizer.from_gguf_metadata(write_vocab_gguf(tmp_path / "v.gguf", sp_model, arch))
    assert (ours.bos_id, ours.eos_id, ours.add_bos) == (2, 1, True)
    assert ours.token_to_id("<end_of_turn>") in ours.eos_ids
    # A text naming a control token (<bos>, <unk>) is parsed as that token here, as llama.cpp and transformers do.
    texts = [t for t in [*TEXTS, *EXTRA, LONG_RUN] if "<unk>" not in t]
    for text in texts:
        ref = sp_model.encode(text)
        assert ours.encode(text, add_special_tokens=False) == ref, text
        assert ours.encode(text) == [2, *ref], text
        assert ours.decode(ref) == sp_model.decode(ref), text


def test_gemma_gguf_vocabulary_matches_transformers(sp_model, tmp_path):
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_gguf_metadata(write_vocab_gguf(tmp_path / "v.gguf", sp_model, "gemma2"))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="v.gguf")
    for text in [*TEXTS, *EXTRA]:
        ids = ours.encode(text)
        assert ids == hf.encode(text), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
    assert ours.encode(LONG_RUN) != hf.encode(LONG_RUN)  # the one known difference (see the module docstring)


def test_later_gemma_vocabularies_are_refused(sp_model, tmp_path):
    with pytest.raises(ValueError, match="gemma4.*not supported"):
        Tokenizer.from_gguf_metadata(write_vocab_gguf(tmp_path / "v.gguf", sp_model, "gemma4"))
