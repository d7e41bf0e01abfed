"""Wires the engine + metrics + serving into the app and serves it. The engine runs in a process of its own (the
weights are loaded there, never here: this process needs only the tokenizer), or, with --engine-in-process, in a
thread of this one. Either way it has one owner, and a dead engine ends the server or is restarted (a flag)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time

from frontend.async_engine import AsyncEngine
from frontend.chat_output import ParserChoice
from frontend.engine.engine import LLMEngine
from frontend.engine_errors import EngineDeadError
from frontend.engine_proc.spec import LOAD_ERRORS, EngineSpec
from frontend.limits import ServingLimits
from frontend.metrics import Metrics
from frontend.serving import OpenAIServing, ServedModel

log = logging.getLogger("frontend")


def serve(args: argparse.Namespace, model_id: str, spec: EngineSpec, engine: LLMEngine | None = None) -> int:
    """Serves until stopped; returns the exit code. `engine` given: in-process (loaded by the caller)."""
    from sanic import Sanic

    from frontend.server import build_app

    handle, tokenizer = _start_engine(spec, engine)
    if handle is None:
        return 2
    info = handle.info
    metrics = Metrics(handle.stats, model_id)
    handle.on_step = metrics.after_step
    model = ServedModel(model_id, info.max_model_len, info.vocab_size, int(time.time()),
                        info.kv_tokens, info.pooling)
    parsers = ParserChoice.resolve(args.tool_call_parser, args.reasoning_parser,
                                   getattr(tokenizer, "chat_template", None))
    log.info("tool calls read as %s, reasoning by %s", parsers.tool_parser or "text",
             parsers.reasoning_parser or "none")
    serving = OpenAIServing(handle, metrics, tokenizer, model, args.defaults, args.max_waiting,
                            ServingLimits.from_args(args), parsers)
    app = build_app(serving, args.api_key)
    policy = _OnDeath(app, handle, args.on_engine_death, model)
    handle.on_death = policy
    handle.on_ready = policy.ready
    url = f"http://{args.h}:{args.p}/v1"

    @app.before_server_start
    async def attach(app: Sanic) -> None:
        handle.attach(asyncio.get_running_loop())

    @app.after_server_start
    async def ready(app: Sanic) -> None:
        print(f"serving {model_id} at {url} (context {info.max_model_len} tokens, "
              f"{info.num_blocks} KV blocks of {info.block_size})", flush=True)

    try:
        app.run(host=args.h, port=args.p, single_process=True, motd=False, access_log=args.log is not None)
    except OSError as e:
        print(f"error: cannot listen on {args.h}:{args.p}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        handle.shutdown()
    return policy.exit_code


def _start_engine(spec: EngineSpec, engine: LLMEngine | None):
    """(the engine's handle, the tokenizer), or (None, None) after saying why it cannot start."""
    if engine is not None:
        return AsyncEngine(engine), engine.tokenizer
    from frontend.engine_proc.client import EngineClient
    from frontend.engine_proc.process import EngineProcess, EngineStartError
    from ir.loader import load_tokenizer

    try:
        tokenizer = load_tokenizer(spec.model_path)
        process = EngineProcess.start(spec)
    except (EngineStartError, *LOAD_ERRORS) as e:
        print(f"error: {e}", file=sys.stderr)
        return None, None
    return EngineClient(spec, process), tokenizer


class _OnDeath:
    """--on-engine-death: exit (non-zero, once the failed requests have had their answers) or restart the engine
    process (/health says 503 until the new one is ready)."""

    def __init__(self, app, handle, mode: str, model: ServedModel):
        self.app, self.handle, self.mode, self.model = app, handle, mode, model
        self.exit_code = 0

    def __call__(self, err: EngineDeadError) -> None:
        loop = asyncio.get_running_loop()
        if self.mode == "restart":
            log.critical("restarting the engine (--on-engine-death restart)")
            loop.create_task(self._restart())
        else:
            log.critical("the server exits: its engine is gone (--on-engine-death exit)")
            loop.create_task(self._exit())

    def ready(self, info) -> None:
        self.model.kv_tokens = info.kv_tokens

    async def _restart(self) -> None:
        try:
            await self.handle.restart()
        except Exception as e:  # noqa: BLE001 - a load failure or anything else: never a server without an engine
            log.critical("the engine could not be restarted (%s); the server exits", e)
            await self._exit()

    async def _exit(self) -> None:
        self.exit_code = 1
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while self.handle.active and loop.time() < deadline:  # the failed requests' error bodies go out first
            await asyncio.sleep(0.05)
        self.app.stop()
