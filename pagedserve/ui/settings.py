"""What the chat UI's settings panel controls, its initial values and its checks (no Chainlit).

The initial temperature is the user's `--temperature`, else the model's own default (the
`sampling_defaults` a pagedserve server lists with each model in /v1/models, taken from the
model's generation_config.json), else the server's own default for a request that leaves it
out (1.0, OpenAI's); the initial top p is the model's default, else 1. So the panel starts
where an API request without these fields would.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

TOOL_CHOICES = ("auto", "required", "none")
TEMPERATURE_RANGE = (0.0, 2.0)  # the panel's slider
TOP_P_RANGE = (0.05, 1.0)
MAX_TOKENS_CAP = 1_000_000  # a sanity bound when the server does not say its context length
# Shown to the user in this order; other numeric entries follow, sorted.
_DEFAULTS_ORDER = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationSettings:
    """What the settings panel controls."""

    temperature: float = 1.0  # SamplingParams' default: what the server uses when a model has none
    top_p: float = 1.0
    max_tokens: int = 512
    system_prompt: str = ""
    tools: list[dict] | None = None  # an OpenAI `tools` list; None: the request sends no tools
    tool_choice: str = "auto"  # sent only with tools

    @classmethod
    def initial(cls, temperature: float | None, model_defaults: dict) -> GenerationSettings:
        """The panel's initial values: `temperature` (the user's flag) if given, else the model's
        defaults where they fit the panel's sliders, else this class's defaults."""
        def fit(key: str, bounds: tuple[float, float], fallback: float) -> float:
            v = model_defaults.get(key)
            return float(v) if v is not None and bounds[0] <= v <= bounds[1] else fallback

        return cls(temperature=temperature if temperature is not None
                   else fit("temperature", TEMPERATURE_RANGE, cls.temperature),
                   top_p=fit("top_p", TOP_P_RANGE, cls.top_p))

    @classmethod
    def from_dict(cls, values: dict | None, default: GenerationSettings,
                  max_tokens_limit: int | None = None) -> GenerationSettings:
        """Settings from the panel's {id: value} dict; missing or empty entries keep `default`.

        Raises ValueError, with one line for the user, when max tokens is not a whole number
        from 1 to `max_tokens_limit` (the model's context, when known), or when the tools JSON
        or the tool choice is invalid.
        """
        v = values or {}

        def pick(key, cast):
            x = v.get(key)
            return getattr(default, key) if x is None or x == "" else cast(x)

        tool_choice = pick("tool_choice", str)
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"Tool choice must be one of {', '.join(TOOL_CHOICES)}, "
                             f"not {tool_choice!r}.")
        return cls(temperature=pick("temperature", float), top_p=pick("top_p", float),
                   max_tokens=pick("max_tokens", lambda x: parse_max_tokens(x, max_tokens_limit)),
                   system_prompt=pick("system_prompt", str).strip(),
                   tools=pick("tools", parse_tools), tool_choice=tool_choice)


def parse_max_tokens(value: object, limit: int | None = None) -> int:
    """The panel's "Max tokens" field (a number, or the text the browser sends): a whole number
    from 1 to `limit`. Raises ValueError with one line for the user otherwise."""
    top = limit or MAX_TOKENS_CAP
    what = f"a whole number from 1 to {top}" + (" (the model's context length)" if limit else "")
    try:
        n = float(str(value).strip()) if not isinstance(value, bool) else math.nan
    except ValueError:
        n = math.nan
    if not (math.isfinite(n) and n.is_integer() and 1 <= n <= top):
        raise ValueError(f"Max tokens must be {what}, not {str(value).strip()!r}.")
    return int(n)


def parse_sampling_defaults(raw: object) -> dict[str, float]:
    """A /v1/models entry's `sampling_defaults` (absent on older servers): its numeric entries,
    anything else dropped."""
    if not isinstance(raw, dict):
        return {}
    return {str(k): v for k, v in raw.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def describe_defaults(defaults: dict[str, float]) -> str:
    """'model defaults: temperature 0.7, top_p 0.8', or '' when the model has none."""
    keys = [k for k in _DEFAULTS_ORDER if k in defaults]
    keys += sorted(k for k in defaults if k not in _DEFAULTS_ORDER)
    return "model defaults: " + ", ".join(f"{k} {defaults[k]:g}" for k in keys) if keys else ""


def parse_tools(text: str) -> list[dict] | None:
    """The settings panel's "Tools (JSON)": an OpenAI `tools` list, or None when blank or `[]`.

    Raises ValueError with one line for the user when it is not JSON or not a list of tools.
    """
    if not text.strip():
        return None
    try:
        tools = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"Tools (JSON) is not valid JSON: {e.msg} at line {e.lineno}, "
                         f"column {e.colno}.") from None
    example = '[{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]'
    if not isinstance(tools, list):
        raise ValueError(f"Tools (JSON) must be a JSON list of tools, like {example}; "
                         f"got a JSON {type(tools).__name__}.")
    for i, tool in enumerate(tools, 1):
        if not isinstance(tool, dict):
            raise ValueError(f"Tools (JSON): tool {i} is not a JSON object; write a list of "
                             f"tools like {example}.")
        function = tool.get("function")
        if tool.get("type", "function") == "function" and not (
                isinstance(function, dict) and isinstance(function.get("name"), str)
                and function["name"]):
            raise ValueError(f"Tools (JSON): tool {i} has no function name; write a list of "
                             f"tools like {example}.")
    return tools or None
