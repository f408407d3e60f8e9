"""`pagedserve ui`: run the Chainlit chat app against an OpenAI-compatible server.

Chainlit writes its config (`.chainlit/`), uploaded files (`.files/`) and `chainlit.md` into
its app root and reads `.env` from the working directory, so both point at a folder of the
pagedserve cache, never at the user's working directory or the repository. pagedserve's look
(logo, favicon, avatar, theme, the header's status script) is copied from `ui/public/` into
the app root's `public/` at each start, where Chainlit serves it.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from pagedserve import envs
from pagedserve.server.startup_checks import check_port_free

APP_FILE = Path(__file__).with_name("app.py")
PUBLIC_DIR = Path(__file__).with_name("public")
# Chainlit's click options read these unprefixed variables (CI=true would turn on its CI mode).
_CHAINLIT_OPTION_VARS = ("CI", "DEBUG", "WATCH", "HEADLESS", "NO_CACHE", "RUN_TARGET")
_NO_TELEMETRY = {"DO_NOT_TRACK": "1", "TRACELOOP_TELEMETRY": "false",
                 "ANONYMIZED_TELEMETRY": "false", "HF_HUB_DISABLE_TELEMETRY": "1"}
WELCOME = """# pagedserve chat

Chat with the model served by pagedserve; the header names the model and says whether the
server answers. The settings (temperature, top p, max tokens, system prompt, tools) are behind
the gear icon next to the message box; their initial temperature and top p are the model's own
defaults where it has some. **Regenerate** under the last answer asks again in its place; the
stop button aborts a reply on the server.
"""


def app_root() -> Path:
    """Chainlit's working folder, <cache>/ui, with pagedserve's readme and public files."""
    root = envs.cache_dir() / "ui"
    root.mkdir(parents=True, exist_ok=True)
    readme = root / "chainlit.md"
    # An earlier pagedserve's text is replaced; a readme the user wrote is kept.
    if not readme.exists() or readme.read_text().startswith(WELCOME.split("\n", 1)[0] + "\n"):
        readme.write_text(WELCOME)
    _sync_public(root / "public")
    return root


def _sync_public(dest: Path) -> None:
    """Copy `ui/public/` into `dest`: only files that differ, each replaced atomically (UIs
    starting together share the folder, and a running one may be serving it)."""
    for src in sorted(PUBLIC_DIR.rglob("*")) if PUBLIC_DIR.is_dir() else ():
        target = dest / src.relative_to(PUBLIC_DIR)
        if src.is_dir() or (target.is_file() and target.read_bytes() == src.read_bytes()):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        shutil.copyfile(src, tmp)
        os.replace(tmp, target)


def normalize_base_url(url: str) -> str:
    """'host:port', 'http://host:port' or '.../v1' -> 'http://host:port/v1'."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def ui_command(host: str, port: int) -> list[str]:
    return [sys.executable, "-m", "chainlit", "run", str(APP_FILE), "--headless",
            "--host", host, "--port", str(port)]


def ui_env(base_url: str, api_key: str | None, model: str | None, temperature: float | None,
           base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for the Chainlit process: the UI's settings, telemetry off."""
    env = dict(envs.environment() if base is None else base)
    for var in _CHAINLIT_OPTION_VARS:
        env.pop(var, None)
    env.update(_NO_TELEMETRY)
    root = app_root()
    env["CHAINLIT_APP_ROOT"] = str(root)
    env["CHAINLIT_ENV_FILE"] = str(root / ".env")
    env[envs.UI_BASE_URL] = normalize_base_url(base_url)
    for var, value in ((envs.UI_API_KEY, api_key), (envs.UI_MODEL, model),
                       (envs.UI_TEMPERATURE, None if temperature is None else str(temperature))):
        if value is None:
            env.pop(var, None)
        else:
            env[var] = value
    return env


def run_ui(base_url: str, api_key: str | None, model: str | None, temperature: float | None,
           host: str, port: int) -> int:
    """Replace this process with Chainlit serving the chat app (signals then reach it directly)."""
    check_port_free(host, port, "the chat UI's")
    env = ui_env(base_url, api_key, model, temperature)
    os.chdir(env["CHAINLIT_APP_ROOT"])
    print(f"pagedserve ui: chat UI on http://{host}:{port} -> {env[envs.UI_BASE_URL]}", flush=True)
    cmd = ui_command(host, port)
    os.execve(cmd[0], cmd, env)
    return 0  # not reached
