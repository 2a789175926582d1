"""Chat templating, written once for every entry point.

The server (through ``EngineClient.render_chat``), ``LLM.chat`` and the CLI all
render conversations with ``render_chat``; ``load_chat_template`` reads the
engine's default template (``--chat-template``: a file or the template itself).

The template is the request's ``chat_template`` if it has one, else the
engine's default, else the tokenizer's own. Every failure is a ``ValueError``
whose message starts with the field to blame, so the server can answer 400
naming it:

- ``messages``: not a list of role/content messages, a lone surrogate in them,
  the model has no template, or the (model's or engine's) template rejects them;
- ``chat_template``: the request's template is broken or fails to render;
- ``chat_template_kwargs``: not a dict of names, a reserved name, or values
  without which the template renders;
- ``add_generation_prompt`` / ``continue_final_message``: not bools, or both set.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenloom.chat_templates import load_bundled_template, template_renders_tools
from tokenloom.engine.protocol import ChatOptions, RenderedChat

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# vLLM's rule for --chat-template: text with one of these is a template, not a path.
_TEMPLATE_CHARS = "{}\n"


def load_chat_template(value: str | None) -> str | None:
    """The template named by ``--chat-template``: a file's text, or ``value`` itself.

    Raises ``ValueError`` starting with ``chat_template`` when the file cannot be
    read or the template does not compile, so a bad flag fails at start-up.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"chat_template must be a file path or a Jinja template, got {value!r}")
    if any(c in value for c in _TEMPLATE_CHARS):
        template = value
    else:
        try:
            template = Path(value).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"chat_template {value!r} is neither a readable file nor a Jinja template: {exc}"
            ) from None
    _check_syntax(template)
    return template


def _check_syntax(template: str) -> None:
    try:
        # The same (cached) compiler apply_chat_template uses, with its extensions.
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without it: errors show at render time instead
        return
    try:
        _compile_jinja_template(template)
    except Exception as exc:
        raise ValueError(f"chat_template is not a valid Jinja template: {exc}") from None


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: object,
    options: ChatOptions,
    default_template: str | None = None,
) -> RenderedChat:
    """Apply the chat template to one conversation and tokenize the text as is.

    Tokenizing without special tokens keeps a BOS the template already wrote
    from being doubled. ``messages`` keep every key they have (content may be
    None or missing, for tool calls); they are not modified.
    """
    _check_options(options)
    conversation = _check_messages(messages)
    template = options.chat_template or default_template
    if options.tools and template is None and not template_renders_tools(tokenizer.chat_template):
        # The model's template would drop the tools: render them the Hermes way.
        template = load_bundled_template()
    if template is None and not tokenizer.chat_template:
        raise ValueError(
            "messages cannot be rendered: this model has no chat template "
            "(give one with --chat-template or the request's chat_template)"
        )
    kwargs = dict(options.chat_template_kwargs or {})
    try:
        text = _apply(tokenizer, conversation, template, options, kwargs)
    except Exception as exc:
        raise _blame(exc, tokenizer, conversation, template, options) from None
    if not is_utf8(text):
        field = "chat_template" if options.chat_template else "messages"
        raise ValueError(f"{field} rendered to text with a lone surrogate (not valid UTF-8)")
    return RenderedChat(text, list(tokenizer.encode(text, add_special_tokens=False)))


def _apply(
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    template: str | None,
    options: ChatOptions,
    kwargs: dict[str, Any],
) -> str:
    text = tokenizer.apply_chat_template(
        conversation,
        chat_template=template,
        add_generation_prompt=options.add_generation_prompt,
        continue_final_message=options.continue_final_message,
        tools=list(options.tools) if options.tools else None,
        tokenize=False,
        **kwargs,
    )
    if not isinstance(text, str):
        raise TypeError(f"the chat template produced {type(text).__name__}, not text")
    return text


def _blame(
    exc: Exception,
    tokenizer: PreTrainedTokenizerBase,
    conversation: list[dict[str, Any]],
    template: str | None,
    options: ChatOptions,
) -> ValueError:
    """Which field made rendering fail: kwargs if it renders without them, then the
    request's template, else the messages (the model's own template is trusted)."""
    reason = _describe(exc)
    if options.chat_template_kwargs:
        try:
            _apply(tokenizer, conversation, template, options, {})
        except Exception:
            pass
        else:
            return ValueError(f"chat_template_kwargs break the chat template: {reason}")
    if options.chat_template:
        from jinja2 import TemplateSyntaxError

        if isinstance(exc, TemplateSyntaxError):
            return ValueError(f"chat_template is not a valid Jinja template: {reason}")
        return ValueError(f"chat_template cannot be rendered: {reason}")
    return ValueError(f"messages are rejected by the chat template: {reason}")


def _describe(exc: Exception) -> str:
    from jinja2 import TemplateError

    # raise_exception() in a template says what is wrong in its own words.
    return str(exc) if isinstance(exc, TemplateError) else f"{type(exc).__name__}: {exc}"


def _check_options(options: ChatOptions) -> None:
    for name in ("add_generation_prompt", "continue_final_message"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(options, name)!r}")
    if options.add_generation_prompt and options.continue_final_message:
        raise ValueError(
            "continue_final_message cannot be combined with add_generation_prompt: "
            "set add_generation_prompt to false to continue the final message"
        )
    template = options.chat_template
    if template is not None:
        if not isinstance(template, str) or not template.strip():
            raise ValueError(f"chat_template must be a non-empty Jinja template, got {template!r}")
        if not is_utf8(template):
            raise ValueError(f"chat_template {_SURROGATE}")
    kwargs = options.chat_template_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"chat_template_kwargs must be an object, got {type(kwargs).__name__}")
    reserved = _reserved_names()
    for name in kwargs:
        if not isinstance(name, str):
            raise ValueError(f"chat_template_kwargs keys must be strings, got {name!r}")
        if name in reserved:
            raise ValueError(
                f"chat_template_kwargs may not set {name!r}: it is a rendering argument, "
                "not a template variable"
            )
    where = _surrogate_path(kwargs)
    if where is not None:
        raise ValueError(f"chat_template_kwargs{where} {_SURROGATE}")


@functools.cache
def _reserved_names() -> frozenset[str]:
    """apply_chat_template's own arguments (and ``messages``), which kwargs must not shadow."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    named = {
        name
        for name, p in params.items()
        if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and name != "self"
    }
    return frozenset(named | {"messages"})


def _check_messages(messages: object) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"messages[{i}] must be an object with a role, got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        content = message.get("content")
        if isinstance(content, list):  # text and image parts (multimodal.chat)
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, Mapping) else None
                if kind not in ("text", "image"):
                    raise ValueError(
                        f"messages[{i}].content[{j}] must be a text or image part, got {part!r}"
                    )
        elif content is not None and not isinstance(content, str):
            raise ValueError(
                f"messages[{i}].content must be a string, a list of parts or null, "
                f"got {type(content).__name__}"
            )
        where = _surrogate_path(message)
        if where is not None:
            raise ValueError(f"messages[{i}]{where} {_SURROGATE}")
    return messages


_SURROGATE = "contains a lone surrogate (U+D800-U+DFFF), which cannot be encoded as UTF-8"


def is_utf8(text: str) -> bool:
    """False when ``text`` holds lone surrogates (as JSON ``\\ud800`` escapes can produce)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_path(value: object) -> str | None:
    """Where in a JSON-like value a string with a lone surrogate is (``.a[2]``), or None."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if not is_utf8(item):
                return path
        elif isinstance(item, Mapping):
            for key, child in item.items():
                if isinstance(key, str) and not is_utf8(key):
                    return f"{path} (a key)"
                stack.append((f"{path}.{key}", child))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}[{i}]", child) for i, child in enumerate(item))
    return None
