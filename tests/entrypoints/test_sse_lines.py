"""A streamed event stays one line for clients that split lines as str.splitlines
does (httpx's aiter_lines): generated text may hold U+0085, U+2028 or U+2029."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder

from tokenloom.entrypoints.openai.serving_base import sse


def test_line_breaking_characters_are_escaped_and_decode_back() -> None:
    text = 'a\x85b\u2028c\u2029d é\n"e"'
    event = sse({"choices": [{"text": text}]})
    lines = [line for line in LineDecoder().decode(event) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][6:])["choices"][0]["text"] == text
    assert "é" in event  # other non-ASCII text is sent as it is
