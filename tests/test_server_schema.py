"""schemathesis over /openapi.json: generated requests, valid and not, never get a 5xx, and what the server
answers matches the schema it publishes. The server is the hub path end to end: `--m` resolves a tiny
random llama (SmolLM2's tokenizer and template) from a Hugging Face cache, offline."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.serving import ServerProcess
from tests.tiny_chat_model import REPO, hub_cache


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, smollm_path):
    cache = hub_cache(tmp_path_factory.mktemp("hf-cache"), smollm_path)
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    with ServerProcess("--m", REPO, "--max-model-len", "128", "--max-gen-tokens", "8", "--max-num-seqs", "16",
                       "--mem", "64", env=env) as s:
        yield s


def test_served_from_the_hub_cache(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.url, api_key="unused", max_retries=0)
    assert client.models.list().data[0].id == REPO
    r = client.chat.completions.create(model=REPO, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"


def test_schemathesis_finds_no_server_error(tiny_server, tmp_path):
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe, "schemathesis is a test dependency (pyproject's test extra)"
    checks = "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance"
    r = subprocess.run([exe, "run", tiny_server.base + "/openapi.json", "--checks", checks,
                        "--max-examples", "25", "--workers", "1", "--phases", "examples,coverage,fuzzing",
                        "--seed", "1",
                        # path parameters (/v1/models/{model}) filter out many drawn strings, which is no bug
                        "--suppress-health-check", "filter_too_much", "--request-timeout", "60", "--no-color"],
                       capture_output=True, text=True, timeout=900, cwd=tmp_path)
    report = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, report + "\n--- server log ---\n" + tiny_server.log()[-4000:]
    assert "passed" in r.stdout.lower()
