"""An opt-in record of the engine process's steps (LLM_ENGINE_STEP_LOG=FILE): one JSON line a step, so that a serving
run can tell which step carried what, e.g. how many prompt tokens the step after a stream's first token computed.

    LLM_ENGINE_STEP_LOG=/tmp/steps.jsonl python -m frontend ...   (then a load, e.g. tools/bench_serving)
    python -m frontend.engine_proc.step_log /tmp/steps.jsonl
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from frontend.engine.engine import LLMEngine, RequestOutput

ENV = "LLM_ENGINE_STEP_LOG"


class StepLog:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)  # noqa: SIM115 - open for the engine process's life
        self.prompt_tokens = self.generated = 0

    @classmethod
    def from_env(cls) -> StepLog | None:
        path = os.environ.get(ENV)
        return cls(path) if path else None

    def write(self, start: float, end: float, engine: LLMEngine, outputs: list[RequestOutput], added: int) -> None:
        """One step: its wall time, the prompt tokens it launched, the tokens it read back, and the requests whose
        first token (or last) it reported. Overlapped steps read a step's tokens back during the next one: there the
        step between a first token and the second is the one launched in the step that reported the first."""
        stats = engine.stats
        first = [o.request_id for o in outputs
                 if o.outputs and 0 < o.outputs[0].num_tokens == len(o.outputs[0].delta_token_ids)]
        line = {"t0": start, "t1": end, "step": stats["steps"], "overlap": engine.overlap, "added": added,
                "prompt_tokens": stats["prompt_tokens"] - self.prompt_tokens,
                "generated": stats["generation_tokens"] - self.generated,
                "running": engine.num_running(), "waiting": engine.num_waiting(), "first": first,
                "finished": [o.request_id for o in outputs if o.finished]}
        self.prompt_tokens, self.generated = stats["prompt_tokens"], stats["generation_tokens"]
        self.file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self.file.close()


def summarize(path: str) -> dict:
    """What the step between each stream's first and second token held (its prompt tokens, and the wall time of the
    call that read it back), against the steps that carried no prompt tokens."""
    with open(path) as f:
        steps = [json.loads(line) for line in f]
    ms = [1e3 * (s["t1"] - s["t0"]) for s in steps]
    # (the step that computed the gap, the call that read its tokens back), one pair a new stream
    gaps = [(i if s["overlap"] else i + 1, i + 1) for i, s in enumerate(steps[:-1]) for _ in s["first"]]
    decode_only = [i for i, s in enumerate(steps) if not s["prompt_tokens"] and s["generated"]]

    def med(values: list[float]) -> float:
        return float(np.median(values)) if values else 0.0

    return {"steps": len(steps), "steps_with_prompt_tokens": sum(1 for s in steps if s["prompt_tokens"]),
            "decode_only_step_ms_p50": med([ms[i] for i in decode_only]),
            "new_streams": len(gaps),
            "first_gap_step_ms_p50": med([ms[j] for _, j in gaps]),
            "first_gap_prompt_tokens_p50": med([steps[i]["prompt_tokens"] for i, _ in gaps]),
            "first_gaps_with_prompt_tokens": sum(1 for i, _ in gaps if steps[i]["prompt_tokens"])}


if __name__ == "__main__":
    for key, value in summarize(sys.argv[1]).items():
        print(f"{key:<32}{value:>10.1f}" if isinstance(value, float) else f"{key:<32}{value:>10}")
