"""Which tool-call parser reads what a chat template asks its model to write (torch-free)."""

from __future__ import annotations

# (a marker in the template, the parser), first match wins: SmolLM2's array in <tool_call>
# tags before Hermes' object in them
_MARKERS = (
    ("<tool_call>[", "smollm2"),
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("<|tool_call|>", "phi4_mini_json"),
    ("functools[", "phi4_mini_json"),
)


def parser_for_template(template: str | None) -> str | None:
    """The name (in TOOL_PARSERS) of the parser for the tool calls `template` renders and asks
    for, or None when it has no tool-call format pagedserve knows."""
    if not template:
        return None
    for marker, name in _MARKERS:
        if marker in template:
            return name
    # Llama 3.1-3.3: bare {"name": ..., "parameters": ...} calls, asked for in its header format
    if "<|start_header_id|>" in template and '"parameters": ' in template:
        return "llama3_json"
    return None
