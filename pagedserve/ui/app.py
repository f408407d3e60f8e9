"""The Chainlit chat app: thin glue between Chainlit's events and `ui/chat.py`.

Run it with `pagedserve ui` (or `pagedserve up`), which sets PAGEDSERVE_UI_BASE_URL,
PAGEDSERVE_UI_API_KEY, PAGEDSERVE_UI_MODEL and PAGEDSERVE_UI_TEMPERATURE and keeps
Chainlit's files in the cache folder, with pagedserve's public files (`ui/public/`: logo,
favicon (also the assistant's avatar), theme, and the header's status script).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable

import chainlit as cl
from chainlit.config import config as chainlit_config
from chainlit.context import context
from chainlit.input_widget import NumberInput, Select, Slider, TextInput
from chainlit.logger import logger

from pagedserve.ui.chat import ChatSession, Delta, ServerStatus, ToolCallView, TurnResult, UIConfig
from pagedserve.ui.settings import (
    TEMPERATURE_RANGE,
    TOOL_CHOICES,
    TOP_P_RANGE,
    GenerationSettings,
    describe_defaults,
)

STARTERS = [
    ("Capital of France", "What is the capital of France?"),
    ("A haiku", "Write a haiku about the sea."),
    ("Explain a KV cache", "Explain in two sentences what the KV cache of a language model is."),
    ("Python tips", "Give me three short tips for writing clean Python code."),
]
REGENERATE = "regenerate"

chainlit_config.ui.name = "pagedserve"  # the tab's title, and the assistant's name
chainlit_config.ui.description = "Chat with a model served by pagedserve"
chainlit_config.ui.custom_css = "/public/pagedserve.css"
chainlit_config.ui.custom_js = "/public/pagedserve.js"  # the header's name, logo and status
chainlit_config.ui.custom_meta_image_url = "/public/logo_light.svg"
chainlit_config.features.spontaneous_file_upload.enabled = False  # replies are text only


def _defaults(chat: ChatSession) -> GenerationSettings:
    """The panel's initial values: --temperature, else the model's defaults, else ours."""
    status = chat.status
    return GenerationSettings.initial(chat.config.temperature,
                                      status.sampling_defaults if status else {})


def _settings(chat: ChatSession) -> GenerationSettings:
    """The panel's values (raises ValueError, one line for the user, when one is invalid)."""
    limit = chat.status.max_model_len if chat.status and chat.status.ok else None
    return GenerationSettings.from_dict(cl.user_session.get("chat_settings"), _defaults(chat),
                                        max_tokens_limit=limit)


def _settings_panel(chat: ChatSession) -> cl.ChatSettings:
    d, status = _defaults(chat), chat.status
    model = status.sampling_defaults if status else {}
    ctx = status.max_model_len if status and status.ok else None

    def model_default(key: str) -> str:
        return f"The model's default: {model[key]:g}." if key in model else ""

    return cl.ChatSettings([
        Slider(id="temperature", label="Temperature", initial=d.temperature,
               min=TEMPERATURE_RANGE[0], max=TEMPERATURE_RANGE[1], step=0.05,
               description=f"0 = greedy (deterministic). {model_default('temperature')}".strip()),
        Slider(id="top_p", label="Top p", initial=d.top_p, min=TOP_P_RANGE[0], max=TOP_P_RANGE[1],
               step=0.05, description=model_default("top_p") or None),
        NumberInput(id="max_tokens", label="Max tokens", initial=d.max_tokens,
                    placeholder=str(GenerationSettings.max_tokens),
                    description="The most tokens an answer may have: a whole number from 1 to "
                                + (f"{ctx} (the model's context)." if ctx else "its context.")),
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


async def _show_status(status: ServerStatus) -> None:
    """Put the server's status in the page's header (public/pagedserve.js draws it)."""
    await cl.send_window_message({"pagedserve_status": {
        "ok": status.ok, "headline": status.headline,
        "details": status.details().replace("**", "")}})


async def _tool_call_step(call: ToolCallView) -> cl.Step:
    """A collapsible step showing one tool call: its arguments, as pretty JSON when they parse."""
    try:
        text, language = json.dumps(json.loads(call.arguments), indent=2, ensure_ascii=False), "json"
    except ValueError:
        text, language = call.arguments, "text"
    async with cl.Step(name=f"🔧 {call.name or '(unnamed tool)'}", type="tool",
                       show_input=language, default_open=True) as step:
        step.input = text
    return step


@cl.set_chat_profiles
async def chat_profiles(user=None, language=None) -> list[cl.ChatProfile]:
    """One profile, the served model: the welcome screen shows pagedserve's logo, the server's
    status and the model's defaults above the starter prompts (a chat message would hide the
    starters); the page's header keeps the model and status in view afterwards."""
    chat = ChatSession.create(UIConfig.from_env())
    try:
        status = await chat.probe()
    finally:
        await chat.client.close()
    return [cl.ChatProfile(name=status.model or "pagedserve", default=True, icon="/favicon",
                           markdown_description=status.details(),
                           starters=[cl.Starter(label=label, message=message)
                                     for label, message in STARTERS])]


@cl.on_chat_start
async def on_chat_start() -> None:
    chat = ChatSession.create(UIConfig.from_env())
    cl.user_session.set("chat", chat)
    status = await chat.probe()
    await _show_status(status)
    await _settings_panel(chat).send()
    if status.ok:
        logger.info("chat start: %s %s", status.message, describe_defaults(status.sampling_defaults))
    else:
        logger.warning("chat start: %s", status.message)
        await cl.ErrorMessage(content=status.message, author="pagedserve").send()


async def _settings_or_error(chat: ChatSession) -> GenerationSettings | None:
    try:
        return _settings(chat)
    except ValueError as e:  # bad max tokens or tools JSON: say so, send nothing
        await cl.ErrorMessage(content=str(e), author="pagedserve").send()
        return None


async def _answer(chat: ChatSession,
                  run: Callable[[Callable[[Delta], Awaitable[None]]], Awaitable[TurnResult]],
                  replaces: list | None = None) -> None:
    """Stream one reply (`run(on_delta)`) into a "Thinking" step, tool-call steps and the
    answer, which gets the Regenerate button. The messages and steps of the turn it
    `replaces` are removed once the new reply has arrived (or was stopped)."""
    answer = cl.Message(content="")
    parts: list[cl.Message | cl.Step] = []
    async with contextlib.AsyncExitStack() as thinking:
        step: list[cl.Step] = []

        async def on_delta(d: Delta) -> None:
            if d.kind == "reasoning":
                if not step:  # a collapsible step above the answer, open while it streams
                    step.append(await thinking.enter_async_context(
                        cl.Step(name="Thinking", type="llm", show_input=False, default_open=True)))
                    parts.append(step[0])
                await step[0].stream_token(d.text)
            else:
                if step:
                    await thinking.aclose()  # the reasoning is over: close its step
                if d.kind == "content":
                    await answer.stream_token(d.text)

        result = await run(on_delta)
    if result.error or not (chat.status and chat.status.ok):
        await _show_status(await chat.probe())  # the server may be down, or back
    if result.error:
        logger.warning("chat turn failed: %s", result.error)
        await cl.ErrorMessage(content=result.error, author="pagedserve").send()
        if answer.content:
            await answer.send()
        return
    for call in result.tool_calls:
        parts.append(await _tool_call_step(call))
    if not answer.content:
        n = len(result.tool_calls)
        answer.content = (f"(the model called {n} tool{'s' if n > 1 else ''})" if n
                          else "(the model returned no text)")
    answer.actions = [cl.Action(name=REGENERATE, payload={}, label="Regenerate",
                                icon="refresh-cw", tooltip="Ask again, in place of this answer")]
    await answer.send()
    for old in replaces or ():
        if isinstance(old, cl.Message):
            await old.remove_actions()
        await old.remove()
    cl.user_session.set("last_turn", [*parts, answer])


async def _retire_last_turn() -> None:
    """A new question: the last answer loses its Regenerate button."""
    last: list = cl.user_session.get("last_turn") or []
    cl.user_session.set("last_turn", [])
    if last:
        await last[-1].remove_actions()


@cl.on_message
async def on_message(message: cl.Message) -> None:
    chat: ChatSession = cl.user_session.get("chat")
    settings = await _settings_or_error(chat)
    if settings is None:
        return
    await _retire_last_turn()
    await _answer(chat, lambda on_delta: chat.turn(message.content, settings, on_delta))


@cl.action_callback(REGENERATE)
async def on_regenerate(action: cl.Action) -> None:
    """The last answer's Regenerate button: send its question again and put the new answer
    in its place (history included). Shown as a running task, so the stop button works."""
    chat: ChatSession | None = cl.user_session.get("chat")
    last: list = cl.user_session.get("last_turn") or []
    if chat is None or not last or last[-1].id != action.forId:
        await cl.ErrorMessage(content="Only the last answer can be regenerated.",
                              author="pagedserve").send()
        return
    settings = await _settings_or_error(chat)
    if settings is None:
        return
    await context.emitter.task_start()  # (a failed regeneration leaves the last turn as it was)
    try:
        await _answer(chat, lambda on_delta: chat.regenerate(settings, on_delta), replaces=last)
    finally:
        await context.emitter.task_end()


@cl.on_settings_update
async def on_settings_update(_changed: dict) -> None:
    """Check the panel's values as soon as they are saved (each message checks them again)."""
    chat: ChatSession | None = cl.user_session.get("chat")
    if chat is not None:
        await _settings_or_error(chat)


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
