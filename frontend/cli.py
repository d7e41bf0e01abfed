"""The command line. Until the HTTP server lands, it answers one chat prompt through the engine
(streaming the text as it is generated), so that `make serve` exercises the whole path: GGUF
loading, tokenizer, chat template, scheduler, backend, sampler and detokenizer."""

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
    ap.add_argument("--backend", choices=["auto", "mlx", "cuda"], default="auto")
    ap.add_argument("--prompt", default="What is the capital of France?", help="the user message")
    ap.add_argument("--system", help="a system prompt (default: the chat template's own)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from backends.base import create_backend
    from frontend.engine.engine import LLMEngine
    from frontend.engine.sampling_params import SamplingParams
    from ir.loader import load_model

    try:
        model = load_model(args.f or args.w or default_model_path())
        params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
        backend = create_backend(args.backend, model)
    except (ModelFormatError, FileNotFoundError, ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = model.tokenizer
    if tok is None:
        print(f"error: {model.path} has no tokenizer", file=sys.stderr)
        return 2
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}]
    ids = tok.apply_chat_template(messages) if tok.chat_template else tok.encode(args.prompt)
    engine = LLMEngine(backend)
    print(f"{model.arch.name} model {model.path.name} on {backend.name} ({backend.describe()}): "
          f"{len(ids)} prompt tokens (the HTTP server is not built yet)", file=sys.stderr)
    start = time.perf_counter()
    engine.add_request(ids, params)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            print(out.outputs[0].delta_text, end="", flush=True)
            final = out
    print()
    n = len(final.outputs[0].token_ids)
    print(f"{n} tokens in {time.perf_counter() - start:.1f} s ({final.outputs[0].finish_reason})", file=sys.stderr)
    return 0
