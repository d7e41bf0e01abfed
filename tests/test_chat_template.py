"""ir.chat_template: HF-compatible rendering and a sandbox that refuses escapes loudly."""

from __future__ import annotations

import enum
import json
import os

import pytest

from ir.chat_template import ChatTemplateError, compile_template, render_chat


class Role(enum.StrEnum):
    USER = "user"


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
    "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Llama-2 style: BOS from the context, system folded into the first user turn, role checks.
LLAMA2 = """{% if messages[0]['role'] == 'system' %}
{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}
{% else %}{% set system = false %}{% endif %}
{% for message in messages %}
{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{% endif %}
{% if message['role'] == 'user' %}
{{ bos_token + '[INST] ' + ('<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' if loop.first and system else '')
   + message['content'] + ' [/INST]' }}
{% else %}
{{ ' ' + message['content'] + ' ' + eos_token }}
{% endif %}
{% endfor %}"""

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Bye"},
]


def test_chatml_roles_and_generation_prompt():
    out = render_chat(CHATML, CONVERSATION)
    assert out == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    )
    assert not render_chat(CHATML, CONVERSATION, add_generation_prompt=False).endswith("assistant\n")


def test_trim_blocks_and_special_tokens():
    out = render_chat(LLAMA2, CONVERSATION, bos_token="<s>", eos_token="</s>")
    # trim_blocks eats the newline after a block tag, not the one after an {{ expression }}.
    assert out == "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST]\n Hello! </s>\n<s>[INST] Bye [/INST]\n"


@pytest.mark.parametrize("src", [CHATML, LLAMA2])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_same_text_as_transformers(src, add_generation_prompt):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    want, _ = utils.render_jinja_template(
        conversations=[CONVERSATION], chat_template=src, add_generation_prompt=add_generation_prompt, **tokens
    )
    assert render_chat(src, CONVERSATION, add_generation_prompt=add_generation_prompt, **tokens) == want[0]


# a template that trims what it is given, as many do (Llama 3's): the cut falls after the trimmed text
TRIMMING = ("{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] | trim + '<|eot|>' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


@pytest.mark.parametrize("src", [CHATML, LLAMA2, TRIMMING])
@pytest.mark.parametrize("final", ["The answer is", "The answer is ", " Hello! "])
def test_continue_final_message_as_transformers_cuts_it(src, final):
    """The reply is prefilled: the text ends inside the last (assistant) message, nothing of the template after it,
    as transformers' continue_final_message renders it (trailing whitespace kept where the template keeps it)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    chat = [*CONVERSATION, {"role": "assistant", "content": final}]
    want, _ = utils.render_jinja_template(conversations=[chat], chat_template=src, add_generation_prompt=False,
                                          continue_final_message=True, **tokens)
    got = render_chat(src, chat, continue_final_message=True, **tokens)
    assert got == want[0] and got.rstrip().endswith("answer is" if "answer" in final else "Hello!")
    assert render_chat(src, chat, add_generation_prompt=False, **tokens).startswith(got)


def test_continue_final_message_needs_text_the_template_keeps():
    with pytest.raises(ChatTemplateError, match="no text to continue"):
        render_chat(CHATML, [*CONVERSATION, {"role": "assistant", "content": "  "}], continue_final_message=True)
    upper = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match="not in the rendered chat"):
        render_chat(upper, [{"role": "assistant", "content": "ok then"}], continue_final_message=True)


def test_missing_special_tokens_are_undefined():
    src = "{% if bos_token is defined %}{{ bos_token }}{% else %}none{% endif %}"
    assert render_chat(src, []) == "none"
    assert render_chat(src, [], bos_token="<s>") == "<s>"


def test_content_parts_pass_through():
    src = (
        "{% for m in messages %}{% for part in m['content'] %}"
        "{% if part['type'] == 'text' %}{{ part['text'] }}{% else %}<{{ part['type'] }}>{% endif %}"
        "{% endfor %}{% endfor %}"
    )
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    assert render_chat(src, messages) == "<image>what is it?"


def test_tools_tojson_and_extra_context():
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"a": "<b>"}}}]
    src = "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ enable_thinking }}"
    out = render_chat(src, [], tools=tools, enable_thinking=False)
    first, second, third = out.split("|")
    assert first == json.dumps(tools, ensure_ascii=False)  # no HTML escaping, no \\u escapes
    assert second == json.dumps(tools[0], ensure_ascii=False, indent=2)
    assert third == "False"


def test_none_keys_dropped_and_objects_made_plain():
    src = (
        "{% for m in messages %}{{ m.tool_calls is defined }} {{ m.content }} {{ m.kind }}"
        "{% endfor %} {{ blob }}"
    )
    messages = [{"role": "assistant", "content": "x", "tool_calls": None, "kind": Role.USER}]
    # A str enum renders as its value; an arbitrary object only as a placeholder, methods unreachable.
    assert render_chat(src, messages, blob=object()) == "False x user <object>"


def test_hf_globals_and_extensions():
    src = (
        "{{ strftime_now('%Y') | length }}"
        "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}"
        "{% set ns = namespace(n=0) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
        "{% generation %}G{% endgeneration %}{{ dict(a=1)['a'] }}"
    )
    assert render_chat(src, []) == "40121G1"


def test_raise_exception_is_a_chat_template_error():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat(LLAMA2, [{"role": "assistant", "content": "x"}], bos_token="<s>", eos_token="</s>")
    assert issubclass(ChatTemplateError, ValueError)


def test_syntax_error_names_the_line():
    with pytest.raises(ChatTemplateError, match="line 3"):
        compile_template("ok\nstill ok\n{% for x in %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="syntax"):
        render_chat("{{ unclosed", [])


@pytest.mark.parametrize(
    ("src", "attr"),
    [
        ("{{ ''.__class__ }}", "__class__"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__subclasses__"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__class__"),
        ("{{ cycler.__init__.__globals__ }}", "__init__"),
        ("{{ cycler.__init__.__globals__ }}", "__globals__"),
        ("{{ x['__class__'] }}", "__class__"),
        ("{{ ''|attr('__class__') }}", "__class__"),
        ("{{ messages|map(attribute='__class__')|list }}", "__class__"),
        ("{{ dict.mro() }}", "mro"),
        ("{% set ns = namespace() %}{% set ns.__dict__ = 1 %}", "__dict__"),
    ],
)
def test_unsafe_attributes_refused_at_compile_time(src, attr):
    with pytest.raises(ChatTemplateError, match=f"unsafe attribute.*'{attr}'"):
        compile_template(src)
    with pytest.raises(ChatTemplateError, match=attr):
        render_chat(src, [], x={})


@pytest.mark.parametrize(
    ("src", "attr"),
    [
        ("{{ ''|attr('__cla' ~ 'ss__') }}", "__class__"),  # name built at run time
        ("{{ x[name] }}", "__class__"),
        ("{{ '{0.__class__}'.format(1) }}", "__class__"),  # str.format's field lookups
        ("{{ messages.append(1) }}", "append"),  # the immutable sandbox's mutation guard
        ("{{ namespace(**{'_x': 1}) }}", "_x"),
    ],
)
def test_unsafe_attributes_refused_at_render_time(src, attr):
    compile_template(src)  # nothing literal to refuse here
    # Jinja's own sandbox would render most of these as an empty string instead of failing.
    with pytest.raises(ChatTemplateError, match=f"unsafe attribute '{attr}'"):
        render_chat(src, [], x={}, name="__class__")


def test_normal_template_works_after_refusals():
    for src in ("{{ ''.__class__ }}", "{{ ''|attr('__cla' ~ 'ss__') }}"):
        with pytest.raises(ChatTemplateError):
            render_chat(src, [])
    assert render_chat(CHATML, [{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_compiled_templates_are_cached():
    assert compile_template(CHATML) is compile_template(CHATML)
