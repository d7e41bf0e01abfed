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
