"""The Chainlit chat app: thin glue between Chainlit's events and `ui/chat.py`.

Run it with `pagedserve ui` (or `pagedserve up`), which sets PAGEDSERVE_UI_BASE_URL,
PAGEDSERVE_UI_API_KEY, PAGEDSERVE_UI_MODEL and PAGEDSERVE_UI_TEMPERATURE and keeps
Chainlit's files in the cache folder.
"""

from __future__ import annotations

import contextlib
import json

import chainlit as cl
from chainlit.config import config as chainlit_config
from chainlit.input_widget import Select, Slider, TextInput
from chainlit.logger import logger

from pagedserve.ui.chat import (
    TOOL_CHOICES,
    ChatSession,
    Delta,
    GenerationSettings,
    ToolCallView,
    UIConfig,
)

STARTERS = [
    ("Capital of France", "What is the capital of France?"),
    ("A haiku", "Write a haiku about the sea."),
    ("Explain a KV cache", "Explain in two sentences what the KV cache of a language model is."),
    ("Python tips", "Give me three short tips for writing clean Python code."),
]

chainlit_config.ui.name = "pagedserve"
chainlit_config.features.spontaneous_file_upload.enabled = False  # replies are text only


def _defaults(config: UIConfig) -> GenerationSettings:
    return GenerationSettings(temperature=config.temperature)


def _settings_panel(d: GenerationSettings) -> cl.ChatSettings:
    return cl.ChatSettings([
        Slider(id="temperature", label="Temperature", initial=d.temperature, min=0, max=2, step=0.05,
               description="0 = greedy (deterministic)"),
        Slider(id="top_p", label="Top p", initial=d.top_p, min=0.05, max=1, step=0.05),
        Slider(id="max_tokens", label="Max tokens", initial=d.max_tokens, min=16, max=4096, step=16),
        TextInput(id="system_prompt", label="System prompt", initial=d.system_prompt,
                  placeholder="(the model's default)", multiline=True),
        TextInput(id="tools", label="Tools (JSON)",
                  initial=json.dumps(d.tools, indent=2) if d.tools else "", multiline=True,
                  placeholder='[{"type": "function", "function": {"name": "get_weather", '
                              '"parameters": {...}}}]',
                  description="An OpenAI tools list; the model's tool calls show as steps "
                              "(the UI does not run them)."),
        Select(id="tool_choice", label="Tool choice", values=list(TOOL_CHOICES),
               initial_value=d.tool_choice, description="Sent only with tools."),
    ])


async def _tool_call_step(call: ToolCallView) -> None:
    """A collapsible step showing one tool call: its arguments, as pretty JSON when they parse."""
    try:
        text, language = json.dumps(json.loads(call.arguments), indent=2, ensure_ascii=False), "json"
    except ValueError:
        text, language = call.arguments, "text"
    async with cl.Step(name=f"🔧 {call.name or '(unnamed tool)'}", type="tool",
                       show_input=language, default_open=True) as step:
        step.input = text


@cl.set_chat_profiles
async def chat_profiles(user=None, language=None) -> list[cl.ChatProfile]:
    """One profile, the served model: its name heads the page, the server status sits on the
    welcome screen above the starter prompts (a chat message would hide the starters)."""
    chat = ChatSession.create(UIConfig.from_env())
    try:
        status = await chat.probe()
    finally:
        await chat.client.close()
    return [cl.ChatProfile(name=status.model or "pagedserve", default=True, icon="/favicon",
                           markdown_description=status.message,
                           starters=[cl.Starter(label=label, message=message)
                                     for label, message in STARTERS])]


@cl.on_chat_start
async def on_chat_start() -> None:
    config = UIConfig.from_env()
    chat = ChatSession.create(config)
    cl.user_session.set("chat", chat)
    await _settings_panel(_defaults(config)).send()
    status = await chat.probe()
    if not status.ok:
        logger.warning("chat start: %s", status.message)
        await cl.ErrorMessage(content=status.message, author="pagedserve").send()


@cl.on_message
async def on_message(message: cl.Message) -> None:
    chat: ChatSession = cl.user_session.get("chat")
    try:
        settings = GenerationSettings.from_dict(cl.user_session.get("chat_settings"),
                                                _defaults(chat.config))
    except ValueError as e:  # bad tools JSON: say so, send nothing
        await cl.ErrorMessage(content=str(e), author="pagedserve").send()
        return
    answer = cl.Message(content="")
    async with contextlib.AsyncExitStack() as thinking:
        step: list[cl.Step] = []

        async def on_delta(d: Delta) -> None:
            if d.kind == "reasoning":
                if not step:  # a collapsible step above the answer, open while it streams
                    step.append(await thinking.enter_async_context(
                        cl.Step(name="Thinking", type="llm", show_input=False, default_open=True)))
                await step[0].stream_token(d.text)
            else:
                if step:
                    await thinking.aclose()  # the reasoning is over: close its step
                if d.kind == "content":
                    await answer.stream_token(d.text)

        result = await chat.turn(message.content, settings, on_delta)
    if result.error:
        logger.warning("chat turn failed: %s", result.error)
        await cl.ErrorMessage(content=result.error, author="pagedserve").send()
        if answer.content:
            await answer.send()
        return
    for call in result.tool_calls:
        await _tool_call_step(call)
    if not answer.content:
        n = len(result.tool_calls)
        answer.content = (f"(the model called {n} tool{'s' if n > 1 else ''})" if n
                          else "(the model returned no text)")
    await answer.send()


@cl.on_settings_update
async def on_settings_update(_changed: dict) -> None:
    """Check the panel's tools JSON as soon as it is saved (each message checks it again)."""
    chat: ChatSession | None = cl.user_session.get("chat")
    if chat is None:
        return
    try:
        GenerationSettings.from_dict(cl.user_session.get("chat_settings"), _defaults(chat.config))
    except ValueError as e:
        await cl.ErrorMessage(content=str(e), author="pagedserve").send()


@cl.on_stop
async def on_stop() -> None:
    """The stop button: close the HTTP stream so the server aborts the request at once."""
    chat: ChatSession | None = cl.user_session.get("chat")
    if chat is not None:
        await chat.stop()


@cl.on_chat_end
async def on_chat_end() -> None:
    chat: ChatSession | None = cl.user_session.get("chat")
    if chat is not None:
        await chat.stop()
        await chat.client.close()
