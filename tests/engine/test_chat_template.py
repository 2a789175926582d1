"""Chat templating (engine/chat_template.py) on the default model's tokenizer: which
template wins, template variables, and errors that name the field to blame."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenloom.engine.chat_template import load_chat_template, render_chat
from tokenloom.engine.protocol import ChatOptions

HI = [{"role": "user", "content": "Hi"}]
ROLES = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"


def test_model_template_and_generation_prompt(tokenizer: Any) -> None:
    opened = render_chat(tokenizer, HI, ChatOptions())
    assert opened.text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert opened.token_ids == tokenizer.encode(opened.text, add_special_tokens=False)
    closed = render_chat(tokenizer, HI, ChatOptions(add_generation_prompt=False))
    assert closed.text == opened.text.removesuffix("<|im_start|>assistant\n")


def test_continue_final_message(tokenizer: Any) -> None:
    conversation = [*HI, {"role": "assistant", "content": "Hello, I am"}]
    options = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    rendered = render_chat(tokenizer, conversation, options)
    assert rendered.text.endswith("<|im_start|>assistant\nHello, I am")
    with pytest.raises(ValueError, match="^continue_final_message"):
        render_chat(tokenizer, conversation, ChatOptions(continue_final_message=True))


def test_request_template_beats_engine_default_beats_model(tokenizer: Any) -> None:
    default = "default:" + ROLES
    assert render_chat(tokenizer, HI, ChatOptions(), default).text == "default:user:Hi;"
    own = ChatOptions(chat_template="own:" + ROLES)
    assert render_chat(tokenizer, HI, own, default).text == "own:user:Hi;"
    # Neither: the model's own.
    assert render_chat(tokenizer, HI, ChatOptions()).text.startswith("<|im_start|>system")


def test_chat_template_kwargs_are_template_variables(tokenizer: Any) -> None:
    template = "{{ greeting | default('none') }}/{{ flags.mode }}/" + ROLES
    options = ChatOptions(
        chat_template=template,
        chat_template_kwargs={"greeting": "hey", "flags": {"mode": "terse"}},
    )
    assert render_chat(tokenizer, HI, options).text == "hey/terse/user:Hi;"
    no_kwargs = ChatOptions(chat_template="{{ greeting | default('none') }}")
    assert render_chat(tokenizer, HI, no_kwargs).text == "none"


def test_messages_keep_their_keys_and_content_may_be_none(tokenizer: Any) -> None:
    template = (
        "{% for m in messages %}{{ m.role }}|{{ m.name }}|{{ m.content or '-' }};{% endfor %}"
    )
    conversation = [
        {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": None, "name": "bot"},
    ]
    options = ChatOptions(chat_template=template, add_generation_prompt=False)
    assert render_chat(tokenizer, conversation, options).text == "user|ann|Hi;assistant|bot|-;"
    assert conversation[1] == {"role": "assistant", "content": None, "name": "bot"}  # untouched


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m.content }",  # syntax error
        "{% if %}{% endif %}",  # syntax error
        "{{ raise_exception('no thanks') }}",  # raises while rendering
        "{{ messages[5].content.upper() }}",  # fails while rendering
    ],
)
def test_broken_request_template_blames_chat_template(tokenizer: Any, template: str) -> None:
    with pytest.raises(ValueError, match="^chat_template "):
        render_chat(tokenizer, HI, ChatOptions(chat_template=template))


def test_model_template_rejecting_messages_blames_messages(tokenizer: Any) -> None:
    strict = "{% for m in messages %}{% if m.role == 'robot' %}{{ raise_exception('bad role: robot') }}{% endif %}{% endfor %}ok"
    with pytest.raises(ValueError, match="^messages .*bad role: robot"):
        render_chat(tokenizer, [{"role": "robot", "content": "x"}], ChatOptions(), strict)
    assert render_chat(tokenizer, HI, ChatOptions(), strict).text == "ok"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokenize": True}, "may not set 'tokenize'"),
        ({"messages": []}, "may not set 'messages'"),
        ({"chat_template": "x"}, "may not set 'chat_template'"),
        ({1: "x"}, "keys must be strings"),
        ({"note": "bad \udc80"}, r"^chat_template_kwargs\.note contains a lone surrogate"),
    ],
)
def test_bad_chat_template_kwargs(tokenizer: Any, kwargs: dict[Any, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        render_chat(tokenizer, HI, ChatOptions(chat_template_kwargs=kwargs))
    assert str(info.value).startswith("chat_template_kwargs")


def test_kwargs_that_break_a_template_blame_chat_template_kwargs(tokenizer: Any) -> None:
    template = "{% if limit is defined %}{{ limit + 1 }}{% endif %}" + ROLES
    assert render_chat(tokenizer, HI, ChatOptions(), template).text == "user:Hi;"
    with pytest.raises(ValueError, match="^chat_template_kwargs break the chat template"):
        render_chat(tokenizer, HI, ChatOptions(chat_template_kwargs={"limit": "ten"}), template)


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], r"^messages must be a non-empty list"),
        ("Hi", r"^messages must be a non-empty list"),
        (["Hi"], r"^messages\[0\] must be an object"),
        ([{"content": "Hi"}], r"^messages\[0\]\.role must be a non-empty string"),
        (
            [{"role": "user", "content": 3}],
            r"^messages\[0\]\.content must be a string, a list of parts or null",
        ),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": "x\ud800y"}],
            r"^messages\[1\]\.content contains a lone surrogate",
        ),
        ([{"role": "user", "content": "ok", "name": "\udfff"}], r"^messages\[0\]\.name contains"),
    ],
)
def test_bad_messages(tokenizer: Any, messages: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat(tokenizer, messages, ChatOptions())


def test_surrogate_in_request_template(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="^chat_template contains a lone surrogate"):
        render_chat(tokenizer, HI, ChatOptions(chat_template="{{ 'x' }}\udc80"))


def test_no_template_at_all_blames_messages(tokenizer: Any) -> None:
    bare = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    bare.chat_template = None
    with pytest.raises(ValueError, match="^messages .*no chat template"):
        render_chat(bare, HI, ChatOptions())
    assert render_chat(bare, HI, ChatOptions(chat_template=ROLES)).text == "user:Hi;"


def test_load_chat_template_from_file_or_inline(tmp_path: Path) -> None:
    assert load_chat_template(None) is None
    assert load_chat_template(ROLES) == ROLES
    path = tmp_path / "template.jinja"
    path.write_text(ROLES, encoding="utf-8")
    assert load_chat_template(str(path)) == ROLES
    with pytest.raises(ValueError, match="^chat_template .*neither a readable file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="^chat_template is not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    path.write_text("{% if %}", encoding="utf-8")
    with pytest.raises(ValueError, match="^chat_template is not a valid Jinja template"):
        load_chat_template(str(path))
