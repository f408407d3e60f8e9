"""Run a built container image's command in its exported filesystem and ask it one question.

Containers cannot be started on the CI machines (the sandbox refuses the runtime's cgroups),
so this does what a container runtime would, minus isolation: it reads the image's
configuration (user, working folder, environment, entrypoint + command), runs that command with
`chroot` in a private mount namespace (/proc, /dev and /sys mounted inside; the network, hence
loopback, is the host's), appends `--port`/`--ui-port` on free ports, waits for the server,
sends one chat request with the `openai` client, fetches the chat UI's page when the command
starts one, then stops the server with SIGTERM and checks that it exits 0 and leaves no process
behind. Usage (as root; scripts/test_image.sh calls it):

    python scripts/image_check.py ROOTFS IMAGE_CONFIG.json
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 300.0
EXIT_TIMEOUT_S = 60.0
QUESTION = "What is the capital of France? Answer in one sentence."

# Runs as the command's first process; `exec` keeps one pid, so SIGTERM reaches the server.
# $1 rootfs, $2 user, $3 working folder, then `env` assignments and the command.
_LAUNCH = r"""
root=$1; user=$2; workdir=$3; shift 3
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount --rbind -o ro /sys "$root/sys" 2>/dev/null || mount --rbind /sys "$root/sys"
exec chroot --userspec="$user" "$root" /usr/bin/env -i "$@"
"""


@dataclass(frozen=True)
class ImageCommand:
    """What a container runtime would start: the image's user, folder, environment, argv."""

    user: str
    workdir: str
    env: list[str]
    argv: list[str]


def read_config(path: Path) -> ImageCommand:
    """The `Config` of `podman image inspect` as an ImageCommand (user 'name' -> 'name:name')."""
    cfg = json.loads(path.read_text())
    argv = list(cfg.get("Entrypoint") or []) + list(cfg.get("Cmd") or [])
    if not argv:
        raise SystemExit(f"image_check: {path} names no entrypoint or command")
    user = cfg.get("User") or "root"
    if ":" not in user:
        user = f"{user}:{user}"
    return ImageCommand(user=user, workdir=cfg.get("WorkingDir") or "/",
                        env=list(cfg.get("Env") or []), argv=argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def processes_in(root: Path) -> list[int]:
    """Pids of the processes whose root folder is `root` (those started inside the chroot)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.readlink(entry / "root") == str(root):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"image_check: the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"image_check: {url} did not answer within {timeout:.0f} s")


def check(root: Path, image: ImageCommand) -> None:
    from openai import OpenAI

    port, ui_port = free_port(), free_port()
    argv = [*image.argv, "--port", str(port)]
    starts_ui = image.argv[:2] == ["pagedserve", "up"]
    if starts_ui:
        argv += ["--ui-port", str(ui_port)]
    workdir_cmd = ["/bin/sh", "-c", 'cd "$0" && exec "$@"', image.workdir, *argv]
    cmd = ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", _LAUNCH,
           "launch", str(root), image.user, image.workdir, *image.env, *workdir_cmd]
    print(f"image_check: {image.user} runs {' '.join(argv)} in {root}", flush=True)
    proc = subprocess.Popen(cmd)
    try:
        ready_s = wait_ready(f"http://127.0.0.1:{port}/health", proc, READY_TIMEOUT_S)
        print(f"image_check: the server answered /health after {ready_s:.1f} s", flush=True)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        model = client.models.list().data[0].id
        start = time.monotonic()
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": QUESTION}],
            temperature=0, max_tokens=24)
        text = reply.choices[0].message.content or ""
        print(f"image_check: {model} answered {text!r} in {time.monotonic() - start:.1f} s",
              flush=True)
        if "Paris" not in text:
            raise SystemExit(f"image_check: expected an answer naming Paris, got {text!r}")
        if starts_ui:
            ui_s = wait_ready(f"http://127.0.0.1:{ui_port}/", proc, READY_TIMEOUT_S)
            print(f"image_check: the chat UI served its page ({ui_s:.1f} s more)", flush=True)
    finally:
        stopped = time.monotonic()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
            print(f"image_check: no exit {EXIT_TIMEOUT_S:.0f} s after SIGTERM; killed", flush=True)
        left = processes_in(root)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    print(f"image_check: exited with {code} {time.monotonic() - stopped:.1f} s after SIGTERM",
          flush=True)
    if left:
        raise SystemExit(f"image_check: processes left behind after the server exited: {left}")
    if code != 0:
        raise SystemExit(f"image_check: the server exited with {code} after SIGTERM, not 0")


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    if os.geteuid() != 0:
        raise SystemExit("image_check: run as root (chroot and mount need it)")
    root = Path(argv[0]).resolve()
    check(root, read_config(Path(argv[1])))
    print("image_check: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
