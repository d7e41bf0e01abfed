"""Tokenizers for the engine: a `tokenizer.json` folder, or the vocabulary stored in a GGUF file.

Both end in a `tokenizers.Tokenizer` set up so that ids equal transformers' `encode` for the same
files (the reference the model is checked against), plus what generation needs: BOS/EOS ids, the
set of stop ids and the chat template.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from ir.chat_template import render_chat

__all__ = ["Tokenizer"]

log = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types in tokenizer.ggml.token_type

# Split regexes from llama.cpp's llama-vocab.cpp (the same ones transformers' GGUF loader uses).
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "dbrx",
                     "smaug-bpe", "lfm2", "midm-2.0"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez", "kormo"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2"), _GPT4O),
    "tekken": _TEKKEN,
}
# llama.cpp: one digit per pre-token, then the GPT-2 regex (StarCoder's tokenizer.json does the same).
_DIGIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"})
# Gemma vocabularies whose GGUF form the generic SentencePiece path reads as SentencePiece itself does: no prefix
# space (the file says so), merges in score order, and the whitespace runs llama.cpp's converter respells with real
# spaces (user-defined tokens) matched whole, longest first, as llama.cpp does. Later gemmas are unverified.
_SPM_GEMMAS = frozenset({"gemma", "gemma2", "gemma3"})
# Turn-ending tokens llama.cpp adds to its end-of-generation set when the vocabulary has them.
_EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                        "<|eom_id|>", "<EOT>", "_<EOT>", "<|end▁of▁sentence|>", "<｜end▁of▁sentence｜>"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(extra)}}


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre in _PRE_SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre in _DIGIT_PRES:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre not in (None, "default", "gpt2"):
        log.warning("GGUF pre-tokenizer %r not known; using the GPT-2 split as transformers does", pre)
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces,
    best-scored first; same order (ties included) as transformers' `generate_merges`."""
    merges: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _gguf_backend(meta: dict[str, Any]) -> tuple[_Backend, bool]:
    """The bare model/pre-tokenizer/decoder for a GGUF vocabulary, and whether BOS is on by default."""
    kind, tokens = meta.get("tokenizer.ggml.model"), list(meta["tokenizer.ggml.tokens"])
    arch = meta.get("general.architecture", "")
    file_merges = meta.get("tokenizer.ggml.merges")
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Some converters store raw text for a few tokens; the BPE model needs the byte spelling.
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in file_merges or []]
        backend = _Backend(models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                                      end_of_word_suffix="", fuse_unk=False))
        backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("tokenizer.ggml.pre"))
        backend.decoder = decoders.ByteLevel()
        return backend, False
    if kind != "llama":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (supported: 'gpt2', 'llama')")
    if arch.startswith("gemma") and arch not in _SPM_GEMMAS:
        raise ValueError(f"GGUF SentencePiece vocabulary of architecture {arch!r} is not supported (verified: "
                         f"{', '.join(sorted(_SPM_GEMMAS))}); load the model's tokenizer.json folder instead")
    scores = meta.get("tokenizer.ggml.scores")
    if file_merges is None and scores is None:
        raise ValueError("GGUF SentencePiece vocabulary has neither merges nor scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = ([tuple(m.split(" ", 1)) for m in file_merges] if file_merges is not None
              else _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True))))
    backend = _Backend(models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, dropout=None))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch == "phi3":
        # Phi-3 prepends the space with a normalizer, which also applies after special tokens.
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        backend.pre_tokenizer = pre_tokenizers.Metaspace("▁", "first" if prefix else "never", split=False)
        steps += [decoders.Strip(" ", 1, 0)] if prefix else []
    backend.decoder = decoders.Sequence(steps)
    return backend, True


def _template_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.PostProcessor:
    """What transformers' `update_post_processor` builds for add_bos_token / add_eos_token."""
    def seq(name: str, type_id: int) -> str:
        return " ".join([*([f"{bos[0]}:{type_id}"] if bos else []), f"${name}:{type_id}",
                         *([f"{eos[0]}:{type_id}"] if eos else [])])

    return processors.TemplateProcessing(single=seq("A", 0), pair=f"{seq('A', 0)} {seq('B', 1)}",
                                         special_tokens=[t for t in (bos, eos) if t is not None])


def _content(token: Any) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _as_ids(value: Any) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else [int(v) for v in value]


def _clean_up_spaces(text: str) -> str:
    # transformers' clean_up_tokenization, which it applies only to non-BPE models.
    for old, new in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                     (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(old, new)
    return text


class Tokenizer:
    """Text <-> ids, special ids and chat template of one model."""

    def __init__(self, backend: _Backend, *, bos_id: int | None = None, eos_id: int | None = None,
                 extra_eos_ids: Iterable[int] = (), chat_template: str | None = None,
                 special_tokens: dict[str, str | None] | None = None, clean_up_spaces: bool = False) -> None:
        self.backend = backend
        # Token strings handed to chat templates (bos_token, eos_token, unk_token, pad_token).
        self.special_tokens: dict[str, str | None] = dict(special_tokens or {})
        self.bos_id, self.eos_id = bos_id, eos_id
        self.eos_ids: set[int] = {*([eos_id] if eos_id is not None else []), *extra_eos_ids}
        self.chat_template = chat_template
        self._clean_up_spaces = clean_up_spaces
        # Ask the post-processor rather than trusting a flag: it is what encode() actually does.
        # An empty text shows exactly what the post-processor adds, with no vocabulary lookups.
        self.add_bos: bool = bos_id is not None and backend.encode("").ids[:1] == [bos_id]

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build from GGUF metadata ({key: field.contents()}) as transformers' GGUF loader does,
        except that digit-splitting pre-tokenizers (`smollm`, `starcoder`, ...) split digits as
        llama.cpp and the models' own tokenizer.json do; transformers skips that step."""
        backend, default_bos = _gguf_backend(meta)
        tokens = list(meta["tokenizer.ggml.tokens"])
        types = list(meta.get("tokenizer.ggml.token_type") or [])
        byte_alphabet = set(_bytes_to_unicode().values())

        def spelled(tok: str) -> bool:
            # A "control" token outside a byte-level alphabet is a converter mislabel; adding it
            # would grow the vocabulary past what the model was trained with (transformers skips it).
            return meta.get("tokenizer.ggml.model") != "gpt2" or set(tok) <= byte_alphabet

        typed = list(zip(tokens, types, strict=False))
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                    for t, ty in typed if ty == _CONTROL and spelled(t)])
        vocab = backend.get_vocab()
        backend.add_tokens([AddedToken(t, normalized=False, special=False)
                            for t, ty in typed if ty == _USER_DEFINED and t in vocab])

        def special(key: str) -> tuple[str, int] | None:
            idx = meta.get(f"tokenizer.ggml.{key}")
            return (tokens[int(idx)], int(idx)) if idx is not None and 0 <= int(idx) < len(tokens) else None

        named = [s for s in map(special, ("bos_token_id", "eos_token_id", "unknown_token_id",
                                          "padding_token_id")) if s is not None]
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        # transformers registers the named special tokens (e.g. SentencePiece's <unk>) as special too.
        backend.add_special_tokens([AddedToken(t, special=True) for t, _ in named if t not in added])
        bos, eos = special("bos_token_id"), special("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        backend.post_processor = _template_processor(bos if add_bos else None, eos if add_eos else None)
        strings = {name: (s[0] if (s := special(key)) else None) for name, key in (
            ("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
        return cls(backend, bos_id=bos[1] if bos else None, eos_id=eos[1] if eos else None,
                   extra_eos_ids=gguf_stop_ids(meta), chat_template=meta.get("tokenizer.chat_template"),
                   special_tokens=strings)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Build from a Hugging Face folder: tokenizer.json, tokenizer_config.json, generation_config.json."""
        path = Path(path)
        backend = _Backend.from_file(str(path / "tokenizer.json"))
        cfg = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        for entry in (cfg.get("added_tokens_decoder") or {}).values():
            if entry.get("content") not in present:
                props = {k: entry[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special")
                         if k in entry}
                backend.add_tokens([AddedToken(entry["content"], **props)])
        names = ("bos_token", "eos_token", "unk_token", "pad_token")
        specials = {k: _content(cfg.get(k)) for k in names}
        present = {t.content for t in backend.get_added_tokens_decoder().values()}
        backend.add_special_tokens([AddedToken(v, special=True) for v in specials.values()
                                    if v and v not in present])
        ids = {k: (backend.token_to_id(v) if v else None) for k, v in specials.items()}
        gen_eos = _as_ids(gen.get("eos_token_id"))
        bos_id = ids["bos_token"] if ids["bos_token"] is not None else gen.get("bos_token_id")
        eos_id = ids["eos_token"] if ids["eos_token"] is not None else (gen_eos or [None])[0]
        # transformers 5 ignores add_bos_token/add_eos_token when there is a tokenizer.json: its
        # post-processor alone decides, so the same holds here.
        if cfg.get("add_bos_token") and bos_id is not None and backend.post_processor is None:
            log.warning("%s: add_bos_token is set but tokenizer.json adds no BOS; following tokenizer.json",
                        path)
        backend.encode_special_tokens = bool(cfg.get("split_special_tokens", False))
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        elif (path / "chat_template.json").is_file():
            template = _read_json(path / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            by_name = {t["name"]: t["template"] for t in template}
            template = by_name.get("default", next(iter(by_name.values()), None))
        is_bpe = isinstance(backend.model, models.BPE)
        return cls(backend, bos_id=bos_id, eos_id=eos_id, extra_eos_ids=gen_eos, chat_template=template,
                   special_tokens=specials,
                   clean_up_spaces=bool(cfg.get("clean_up_tokenization_spaces")) and not is_bpe)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self._clean_up_spaces else text

    def id_to_token(self, idx: int) -> str | None:
        return self.backend.id_to_token(idx)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        context = {k: v for k, v in self.special_tokens.items() if v is not None} | kw
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                           **context)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            add_special_tokens: bool = False, **kw: Any) -> list[int]:
        """Render and encode a conversation.

        Like transformers, the rendered text is encoded without adding special tokens: templates
        write BOS themselves where the model wants one. `add_special_tokens=True` adds them, but
        never a second BOS in front of one the template already wrote.
        """
        text = self.render_chat(messages, add_generation_prompt, **kw)
        ids = self.encode(text, add_special_tokens=add_special_tokens)
        if add_special_tokens and self.add_bos and ids[1:2] == [self.bos_id]:
            ids = ids[1:]
        return ids


def gguf_stop_ids(meta: dict[str, Any]) -> set[int]:
    """End-of-generation ids beyond EOS, the way llama.cpp collects them."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    types = meta.get("tokenizer.ggml.token_type") or []
    ids = {meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
           if isinstance(meta.get(k), int)}
    ids |= {i for i, (t, ty) in enumerate(zip(tokens, types, strict=False))
            if ty in (_CONTROL, _USER_DEFINED) and t in _EOG_TEXTS}
    return ids
