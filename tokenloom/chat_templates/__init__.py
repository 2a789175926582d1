"""Chat templates bundled with tokenloom.

``hermes_tools.jinja`` renders tools, assistant tool calls and tool results
in the Hermes (ChatML) format that the ``hermes`` tool-call parser reads. It
is used for requests with tools when the model's own template ignores them
(SmolLM2's does); ``--chat-template`` overrides both.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

HERMES_TOOLS = "hermes_tools.jinja"

# A template that mentions ``tools`` as a variable renders them itself.
_USES_TOOLS = re.compile(r"\btools\b")


@cache
def load_bundled_template(name: str = HERMES_TOOLS) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template does anything with the ``tools`` variable."""
    return bool(template) and _USES_TOOLS.search(template or "") is not None
