"""frontend.engine.detokenizer with the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import random

import pytest

from core.sampling_params import SamplingParams
from frontend.engine.detokenizer import IncrementalDetokenizer

MULTIBYTE = ["emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧\u200d👦", "日本語のテキストです。", "中文测试：你好，世界！",
             "flags 🇫🇷🇯🇵", "café naïve Ångström", "Привет, мир!", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


@pytest.fixture(scope="module")
def tok(smollm):
    return smollm.tokenizer


@pytest.fixture(scope="module")
def partial_ids(tok) -> list[int]:
    """Ids whose own text is not whole UTF-8: lone bytes and pieces of multi-byte characters."""
    ids = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    assert len(ids) > 100
    return ids


def run(tok, ids, prompt=(), **kw) -> tuple[IncrementalDetokenizer, list[str]]:
    d = IncrementalDetokenizer(tok, list(prompt), SamplingParams(**kw))
    deltas = [d.add(i) for i in ids]
    deltas.append(d.flush())
    return d, deltas


def ids_of(tok, *pieces: str) -> list[int]:
    """Token ids for each piece encoded on its own: a split the tokenizer would not choose for the whole."""
    return [i for piece in pieces for i in tok.encode(piece)]


@pytest.mark.parametrize("skip", [True, False])
def test_deltas_concatenate_to_full_decode(tok, partial_ids, skip):
    rnd = random.Random(skip)
    specials = [i for i in range(tok.vocab_size) if tok.decode([i], skip_special_tokens=True) == ""]
    assert tok.eos_id in specials
    for _ in range(600):
        pool = rnd.choice([partial_ids, range(tok.vocab_size)])
        ids = [rnd.choice(specials) if rnd.random() < 0.05 else rnd.choice(pool) for _ in range(rnd.randint(1, 25))]
        prompt = [rnd.choice(partial_ids) for _ in range(rnd.randint(0, 8))]
        d, deltas = run(tok, ids, prompt, skip_special_tokens=skip)
        assert "".join(deltas) == d.text == tok.decode(ids, skip_special_tokens=skip)
        assert not d.stopped


def test_multibyte_characters_come_out_whole(tok):
    for text in MULTIBYTE:
        ids = tok.encode(text)
        assert any("\ufffd" in tok.decode([i]) for i in ids)  # really split across byte tokens
        d, deltas = run(tok, ids)
        assert "".join(deltas) == text
        assert not any("\ufffd" in delta for delta in deltas)
    _, deltas = run(tok, tok.encode("日本語"))
    assert [x for x in deltas if x] == ["日", "本", "語"]


def test_prompt_gives_context_but_no_text(tok):
    prompt = tok.encode("The capital of France is")
    d, deltas = run(tok, tok.encode(" Paris."), prompt)
    assert d.text == " Paris." and deltas[0] == " Paris"
    # A prompt that ends inside a character: the output's continuation bytes decode as on their own.
    ja = tok.encode("日本")
    d, _ = run(tok, ja[1:], ja[:1])
    assert d.text == tok.decode(ja[1:]) and d.text.endswith("本")


def test_decodes_a_small_window_per_token(tok):
    seen = []

    class Counting:  # the real tokenizer, recording how many ids each decode is given
        def decode(self, ids, skip_special_tokens=False):
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode("A long answer, with some 日本語 in it. " * 40)
    d = IncrementalDetokenizer(Counting(), tok.encode("Question?") * 10, SamplingParams(stop=["never"]))
    for i in ids:
        d.add(i)
    assert d.text == tok.decode(ids)
    assert max(seen) <= 6 and len(seen) <= 2 * len(ids) + 1


def test_stop_string_split_across_tokens(tok):
    assert tok.encode(" Paris") == ids_of(tok, " Paris") and len(ids_of(tok, " Par", "is")) == 2
    ids = ids_of(tok, " The capital of France is", " Par", "is", ". It is big.")
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["Paris"]))
    deltas = [d.add(i) for i in ids]
    assert deltas[4:7] == [" is", " ", ""]  # "Par" waits; "is" completes the stop string
    assert d.stopped and d.stop_string == "Paris"
    assert d.text == "".join(deltas) == " The capital of France is "
    assert d.flush() == "" and d.add(ids[0]) == ""


def test_stop_string_over_natural_tokens(tok):
    ids = tok.encode(" The palace of Versailles is large.")
    d, deltas = run(tok, ids, stop=["sailles is lar"])
    assert d.stopped and d.text == " The palace of Ver"
    d, _ = run(tok, ids, stop=["of Versailles"], include_stop_str_in_output=True)
    assert d.stopped and d.text == " The palace of Versailles"


def test_held_text_is_released(tok):
    d = IncrementalDetokenizer(tok, [], SamplingParams(stop=["Paris"]))
    assert [d.add(i) for i in ids_of(tok, " Par", "ade")] == [" ", "Parade"]  # not a stop after all
    assert [d.add(i) for i in ids_of(tok, " Par")] == [" "]
    assert d.flush() == "Par" and d.text == " Parade Par" and not d.stopped


def test_stop_string_at_the_very_start(tok):
    d, deltas = run(tok, tok.encode("Hello world"), stop=["Hello"])
    assert d.stopped and d.text == "" and deltas == ["", "", ""]
    d, deltas = run(tok, tok.encode("Hello world"), stop=["Hello"], include_stop_str_in_output=True)
    assert d.stopped and deltas[0] == "Hello" and d.text == "Hello"


def test_overlapping_stop_strings_first_completed_wins(tok):
    ids = tok.encode(" The capital of France")
    for stops in (["capital of", "of France"], ["of France", "capital of"]):
        d, _ = run(tok, ids, stop=stops)
        assert d.text == " The " and d.stop_string == "capital of"
    # Both complete inside one token (" capital"): the one whose end comes first wins, whatever the order.
    for stops in (["capital", "apit"], ["apit", "capital"]):
        d, _ = run(tok, ids, stop=stops)
        assert (d.text, d.stop_string) == (" The c", "apit")
        d, _ = run(tok, ids, stop=stops, include_stop_str_in_output=True)
        assert (d.text, d.stop_string) == (" The capit", "apit")
    # Same end: the longer (earlier-starting) one, which cuts more.
    d, _ = run(tok, ids, stop=["ital", " capital"])
    assert (d.text, d.stop_string) == (" The", " capital")
    # One stop string's start is another's end: "of F" completes while "France is" is still a prefix.
    d, _ = run(tok, tok.encode(" of France is"), stop=["France is", "of F"])
    assert (d.text, d.stop_string) == (" ", "of F")


def test_include_stop_str_in_output(tok):
    ids = ids_of(tok, " The capital of France is", " Par", "is", ". It is big.")
    d, deltas = run(tok, ids, stop=["Paris"], include_stop_str_in_output=True)
    assert d.stopped and d.text == "".join(deltas) == " The capital of France is Paris"


def test_stop_strings_inside_split_characters(tok):
    d, _ = run(tok, tok.encode("日本語のテキスト"), stop=["本"])
    assert d.stopped and d.text == "日"
    d, _ = run(tok, tok.encode("emoji 😀🎉 party"), stop=["🎉 p"])
    assert d.stopped and d.text == "emoji 😀"
    d, _ = run(tok, tok.encode("emoji 😀🎉 party"), stop=["😀🎉"], include_stop_str_in_output=True)
    assert d.text == "emoji 😀🎉"


def test_skip_special_tokens(tok):
    ids = [*tok.encode("Hi"), tok.eos_id, *tok.encode(" there"), 0]
    d, deltas = run(tok, ids)
    assert d.text == "Hi there" and deltas[1] == ""
    d, _ = run(tok, ids, skip_special_tokens=False)
    assert d.text == "Hi<|im_end|> there<|endoftext|>"
    d, _ = run(tok, ids, skip_special_tokens=False, stop=["<|im_end|>"])
    assert d.stopped and d.text == "Hi"
    d, _ = run(tok, ids, stop=["<|im_end|>"])
    assert not d.stopped and d.text == "Hi there"


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode(" a b a b a")
    d, _ = run(tok, ids, stop=[" a"], min_tokens=2)
    assert d.stopped and d.text == " a b"
    d, _ = run(tok, ids, stop=[" a"], min_tokens=0)
    assert d.stopped and d.text == ""
    # " b" completes inside the min_tokens while " a b c d" could still follow: it never counts later.
    d, _ = run(tok, tok.encode(" a b c e"), stop=[" b", " a b c d"], min_tokens=2)
    assert not d.stopped and d.text == " a b c e"
