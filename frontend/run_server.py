"""Wires a loaded engine into the Sanic app and serves it in this process (the engine needs one owner)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from frontend.async_engine import AsyncEngine
from frontend.engine.engine import LLMEngine
from frontend.limits import ServingLimits
from frontend.metrics import Metrics
from frontend.serving import OpenAIServing, ServedModel

log = logging.getLogger("frontend")


def serve(engine: LLMEngine, model_id: str, args: argparse.Namespace) -> int:
    from sanic import Sanic

    from frontend.server import build_app

    metrics = Metrics(engine, model_id)
    async_engine = AsyncEngine(engine)
    async_engine.on_step = metrics.after_step
    model = ServedModel(model_id, engine.max_model_len, engine.backend.model.config.vocab_size, int(time.time()),
                        engine.blocks.num_blocks * engine.blocks.block_size)
    serving = OpenAIServing(async_engine, metrics, engine.tokenizer, model, args.defaults, args.max_waiting,
                            ServingLimits.from_args(args))
    app = build_app(serving, args.api_key)
    url = f"http://{args.h}:{args.p}/v1"

    @app.after_server_start
    async def ready(app: Sanic) -> None:
        print(f"serving {model_id} at {url} (context {engine.max_model_len} tokens, "
              f"{engine.blocks.num_blocks} KV blocks of {engine.blocks.block_size})", flush=True)

    try:
        app.run(host=args.h, port=args.p, single_process=True, motd=False, access_log=args.log is not None)
    except OSError as e:
        print(f"error: cannot listen on {args.h}:{args.p}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        async_engine.shutdown()
    return 0
