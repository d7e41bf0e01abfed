"""The command line. Until the engine, a backend and the HTTP server land, it answers one chat
prompt with the IR's numpy reference interpreter, so that `make serve` exercises the whole model path
(GGUF loading, tokenizer, chat template, forward) on any machine."""

from __future__ import annotations

import argparse
import sys
import time

from ir.default_model import default_model_path
from ir.formats.errors import ModelFormatError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m frontend", description="LLM inference engine")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--f", metavar="FILE.gguf", help="a local GGUF file")
    src.add_argument("--w", metavar="DIR", help="a local safetensors model folder (HF layout)")
    ap.add_argument("--prompt", default="What is the capital of France?", help="the user message")
    ap.add_argument("--system", help="a system prompt (default: the chat template's own)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from ir.loader import load_model
    from ir.reference import ReferenceRunner

    try:
        model = load_model(args.f or args.w or default_model_path())
    except (ModelFormatError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = model.tokenizer
    if tok is None:
        print(f"error: {model.path} has no tokenizer", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages) if tok.chat_template else tok.encode(args.prompt)
    print(f"{model.arch.name} model {model.path.name}: {len(ids)} prompt tokens "
          "(numpy reference interpreter; the HTTP server is not built yet)", file=sys.stderr)
    start = time.perf_counter()
    runner = ReferenceRunner(model, max_tokens=len(ids) + args.max_tokens)
    out, _ = runner.greedy([ids], args.max_tokens, stop=sorted(tok.eos_ids))
    text = tok.decode([t for t in out[0] if t not in tok.eos_ids], skip_special_tokens=True)
    print(text)
    print(f"{len(out[0])} tokens in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    return 0
