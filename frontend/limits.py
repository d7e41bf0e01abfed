"""The server's bounds on one request, each with its flag: a request past one gets a 400 (413 for the body) that
names the limit, before any tokenization, so that no request can stall the others."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields

from frontend.errors import APIError, bad_request

_TOKEN_ID = re.compile(r"-?[0-9]+")  # ASCII digits only: "²".isdigit() is True, and int("²") raises


@dataclass
class ServingLimits:
    max_request_bytes: int = 8 * 2**20  # the body, answered 413 before it is parsed
    max_stop: int = 4  # stop strings (OpenAI's limit)
    max_stop_chars: int = 256  # characters in one stop string
    max_n: int = 128  # choices per prompt
    max_prompts: int = 256  # prompts in one completions request
    max_request_seqs: int = 256  # prompts x n in one request
    max_logit_bias: int = 1024  # logit_bias entries
    max_messages: int = 2048  # chat messages
    max_prompt_chars: int = 4 * 2**20  # characters to tokenize: one text prompt, /tokenize, a chat's messages
    max_waiting_seqs: int = 4096  # 429 when more sequences than this wait (--max-waiting counts requests)

    FLAGS = {  # field -> (flag, help)
        "max_request_bytes": ("--max-request-bytes", "answer 413 to a body larger than this (default 8 MiB)"),
        "max_stop": ("--max-stop", "stop strings in a request (default 4, as OpenAI)"),
        "max_stop_chars": ("--max-stop-chars", "characters in one stop string (default 256)"),
        "max_n": ("--max-n", "n, choices per prompt (default 128)"),
        "max_prompts": ("--max-prompts", "prompts in one completions request, inputs in one embeddings request "
                        "(default 256)"),
        "max_request_seqs": ("--max-request-seqs", "prompts x n in one request (default 256)"),
        "max_logit_bias": ("--max-logit-bias", "logit_bias entries (default 1024)"),
        "max_messages": ("--max-messages", "messages in a chat request (default 2048)"),
        "max_prompt_chars": ("--max-prompt-chars", "characters a request asks to tokenize (default 4 Mi)"),
        "max_waiting_seqs": ("--max-waiting-seqs", "answer 429 when more than N sequences wait (default 4096)"),
    }

    @classmethod
    def add_flags(cls, ap: argparse.ArgumentParser, positive) -> None:
        group = ap.add_argument_group("request limits (a request past one gets a 400 naming it)")
        defaults = cls()
        for f in fields(cls):
            flag, text = cls.FLAGS[f.name]
            group.add_argument(flag, metavar="N", type=positive, default=getattr(defaults, f.name), help=text)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServingLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    # -- checks -------------------------------------------------------------------------------------
    def check_sampling(self, req) -> None:
        """The fields chat and completions share (SamplingFields)."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stop) > self.max_stop:
            raise bad_request(f"stop: at most {self.max_stop} stop strings are allowed, got {len(stop)}", "stop")
        longest = max(map(len, stop), default=0)
        if longest > self.max_stop_chars:
            raise bad_request(f"stop: a stop string may have at most {self.max_stop_chars} characters, got one of "
                              f"{longest}", "stop")
        if req.n > self.max_n:
            raise bad_request(f"n: at most {self.max_n} choices are allowed, got {req.n}", "n")
        if req.logit_bias and len(req.logit_bias) > self.max_logit_bias:
            raise bad_request(f"logit_bias: at most {self.max_logit_bias} entries are allowed, got "
                              f"{len(req.logit_bias)}", "logit_bias")

    def check_messages(self, messages: list) -> None:
        if len(messages) > self.max_messages:
            raise bad_request(f"messages: at most {self.max_messages} messages are allowed, got {len(messages)}",
                              "messages")
        chars = sum(len(m.text()) for m in messages)
        if chars > self.max_prompt_chars:
            raise bad_request(f"messages: at most {self.max_prompt_chars} characters of content are allowed, got "
                              f"{chars}", "messages")

    def check_prompts(self, count: int, n: int, texts: list[str]) -> None:
        if count > self.max_prompts:
            raise bad_request(f"prompt: at most {self.max_prompts} prompts are allowed in one request, got {count}",
                              "prompt")
        if count * n > self.max_request_seqs:
            raise bad_request(f"prompt: {count} prompts x n={n} asks for {count * n} sequences; at most "
                              f"{self.max_request_seqs} are allowed in one request", "prompt")
        self.check_chars(texts, "prompt")

    def check_inputs(self, count: int, texts: list[str]) -> None:
        """An embeddings request's inputs: at most max_prompts of them, each text at most max_prompt_chars."""
        if count > self.max_prompts:
            raise bad_request(f"input: at most {self.max_prompts} inputs are allowed in one request, got {count}",
                              "input")
        self.check_chars(texts, "input")

    def check_chars(self, texts: list[str], param: str) -> None:
        longest = max(map(len, texts), default=0)
        if longest > self.max_prompt_chars:
            raise bad_request(f"{param}: at most {self.max_prompt_chars} characters are allowed, got {longest}",
                              param)

    def check_waiting(self, requests: int, seqs: int, new_requests: int, new_seqs: int, max_waiting: int) -> None:
        """429 when the new request(s) would leave too many requests, or too many sequences, waiting."""
        if requests + new_requests > max_waiting:
            raise APIError(429, f"the server is busy: {requests} requests are waiting (limit {max_waiting}); "
                           "retry later", None, "too_many_requests")
        if seqs + new_seqs > self.max_waiting_seqs:
            raise APIError(429, f"the server is busy: {seqs} sequences are waiting and this request adds "
                           f"{new_seqs} (limit {self.max_waiting_seqs}); retry later", None, "too_many_requests")


def token_id_key(key: str) -> bool:
    """Whether a logit_bias key spells a token id (ASCII digits, an optional minus)."""
    return _TOKEN_ID.fullmatch(key) is not None
