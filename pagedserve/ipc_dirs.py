"""The temporary folders that hold the engine core's ZeroMQ sockets.

Each is named after the process that made it (`pagedserve-<pid>-*`; a tensor-parallel core's
rendezvous folder `pagedserve-tp-<pid>-*`) and removed by it when it ends normally. A process
killed with SIGKILL cannot remove its folder, so each server start removes the folders of
processes that no longer exist: only folders of this naming, owned by this user, whose pid is
gone (a pid still in use, even by another program, keeps its folder).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile

logger = logging.getLogger("pagedserve")

_NAME = re.compile(r"pagedserve-(?:tp-)?(\d+)-")


def new_ipc_dir(kind: str = "") -> str:
    """A fresh private folder named after this process (`kind`: "tp-" for the TP ranks')."""
    return tempfile.mkdtemp(prefix=f"pagedserve-{kind}{os.getpid()}-")


def remove_stale_ipc_dirs(parent: str | None = None) -> list[str]:
    """Remove the IPC folders under `parent` (the temp folder) left by processes that are gone;
    the paths removed."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        match = _NAME.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        path = os.path.join(parent, name)
        try:
            info = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    if removed:
        logger.info("removed %d IPC folder(s) left by processes that were killed", len(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # (not a pid this code wrote: leave it)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (EPERM: another user's process)
        return True
    return True
