"""`python -m frontend.chat` against a real server: answers, history, system prompt, errors, Ctrl-C."""

from __future__ import annotations

import io
import json
import queue
import signal
import subprocess
import sys
import threading
import time

import openai
import pytest

from frontend import chat
from tests.serving import ROOT, ServerProcess, child_env, free_port

QUESTION = "What is the capital of France?"
GREEDY = ["--plain", "--temperature", "0", "--max-tokens", "40"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "4") as s:
        yield s


def run_chat(url: str, *args: str, stdin: str = "", timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "frontend.chat", "--url", url, *args], input=stdin, text=True,
                          capture_output=True, cwd=ROOT, env=child_env(), timeout=timeout)


def test_conversation_messages():
    conv = chat.Conversation(system="Be brief.")
    conv.record("hi", "hello")
    assert conv.messages("again") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]
    conv.reset()
    assert conv.messages("x") == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x"}]
    assert chat.Conversation().messages("x") == [{"role": "user", "content": "x"}]


def test_answers_and_reset(server):
    r = run_chat(server.url, *GREEDY, stdin=f"{QUESTION}\n/reset\n{QUESTION}\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("Paris") >= 2, r.stdout
    assert "Traceback" not in r.stderr
    assert "SmolLM2-135M-Instruct" in r.stderr  # the header names the model /v1/models gave
    assert "tok/s" in r.stderr  # usage came with the stream (stream_options.include_usage)


def test_no_stream_and_system(server):
    r = run_chat(server.url, *GREEDY, "--no-stream", "--system", "Answer in one short sentence.", stdin=QUESTION + "\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "Answer in one short sentence." in r.stderr  # the header shows the system prompt


def test_history_and_system_are_sent(server, monkeypatch, capsys):
    """The requests on the wire: each turn carries the system prompt and every earlier turn, /reset drops them."""
    bodies: list[dict] = []

    def record(request) -> None:  # an httpx Request
        if request.url.path.endswith("/chat/completions"):
            bodies.append(json.loads(request.content))

    real = openai.OpenAI
    monkeypatch.setattr(openai, "OpenAI", lambda **kw: real(**kw, http_client=openai.DefaultHttpxClient(
        event_hooks={"request": [record]})))
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{QUESTION}\n/system Answer in one word.\nAnd of Italy?\n"
                                                  "/reset\nHello\n"))
    args = ["--url", server.url, "--plain", "--system", "You are terse.", "--temperature", "0", "--max-tokens", "12",
            "--top-k", "5", "--min-p", "0.1", "--seed", "7"]
    assert chat.main(args) == 0
    out = capsys.readouterr().out
    assert len(bodies) == 3
    first, second, third = (b["messages"] for b in bodies)
    user = lambda text: {"role": "user", "content": text}
    assert first == [{"role": "system", "content": "You are terse."}, user(QUESTION)]
    answer = second[2]
    assert second[:2] == [{"role": "system", "content": "Answer in one word."}, user(QUESTION)]
    assert answer["role"] == "assistant" and answer["content"].strip() and answer["content"] in out
    assert second[3:] == [user("And of Italy?")]
    assert third == [{"role": "system", "content": "Answer in one word."}, user("Hello")]
    b = bodies[0]
    assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
    assert (b["temperature"], b["max_tokens"], b["top_k"], b["min_p"], b["seed"]) == (0, 12, 5, 0.1, 7)
    assert "top_p" not in b  # an unset flag leaves the server's default


def test_server_error_is_one_line(server):
    r = run_chat(server.url, "--plain", "--model", "no-such-model", stdin=f"{QUESTION}\n/bogus\n")
    assert r.returncode == 0
    assert "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, r.stderr
    assert "'no-such-model' does not exist" in errors[0] and "404" in errors[0]
    assert "unknown command /bogus" in errors[1]


def test_unreachable_server_exits_2():
    r = run_chat(f"http://127.0.0.1:{free_port()}/v1", "--plain", stdin=QUESTION + "\n", timeout=60)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "cannot reach" in r.stderr and "is the server running?" in r.stderr


def test_ctrl_c_stops_the_answer_only(server):
    proc = subprocess.Popen([sys.executable, "-m", "frontend.chat", "--url", server.url, "--plain", "--temperature",
                             "0", "--max-tokens", "1500"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=child_env())
    chunks: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [chunks.put(c) for c in iter(lambda: proc.stdout.read(1), "")],
                     daemon=True).start()
    try:
        proc.stdin.write("Tell me a long story about a dragon.\n")
        proc.stdin.flush()
        chunks.get(timeout=120)  # the answer is streaming (on a GPU, ~1,000 tokens a second: interrupt it soon)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write(f"{QUESTION}\n")
        proc.stdin.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=300) == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
    out = "".join(chunks.get() for _ in range(chunks.qsize()))
    assert "(stopped)" in err and "Traceback" not in err
    assert "Paris" in out
