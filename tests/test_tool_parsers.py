"""The tool-call parsers and the reasoning split on outputs in each model family's real format: read whole, and
streamed in pieces of 1, 2, 3 and 7 characters, whose deltas (in OpenAI's shape) must join to the same message
with no marker in the content."""

from __future__ import annotations

import json

import jsonschema
import pytest

from frontend.chat_output import OutputParsing
from frontend.protocol import NamedToolChoice, ToolDef
from frontend.reasoning import Reasoning, prompt_opens_reasoning
from frontend.tool_parsers import PARSERS, NamedParser, RequiredParser, detect
from frontend.tools import tool_schema

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"tz": {"type": "string"}}}}}]
MARKERS = ["<tool_call>", "</tool_call>", "tool_call", "<|python_tag|>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
           "tool▁call", "tool▁sep", "<arg_key>", "<arg_value>", "<|python_start|>", "<|python_end|>", "<think>",
           "</think>", "```json"]
PARIS = ("get_weather", {"city": "Paris"})
UTC = ("get_time", {"tz": "UTC"})

DS_CALLS, DS_CALL, DS_END, DS_SEP = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", \
    "<｜tool▁sep｜>"
CASES = [  # (parser, output, content, calls)
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', "Let me look.", [PARIS, UTC]),
    ("hermes", '<tool_call>\n{"arguments": {"city": "Paris"}, "name": "get_weather"}\n</tool_call>', None, [PARIS]),
    ("hermes", "No tools needed: 2 < 3, and <b>bold</b> <tool", "No tools needed: 2 < 3, and <b>bold</b> <tool", []),
    ("hermes", 'Broken: <tool_call>{"nome": 1}</tool_call>', 'Broken: <tool_call>{"nome": 1}</tool_call>', []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "get_time", "parameters": {"tz": "UTC"}}', None, [PARIS, UTC]),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", "The answer is {4}.", "The answer is {4}.", []),
    ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "get_time", "arguments": {"tz": "UTC"}}]', "Sure.", [PARIS, UTC]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}', None,
     [PARIS, UTC]),
    ("mistral", '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}', None, [PARIS]),
    ("mistral", "Paris [TOOL is a [list]", "Paris [TOOL is a [list]", []),
    ("deepseek_v3", f'Checking.{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}\n```'
     f'{DS_END}\n{DS_CALL}function{DS_SEP}get_time\n```json\n{{"tz": "UTC"}}\n```{DS_END}<｜tool▁calls▁end｜>',
     "Checking.", [PARIS, UTC]),
    ("deepseek_v3", f'{DS_CALLS}{DS_CALL}get_weather{DS_SEP}{{"city": "Paris"}}{DS_END}<｜tool▁calls▁end｜>', None,
     [PARIS]),
    ("glm4", "I will look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
     "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", "I will look.",
     [("get_weather", {"city": "Paris", "days": 3})]),
    ("glm4", "<tool_call>get_weather<arg_key>city</arg_key><arg_value>1984</arg_value></tool_call>"
     "<tool_call>get_time<arg_key>tz</arg_key><arg_value>UTC</arg_value></tool_call>", None,
     [("get_weather", {"city": "1984"}), UTC]),
    ("glm4", 'get_weather\n{"city": "Paris"}', None, [PARIS]),
    ("glm4", "get weather yourself", "get weather yourself", []),
    ("pythonic", '[get_weather(city="Paris", days=3), get_time(tz="UTC")]', None,
     [("get_weather", {"city": "Paris", "days": 3}), UTC]),
    ("pythonic", '<|python_start|>[get_weather(city="Paris (FR)")]<|python_end|>', None,
     [("get_weather", {"city": "Paris (FR)"})]),
    ("pythonic", "[1] is a citation, not a call.", "[1] is a citation, not a call.", []),
]


def tool_parser(name: str):
    return PARSERS[name](TOOLS)


def streamed(parsing: OutputParsing, text: str, size: int) -> dict:
    """The message the deltas of `text` streamed `size` characters at a time join to; checks their shape."""
    reader = parsing.reader()
    reasoning, content, calls = "", "", []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for k, piece in enumerate(pieces):
        for delta in reader.feed(piece, k == len(pieces) - 1):
            assert len(delta) == 1, delta
            reasoning += delta.get("reasoning_content", "")
            content += delta.get("content", "")
            for tc in delta.get("tool_calls", []):
                if tc["index"] == len(calls):  # the header: id, type and name, arguments ""
                    assert tc["id"].startswith("call_") and tc["type"] == "function", tc
                    assert tc["function"]["arguments"] == ""
                    calls.append({"id": tc["id"], "name": tc["function"]["name"], "arguments": ""})
                else:
                    assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}, tc
                    calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    return {"reasoning": reasoning, "content": content, "calls": calls}


def check(parsing: OutputParsing, text: str, content: str | None, calls: list, reasoning: str | None = None) -> None:
    msg, finish = parsing.message(text, "stop")
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls", [])]
    assert got == calls
    assert msg["content"] == content
    assert finish == ("tool_calls" if calls else "stop")
    if parsing.reasoning is not None:
        assert msg["reasoning_content"] == reasoning
    for size in (1, 2, 3, 7):
        s = streamed(parsing, text, size)
        assert s["content"] == (msg["content"] or ""), size
        assert s["reasoning"] == (msg.get("reasoning_content") or ""), size
        assert [(c["name"], c["arguments"]) for c in s["calls"]] == \
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])], size
        if calls:
            assert not any(m in s["content"] for m in MARKERS), s["content"]


@pytest.mark.parametrize("name,text,content,calls", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_whole_and_streamed(name, text, content, calls):
    check(OutputParsing(None, tool_parser(name)), text, content, calls)


def test_every_parser_is_tested_and_detected():
    assert {c[0] for c in CASES} == set(PARSERS)
    assert detect("{{ '<tool_call>' }}") == "hermes"
    assert detect("[TOOL_CALLS] <tool_call>") == "mistral"
    assert detect("<tool_call>{{ name }}<arg_key>") == "glm4"
    assert detect("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect("<|python_tag|>") == "llama3_json"
    assert detect("<|python_start|>") == "pythonic"
    assert detect("{{ messages }}") is None and detect(None) is None


def test_streamed_arguments_keep_the_model_text():
    """Arguments stream as the model wrote them (spaces, unicode, nesting), so every fragment is final."""
    text = '<tool_call>{"name": "f", "arguments": {"q": "café \\"x\\" }", "n": [1, {"a": null}], "m": -12.5}}' \
           '</tool_call>'
    msg, _ = OutputParsing(None, tool_parser("hermes")).message(text, "stop")
    args = msg["tool_calls"][0]["function"]["arguments"]
    assert json.loads(args) == {"q": 'café "x" }', "n": [1, {"a": None}], "m": -12.5}
    assert streamed(OutputParsing(None, tool_parser("hermes")), text, 1)["calls"][0]["arguments"] == args


def test_cut_output_keeps_what_was_read():
    """An output cut by max_tokens: the call read so far, finish_reason length."""
    parsing = OutputParsing(None, tool_parser("hermes"))
    msg, finish = parsing.message('Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Pa', "length")
    assert finish == "length" and msg["content"] == "Hi"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


REASONING = [  # (starts inside, output, reasoning, content)
    (True, "The user wants a city.\n</think>\n\nParis.", "The user wants a city.\n", "Paris."),
    (False, "<think>\nhmm</think>Paris.", "\nhmm", "Paris."),
    (False, "Paris, no thinking.", None, "Paris, no thinking."),
    (True, "thinking that never ends", "thinking that never ends", None),
    (True, "<think>R1 opening it again</think>ok", "R1 opening it again", "ok"),
]


@pytest.mark.parametrize("inside,text,reasoning,content", REASONING)
def test_reasoning_split(inside, text, reasoning, content):
    check(OutputParsing(Reasoning(inside), None), text, content, [], reasoning)


def test_reasoning_then_tool_call():
    """Tool calls are read in the content only: a call written while thinking is part of the reasoning."""
    parsing = OutputParsing(Reasoning(True), tool_parser("hermes"))
    thought = 'maybe <tool_call>{"name": "get_time", "arguments": {}}</tool_call>? '
    text = thought + '</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    check(parsing, text, None, [PARIS], thought)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


def test_required_and_named_outputs():
    text = ' [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": ' \
           '{"tz": "UTC"}}]'
    check(OutputParsing(None, RequiredParser(TOOLS)), text, None, [PARIS, UTC])
    check(OutputParsing(None, NamedParser("get_weather", TOOLS)), '{"city": "Paris"}', None, [PARIS])


def test_tool_schema_required_and_named():
    tools = [ToolDef.model_validate(t) for t in TOOLS]
    schema = tool_schema(tools, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    ok = [{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(ok, schema)
    for bad in ([], [{"name": "get_stock", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                [{"name": "get_weather", "parameters": {"city": "Paris", "days": "two"}}], {"name": "get_time"}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = tool_schema(tools, NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}))
    assert named == TOOLS[1]["function"]["parameters"]
    assert tool_schema(tools, "auto") is None and tool_schema(tools, "none") is None


def test_parser_choice_from_flags_template_and_request():
    from frontend.chat_output import ParserChoice
    from frontend.protocol import ChatCompletionRequest
    from tests.tool_templates import QWEN_TOOLS

    auto = ParserChoice.resolve("auto", "auto", QWEN_TOOLS)
    assert (auto.tool_parser, auto.reasoning_parser) == ("hermes", "qwen3")
    assert ParserChoice.resolve("auto", "auto", "{{ messages }}") == ParserChoice(None, None)
    assert ParserChoice.resolve("mistral", "none", QWEN_TOOLS) == ParserChoice("mistral", None)

    def parsing(**body):
        req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], **body})
        return auto.for_request(req, "<|im_start|>assistant\n<think>\n")

    assert parsing().tools is None and parsing().reasoning.starts_inside
    assert isinstance(parsing(tools=TOOLS).tools, PARSERS["hermes"])
    assert parsing(tools=TOOLS, tool_choice="none").tools is None
    forced = parsing(tools=TOOLS, tool_choice="required")  # the schema binds from the first token: no reasoning
    assert isinstance(forced.tools, RequiredParser) and forced.reasoning is None
    named = parsing(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert isinstance(named.tools, NamedParser) and named.tools.function == "get_time"
