"""Child processes that pagedserve starts and supervises (`pagedserve up`, `bench serve --launch`):
each in its own session with its output in a log file, stopped together with whatever it forked,
and killed by the kernel if this process dies first (`lifeline`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedserve.lifeline import preexec_die_with_parent


@dataclass
class Child:
    """One child process whose output goes to a log file."""

    name: str
    cmd: list[str]
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=preexec_die_with_parent())

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM); `stop` then waits."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, wait, SIGKILL; then end whatever it left in its process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # Leftovers (an engine core whose server was killed): its group outlives the leader.
        if _signal_group(self.proc.pid, signal.SIGTERM):
            deadline = time.monotonic() + 5
            while _signal_group(self.proc.pid, 0) and time.monotonic() < deadline:
                time.sleep(0.1)
            _signal_group(self.proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the process group; False when the group no longer exists."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def http_ok(url: str) -> bool:
    """True when `url` answers 200 (any connection error: False)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False
