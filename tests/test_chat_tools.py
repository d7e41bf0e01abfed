"""Tools and tool-call histories reach the chat template as transformers hands them over (arguments as a dict), and
the tool checks' 400s: rendered through the server's own conversion against transformers' renderer."""

from __future__ import annotations

import copy
import json

import pytest
from transformers.utils.chat_template_utils import render_jinja_template

from frontend.errors import APIError
from frontend.protocol import ChatCompletionRequest
from frontend.tools import check_tools, template_messages, template_tools
from ir.chat_template import render_chat
from tests.tool_templates import QWEN_TOOLS, TOOL_HISTORY, WEATHER_TOOL


def as_transformers_wants(messages: list[dict]) -> list[dict]:
    out = copy.deepcopy(messages)
    for m in out:
        for call in m.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def ours(messages: list[dict], tools: list[dict] | None, **kw) -> str:
    req = ChatCompletionRequest.model_validate({"messages": messages, "tools": tools})
    check_tools(req.tools, req.tool_choice)
    return render_chat(QWEN_TOOLS, template_messages(req.messages), tools=template_tools(req), **kw)


def test_tools_and_tool_history_render_as_transformers_does():
    text = ours(TOOL_HISTORY, [WEATHER_TOOL])
    ref = render_jinja_template([as_transformers_wants(TOOL_HISTORY)], tools=[WEATHER_TOOL], chat_template=QWEN_TOOLS,
                                add_generation_prompt=True)[0][0]
    assert text == ref
    assert json.dumps(WEATHER_TOOL) in text  # the tool's JSON in the system turn
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\n24 C, clear\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")


def test_no_tools_no_tool_prompt():
    text = ours([{"role": "user", "content": "Hi"}], None, enable_thinking=False)
    assert "<tools>" not in text and text.endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("tools,choice,param", [
    ([WEATHER_TOOL, WEATHER_TOOL], "auto", "tools.1.function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": "x"}}}], None,
     "tools.0.function.parameters.required"),
    ([WEATHER_TOOL], {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(tools, choice, param):
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                "tool_choice": choice})
    with pytest.raises(APIError) as e:
        check_tools(req.tools, req.tool_choice)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_arguments_that_are_not_json_are_a_400():
    bad = copy.deepcopy(TOOL_HISTORY)
    bad[1]["tool_calls"][1]["function"]["arguments"] = '{"city": '
    with pytest.raises(APIError) as e:
        template_messages(ChatCompletionRequest.model_validate({"messages": bad}).messages)
    assert e.value.param == "messages.1.tool_calls.1.function.arguments"


def test_serving_streams_each_choice_through_its_own_parser(smollm_path):
    """serving's chunk builder over two choices reported token by token, as the engine reports them (a hermes call in
    one, plain text in the other): a role chunk each, the call's deltas in OpenAI's shape, finish_reason
    tool_calls only where a call was made."""
    from core.sampling_params import SamplingParams
    from frontend.chat_output import ParserChoice
    from frontend.engine.outputs import CompletionOutput, TokenView
    from frontend.protocol import ServerDefaults
    from frontend.serving import OpenAIServing, ServedModel
    from ir.loader import load_tokenizer

    tok = load_tokenizer(smollm_path)
    serving = OpenAIServing(None, None, tok, ServedModel("m", 512, tok.vocab_size, 0), ServerDefaults(), 8)
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "tools": [WEATHER_TOOL], "stream": True})
    parsing = ParserChoice.resolve("hermes", "none", None).for_request(req, "")
    chunks = serving._chat_chunks(SamplingParams(n=2), 0, [1, 2], parsing)
    texts = ['Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
             "No call <here>."]
    ids = [tok.encode(t, add_special_tokens=False) for t in texts]
    out = []
    for step in range(max(map(len, ids))):
        for index, seq in enumerate(ids):
            if step >= len(seq):
                continue
            pieces = [tok.decode(seq[:k + 1])[len(tok.decode(seq[:k])):] for k in range(step + 1)]
            last = step == len(seq) - 1
            c = CompletionOutput(index, pieces, len(pieces), len("".join(pieces)), TokenView(seq, step + 1),
                                 "stop" if last else None, None, None, pieces[-1], [seq[step]])
            out += chunks(0, c, step == 0, last)
    for index, finish in ((0, "tool_calls"), (1, "stop")):
        mine = [c for c in out if c["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [finish]
        content = "".join(c["delta"].get("content", "") for c in mine)
        calls = [tc for c in mine for tc in c["delta"].get("tool_calls", [])]
        if index == 1:
            assert content == texts[1] and not calls
            continue
        assert content == "Sure."
        assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                            "function": {"name": "get_weather", "arguments": ""}}
        assert json.loads("".join(tc["function"]["arguments"] for tc in calls[1:])) == {"city": "Paris"}
