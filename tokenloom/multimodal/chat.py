"""Images in chat messages: content parts out, images loaded, placeholders in their place.

A message's ``content`` may be a list of parts: ``{"type": "text", "text"}``,
OpenAI's ``{"type": "image_url", "image_url": {"url"}}``, or, offline, vLLM's
``{"type": "image_pil", "image_pil": PIL.Image}``. ``extract_images`` loads
each image (errors name the part, ``messages[i].content[j].image_url``) and
leaves ``{"type": "image"}`` where it was, which a vision-language chat
template turns into the model's image placeholder; ``inline_placeholders``
writes the placeholder text into the message instead, for templates that
only take text. Messages without images keep (or get) plain string content.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PIL import Image

from tokenloom.multimodal.media import MediaLimits, decode_image, is_remote, load_image

_IMAGE_PARTS = ("image_url", "image_pil")


def remote_image_urls(messages: object) -> list[tuple[str, str]]:
    """(param, URL) of every http(s) image in ``messages``, to fetch before rendering."""
    found = []
    for param, part in _parts(messages):
        if part.get("type") == "image_url":
            url = _url_of(part.get("image_url"))
            if isinstance(url, str) and is_remote(url):
                found.append((f"{param}.image_url", url))
    return found


def has_images(messages: object) -> bool:
    return any(part.get("type") in _IMAGE_PARTS for _, part in _parts(messages))


def extract_images(
    messages: list[Any], limits: MediaLimits, fetched: Mapping[str, bytes] | None = None
) -> tuple[list[Any], list[Image.Image]]:
    """(messages with image parts as ``{"type": "image"}``, the images in order).

    ``fetched`` holds bytes already fetched for http(s) URLs (by the async front
    end); any other remote URL is fetched here, blocking.
    """
    images: list[Image.Image] = []
    out: list[Any] = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts: list[dict[str, Any]] = []
        for j, part in enumerate(content):
            param = f"messages[{i}].content[{j}]"
            if not isinstance(part, Mapping):
                raise ValueError(f"{param} must be an object with a type")
            kind = part.get("type")
            if kind == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise ValueError(f"{param}.text must be a string")
                parts.append({"type": "text", "text": text})
            elif kind == "image_url":
                url = _url_of(part.get("image_url"))
                if not isinstance(url, str) or not url:
                    raise ValueError(f"{param}.image_url must be an object with a url")
                if fetched is not None and url in fetched:
                    image = decode_image(fetched[url], f"{param}.image_url", limits)
                else:
                    image = load_image(url, f"{param}.image_url", limits)
                images.append(image)
                parts.append({"type": "image"})
            elif kind == "image_pil":
                images.append(load_image(part.get("image_pil"), f"{param}.image_pil", limits))
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"{param}.type: unsupported content part {kind!r} "
                    "(supported: text, image_url, image_pil)"
                )
        copy = dict(message)
        if any(part["type"] == "image" for part in parts):
            copy["content"] = parts
        else:
            copy["content"] = "".join(part["text"] for part in parts)
        out.append(copy)
    return out, images


def inline_placeholders(messages: list[Any], placeholder: str) -> list[Any]:
    """The messages with string content: each image part becomes ``placeholder``."""
    out = []
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            text = "".join(
                placeholder if part["type"] == "image" else part["text"] for part in content
            )
            message = {**message, "content": text}
        out.append(message)
    return out


def _parts(messages: object) -> list[tuple[str, Mapping[str, Any]]]:
    found: list[tuple[str, Mapping[str, Any]]] = []
    if not isinstance(messages, list):
        return found
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, Mapping):
                    found.append((f"messages[{i}].content[{j}]", part))
    return found


def _url_of(value: object) -> object:
    return value.get("url") if isinstance(value, Mapping) else value
