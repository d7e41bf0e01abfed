"""`python -m frontend.chat`: a terminal chat client for any OpenAI-compatible server (this one by default).

It keeps the conversation and sends all of it each turn (the server is stateless), streams the answer and renders
it as Markdown with rich. `--plain` writes the bare text instead, and then only the answers go to stdout (headers,
token counts and errors go to stderr), so `echo question | python -m frontend.chat --plain` is usable in a pipe.
Piped stdin is read as one message per line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import openai
from rich.console import Console
from rich.live import Live
from rich.markdown import Markdown

HELP = """commands:
  /system TEXT   set the system prompt (the history is kept); /system alone shows it
  /reset         forget the conversation, keep the system prompt
  /help          this text
  /exit, /quit   leave (so do Ctrl-D and the end of piped input)
Ctrl-C stops an answer and keeps the chat going. Start a message with // to send one beginning with /."""


@dataclass
class Conversation:
    """What the next request sends: the system prompt, every finished turn, then the new user message."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user: str) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + [{"role": "user", "content": user}]

    def record(self, user: str, answer: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]

    def reset(self) -> None:
        self.turns.clear()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m frontend.chat", description="Chat with an OpenAI-compatible server.")
    ap.add_argument("--url", default="http://127.0.0.1:2000/v1", help="API base, ending in /v1 (default %(default)s)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or "none",
                    help="bearer key (default: $OPENAI_API_KEY, else 'none')")
    ap.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    ap.add_argument("--system", metavar="PROMPT", help="system prompt")
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--top-k", type=int, help="not an OpenAI field: sent in the body as vLLM does")
    ap.add_argument("--min-p", type=float, help="not an OpenAI field: sent in the body as vLLM does")
    ap.add_argument("--max-tokens", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--no-stream", action="store_true", help="wait for the whole answer")
    ap.add_argument("--plain", action="store_true", help="plain text, no colours or Markdown (for pipes and tests)")
    return ap.parse_args(argv)


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the flags set; an unset flag is left out so that the server's default applies."""
    kw = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("seed", args.seed),
                            ("max_tokens", args.max_tokens)) if v is not None}
    extra = {k: v for k, v in (("top_k", args.top_k), ("min_p", args.min_p)) if v is not None}
    return kw | ({"extra_body": extra} if extra else {})


def error_text(e: openai.OpenAIError) -> str:
    """One line for any client error: the server's own message when it sent an OpenAI error body."""
    if isinstance(e, openai.APIConnectionError):  # (APITimeoutError is one too)
        return f"cannot reach {e.request.url}: {e.__cause__ or e}"
    body = getattr(e, "body", None)
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        status = getattr(e, "status_code", None)
        return f"{body['message']} (HTTP {status})" if status else body["message"]
    return str(e)


class Chat:
    def __init__(self, client: openai.OpenAI, model: str, args: argparse.Namespace, console: Console):
        self.client, self.model, self.args, self.console = client, model, args, console
        self.conv = Conversation(system=args.system)

    def info(self, text: str, style: str = "dim") -> None:
        """Status lines and errors: styled in rich mode; on stderr in plain mode, to keep stdout for the answers."""
        if self.args.plain:
            print(text, file=sys.stderr, flush=True)
        else:
            self.console.print(text, style=style, markup=False, highlight=False)

    def command(self, line: str) -> bool:
        """Runs a slash command; False means leave."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.conv.reset()
            self.info("(the conversation is cleared)")
        elif name == "/system" and rest.strip():
            self.conv.system = rest.strip()
            self.info("(system prompt set)")
        elif name == "/system":
            self.info(f"system prompt: {self.conv.system!r}" if self.conv.system else "(no system prompt)")
        elif name == "/help":
            self.info(HELP)
        else:
            self.info(f"error: unknown command {name}; /help lists them", "bold red")
        return True

    def ask(self, user: str) -> None:
        """One turn. A turn that fails is forgotten; one stopped with Ctrl-C keeps what came, so the chat goes on."""
        start, first = time.monotonic(), None
        text, usage, finish = "", None, None
        request = dict(model=self.model, messages=self.conv.messages(user), **sampling(self.args))
        try:
            if self.args.no_stream:
                reply = self.client.chat.completions.create(**request)
                answer, usage = reply.choices[0], reply.usage
                text, finish = answer.message.content or "", answer.finish_reason
                with self.renderer() as render:
                    render(text, text)
            else:
                stream = self.client.chat.completions.create(**request, stream=True,
                                                             stream_options={"include_usage": True})
                with stream, self.renderer() as render:  # leaving closes the response, so the server aborts
                    for chunk in stream:
                        usage = chunk.usage or usage
                        choice = chunk.choices[0] if chunk.choices else None
                        finish = choice and choice.finish_reason or finish
                        if choice and choice.delta.content:
                            first = first or time.monotonic()
                            text += choice.delta.content
                            render(choice.delta.content, text)
        except KeyboardInterrupt:
            self.info("(stopped)")
            if text:
                self.conv.record(user, text)
            return
        except openai.OpenAIError as e:
            self.info(f"error: {error_text(e)}", "bold red")
            return
        self.conv.record(user, text)
        self.stats(start, first, usage, finish)

    def stats(self, start: float, first: float | None, usage: Any, finish: str | None) -> None:
        end = time.monotonic()
        parts = [f"{usage.prompt_tokens} prompt + {usage.completion_tokens} tokens"] if usage else []
        parts.append(f"{end - start:.1f} s")
        if first is not None and usage and usage.completion_tokens > 1:  # decoding speed, the prefill left out
            rate = (usage.completion_tokens - 1) / (end - first)
            parts += [f"first token {first - start:.2f} s", f"{rate:.1f} tok/s"]
        elif usage and usage.completion_tokens:  # --no-stream: no first token to time, so the prefill counts
            parts.append(f"{usage.completion_tokens / (end - start):.1f} tok/s")
        if finish == "length":
            parts.append("cut at the token limit")
        self.info(" · ".join(parts))

    @contextmanager
    def renderer(self) -> Iterator[Callable[[str, str], None]]:
        """Yields render(delta, text_so_far): raw writes in plain mode, else a live Markdown view."""
        if self.args.plain:
            try:
                yield lambda delta, text: print(delta, end="", flush=True)
            finally:
                print(flush=True)
            return
        latest, parsed_at = "", 0.0
        # "visible": an answer taller than the terminal scrolls instead of being cut to the last screenful
        live = Live(Markdown(""), console=self.console, refresh_per_second=12, vertical_overflow="visible")

        def render(delta: str, text: str) -> None:
            nonlocal latest, parsed_at
            latest = text
            if time.monotonic() - parsed_at > 0.05:  # parsing the whole answer per token is quadratic
                live.update(Markdown(text))
                parsed_at = time.monotonic()

        with no_echo(), live:
            try:
                yield render
            finally:
                live.update(Markdown(latest))  # the last tokens may have come between two parses


@contextmanager
def no_echo() -> Iterator[None]:
    """Turns the terminal's echo off while an answer streams: keys typed then, and the "^C" a Ctrl-C echoes, would
    move the cursor under rich's live view, which then redraws one line too low (input() still sees typed keys)."""
    try:
        import termios
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd) if sys.stdin.isatty() else None
    except (ImportError, OSError, ValueError):  # not a Unix terminal (or stdin was replaced)
        saved = None
    if saved is None:
        yield
        return
    termios.tcsetattr(fd, termios.TCSANOW, saved[:3] + [saved[3] & ~termios.ECHO] + saved[4:])
    try:
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSANOW, saved)


def read_line(console: Console, plain: bool) -> str | None:
    """The next message, or None at EOF. A terminal gets a prompt (with readline editing); a pipe gives lines."""
    if not sys.stdin.isatty():
        line = sys.stdin.readline()
        return line.rstrip("\r\n") if line else None
    try:
        return input("> ") if plain else console.input("[bold green]>[/] ")
    except EOFError:
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False)
    # rich's live view needs a terminal: written to a pipe or a file it pads lines and runs the stats into them
    args.plain = args.plain or not console.is_terminal
    # no retries: a dead server should say so at once, not after a back-off; the timeout is generous because a
    # long answer on a CPU can take minutes
    client = openai.OpenAI(base_url=args.url, api_key=args.api_key, max_retries=0, timeout=600)
    try:
        ids = [m.id for m in client.models.list()]
    except openai.OpenAIError as e:
        hint = "\nis the server running? (python -m frontend --p PORT)" if isinstance(e, openai.APIConnectionError) \
            else ""
        print(f"error: {error_text(e)}{hint}", file=sys.stderr)
        return 2
    model = args.model or (ids[0] if ids else None)
    if model is None:
        print(f"error: {args.url}/models lists no model; pass --model", file=sys.stderr)
        return 2
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and up-arrow history for input())
        except ImportError:
            pass
    chat = Chat(client, model, args, console)
    chat.info(f"{model} at {args.url}" + (f" · system: {args.system!r}" if args.system else "") + " · /help")
    while True:
        try:
            line = read_line(console, args.plain)
        except KeyboardInterrupt:  # at the prompt: drop the line, as a shell does
            chat.info("\n(Ctrl-D or /exit leaves)")
            continue
        if line is None:
            break
        line = line.strip()
        if line.startswith("/") and not line.startswith("//"):
            if not chat.command(line):
                break
        elif line:
            chat.ask(line[1:] if line.startswith("//") else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
