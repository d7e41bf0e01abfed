"""The offline API, like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tqdm.auto import tqdm

from backends.base import create_backend
from core.sampling_params import SamplingParams
from frontend.engine.engine import EngineConfig, LLMEngine, RequestOutput
from frontend.engine.scheduler import SchedulerConfig
from ir.default_model import default_model_path
from ir.loader import load_model

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path | None = None, *, backend: str = "auto", dtype: str | None = None,
                 quantized: bool | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_mb: int | None = None, max_model_len: int | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int | None = None, prefill_chunk_size: int = 512,
                 decode_step_tokens: int | None = None, prefix_caching: bool = True, progress: bool = True,
                 isq: str | None = None,
                 kv_cache_dtype: str | None = None, task: str = "auto"):
        """`isq`: quantize the model's matrices at load to a GGUF type ("q4k", ...), "int4" or "fp8" (see
        ir.isq); `kv_cache_dtype` "int8": the 8-bit KV cache (--kv-cache-dtype); `task` "embed" (or
        "auto" for a model whose files say so): an embedding model, run by `embed` (ir.pooling)."""
        loaded = load_model(model or default_model_path(), progress=progress, isq=isq, task=task)
        options = {"dtype": dtype, "quantized": quantized, "progress": progress, "kv_cache_dtype": kv_cache_dtype}
        self.backend = create_backend(backend, loaded, **{k: v for k, v in options.items() if v is not None})
        config = EngineConfig(
            block_size=block_size, num_kv_blocks=num_kv_blocks,
            kv_cache_bytes=kv_cache_mb * 2**20 if kv_cache_mb else None, max_model_len=max_model_len,
            prefix_caching=prefix_caching,
            scheduler=SchedulerConfig(max_num_seqs, max_num_batched_tokens, prefill_chunk_size, decode_step_tokens))
        self._attach(LLMEngine(self.backend, config), progress)

    @classmethod
    def from_backend(cls, backend, config: EngineConfig | None = None, progress: bool = False) -> LLM:
        """An LLM over an already loaded backend (tests and benchmarks share one)."""
        llm = cls.__new__(cls)
        llm.backend = backend
        llm._attach(LLMEngine(backend, config), progress)
        return llm

    def _attach(self, engine: LLMEngine, progress: bool) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.progress = progress

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None
                 = None, use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion, all batched together; outputs in the prompts' order."""
        if self.engine.pooler is not None:
            raise ValueError("this is an embedding model (no LM head): use LLM.embed, not generate")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling parameter sets")
        return self._run_all(prompts, plist, use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Each prompt's pooled vector (`.embedding`, float32), as vLLM's LLM.embed; an embedding model only."""
        if self.engine.pooler is None:
            raise ValueError("this model generates text: LLM.embed needs an embedding model (task='embed')")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        return self._run_all(prompts, [SamplingParams()] * len(prompts), use_tqdm)

    def chat(self, conversations: list[dict] | list[list[dict]], params: SamplingParams | None = None,
             use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Applies the model's chat template to each conversation, then generates."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c) for c in conversations]
        return self.generate(prompts, params, use_tqdm)

    def _run_all(self, prompts: Sequence[Prompt], plist: list[SamplingParams],
                 use_tqdm: bool | None) -> list[RequestOutput]:
        ids: list[str] = []
        try:  # a refused prompt, an interrupt or a failing step must not leave the earlier requests running
            for p, sp in zip(prompts, plist, strict=True):
                ids.append(self.engine.add_request(self._encode(p), sp))
            return self._run(ids, use_tqdm)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        show = self.progress if use_tqdm is None else use_tqdm
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not show, leave=False) as bar:
            while len(done) < len(ids):
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        bar.update(1)
        return [done[i] for i in ids]
