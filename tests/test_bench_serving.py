"""tools/bench_serving against a real `python -m frontend` process (the default SmolLM2 on a loopback port): a few
short requests per level, and the figures it writes checked for sense, not for speed."""

from __future__ import annotations

import json

import pytest

from tests.serving import ServerProcess
from tools import bench_serving

IN, OUT, N = 16, 6, 3


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "8") as s:
        yield s


def check_level(level: dict, n: int, out_len: int | None, in_len: int | None = None) -> None:
    m = level["metrics"]
    assert m["completed"] == n and m["failed"] == 0, m["errors"]
    assert m["usage_reported"]  # our server sends usage in the last chunk (stream_options.include_usage)
    assert m["request_throughput"] > 0 and m["output_throughput"] > 0
    assert m["total_token_throughput"] > m["output_throughput"]
    assert 0 < m["ttft_ms"]["median"] <= m["e2el_ms"]["median"]
    assert m["ttft_ms"]["p99"] <= m["e2el_ms"]["p99"] * (1 + 1e-9)
    assert len(m["requests"]) == n
    for r in m["requests"]:
        assert r["ok"] and 0 < r["ttft_ms"] <= r["e2el_ms"]
        if out_len is not None:
            assert r["output_tokens"] == out_len  # ignore_eos: exactly max_tokens
        if in_len is not None:
            assert r["prompt_tokens"] == in_len
        # one gap between consecutive text chunks; a chunk carries at least one token
        assert 1 <= r["itl_count"] <= r["output_tokens"] - 1
    assert m["total_output_tokens"] == sum(r["output_tokens"] for r in m["requests"])
    assert m["itl_ms"]["mean"] > 0 and m["tpot_ms"]["mean"] > 0
    # the first gaps and the rest make up the gaps; a token without a chunk is one gap fewer than tokens - 1
    assert m["itl_first_ms"]["median"] > 0 and m["itl_rest_ms"]["median"] > 0
    assert m["tokens_without_chunk"] == sum(r["output_tokens"] - 1 - r["itl_count"] for r in m["requests"])


def test_concurrency_sweep_with_offline_ratio(server, tmp_path):
    out = tmp_path / "sweep.json"
    """Two levels with prompt counts of their own; the second level's load shared by two client processes."""
    counts = (N, N + 2)
    result = bench_serving.main(["--base-url", server.base, "--concurrency", "1,4", "--num-prompts",
                                 ",".join(map(str, counts)), "--client-procs", "2", "--input-len", str(IN),
                                 "--output-len", str(OUT), "--result-file", str(out), "--offline", "--disable-tqdm"])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["model"] == "SmolLM2-135M-Instruct" and result["endpoint"] == "completions"
    assert [lv["concurrency"] for lv in result["levels"]] == [1, 4] and result["num_prompts"] == list(counts)
    for level, n in zip(result["levels"], counts, strict=True):
        check_level(level, n, OUT, IN)
        off = level["offline"]
        assert off["max_num_seqs"] == level["concurrency"]
        assert off["total_output_tokens"] == n * OUT and off["total_input_tokens"] == n * IN
        assert off["output_throughput"] > 0 and level["server_over_offline"] > 0
        eng = level["engine"]  # /metrics' counters across the level: the server counts before it sends
        assert eng["generated"] == n * OUT and 0 < eng["prefilled"] <= n * IN
        assert OUT <= eng["steps"] <= n * OUT + n and eng["tokens_per_step"] == eng["generated"] / eng["steps"]
        assert eng["step_ms"] == pytest.approx(1e3 * level["metrics"]["duration_s"] / eng["steps"])
    for name in ("sweep_latency.png", "sweep_throughput.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_poisson_over_sharegpt(server, tmp_path):
    turns = [("Name three colours.", "Red, green and blue are three colours."),
             ("What is the capital of Italy? Answer briefly.", "The capital of Italy is Rome."),
             ("Write one short sentence about cats and dogs.", "Cats and dogs often live together happily."),
             ("hi", "hello")]  # too short to time: skipped, as vLLM does
    data = [{"id": str(i), "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
            for i, (q, a) in enumerate(turns)]
    data.append({"id": "no answer", "conversations": [{"from": "human", "value": "Is anyone there at all?"}]})
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "chat.json"
    result = bench_serving.main(["--base-url", server.url, "--chat", "--dataset", str(path), "--num-prompts", "2",
                                 "--warmup", "1", "--max-output-len", "5", "--request-rate", "20", "--seed", "1",
                                 "--result-file", str(out), "--disable-tqdm"])
    assert result["endpoint"] == "chat/completions" and result["sweep"] == "concurrency"
    [level] = result["levels"]
    assert level["request_rate"] == 20
    check_level(level, 2, 5)
    assert not (tmp_path / "chat_latency.png").exists()  # one level: nothing to plot


def test_sse_lines_split_only_where_sse_does():
    """Text with U+2028 and \\x1c inside a JSON event (random token ids decode to such characters) stays one line,
    across chunk boundaries and whichever of LF, CRLF or CR ends it; httpx's aiter_lines would cut it."""
    import asyncio

    from tools.bench_serving_client import sse_lines

    event = json.dumps({"choices": [{"text": "a\u2028b\x1cc\x85d"}]}, ensure_ascii=False)
    body = f"data: {event}\r\n\r\ndata: {event}\n\ndata: [DONE]\r\r".encode()

    async def lines(step):
        async def chunks():
            for i in range(0, len(body), step):
                yield body[i:i + step]
        return [line async for line in sse_lines(chunks())]

    for step in (1, 7, len(body)):
        data = [line[5:].strip() for line in asyncio.run(lines(step)) if line.startswith("data:")]
        assert data == [event, event, "[DONE]"]
        assert json.loads(data[0])["choices"][0]["text"] == "a\u2028b\x1cc\x85d"
