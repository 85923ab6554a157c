"""Chat templates shipped with Tandem, and the ``--chat-template`` setting's loader.

``hermes.jinja``: Hermes-style tool calling for ChatML models (the bundled SmolLM2's own
template has no tool section). A chat whose request offers tools, or whose messages hold tool
calls or tool results, renders with it when the model's own template has no place for tools
(router.tokenizer.renders_tools) and ``--chat-template`` names no other template.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

BUNDLED = ("hermes",)
TOOL_TEMPLATE = "hermes"  # renders the chats that involve tools when no template is configured


@functools.lru_cache(maxsize=None)
def bundled_template(name: str) -> str:
    """The text of bundled template ``name`` (one of :data:`BUNDLED`).

    Raises:
        ValueError: no such bundled template.
    """
    if name not in BUNDLED:
        raise ValueError(f"no bundled chat template {name!r}; bundled: {', '.join(BUNDLED)}")
    return resources.files(__package__).joinpath(f"{name}.jinja").read_text(encoding="utf-8")


def load_chat_template(value: str) -> str | None:
    """The template ``--chat-template`` names: a bundled name, a file's path, or empty (None:
    the model's own template, and :data:`TOOL_TEMPLATE` for chats with tools it cannot render).

    Raises:
        FileNotFoundError: ``value`` is neither a bundled name nor a readable file.
    """
    if not value:
        return None
    if value in BUNDLED:
        return bundled_template(value)
    path = Path(value).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--chat-template {value!r} is neither a bundled template "
                                f"({', '.join(BUNDLED)}) nor a file")
    return path.read_text(encoding="utf-8")
