"""Child processes end with their parent, however the parent ends (SIGKILL included).

Every process pagedserve starts (the engine core, `pagedserve up`'s server and chat UI, the
server that `bench serve --launch` measures) would otherwise outlive a parent killed by the
OOM killer or `kill -9`, holding its memory (on a GPU, its VRAM) and its port. Two guards:

- Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`): the kernel sends SIGKILL the moment
  the parent dies. It survives `exec` (so `pagedserve ui`, which execs Chainlit, keeps it). The
  kernel ties it to the *thread* that started the child, so it is only set for children started
  from the main thread.
- A daemon thread in the child that compares `os.getppid()` with the parent it was started by
  (for the engine core, where the first guard may not apply); a changed parent means the old
  one is gone. It also catches a parent that died before the child could set anything.

A terminal's Ctrl-C sends SIGINT to every process of its foreground process group, the engine
core (and its tensor-parallel ranks) included. Only the server may act on it (its drain), so
the core starts with SIGINT blocked (`interrupt_blocked`) and ignores it from its first line
(`ignore_interrupt`); processes it starts inherit the ignored signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1
_prctl = None


def _load_prctl():
    """libc's prctl, resolved once in the parent (never inside a forked child)."""
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        try:
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            _prctl = False
    return _prctl or None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux only)."""
    prctl = _load_prctl()
    return bool(prctl) and prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def die_with_parent(parent_pid: int, use_signal: bool = True, poll_s: float = 0.25) -> None:
    """Call first thing in a child process: exit as soon as `parent_pid` is gone."""
    if use_signal:
        set_parent_death_signal()
    if os.getppid() != parent_pid:  # it died before we got here
        os._exit(1)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="pagedserve-parent-watch", daemon=True).start()


def preexec_die_with_parent():
    """A `subprocess.Popen(preexec_fn=...)` that gives the child the parent-death signal
    (None where it does not apply: not Linux, or not called from the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None
    prctl = _load_prctl()
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


@contextlib.contextmanager
def interrupt_blocked():
    """Block SIGINT in this thread while child processes are started inside: a child starts
    with the signal mask of the thread that started it, so a Ctrl-C that comes before the
    child reaches `ignore_interrupt` stays pending there instead of interrupting its imports.
    This process loses nothing: a SIGINT meanwhile goes to another thread or waits until the
    block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore_interrupt() -> None:
    """Call first thing in a child started under `interrupt_blocked`: ignore SIGINT (a pending
    one is dropped), then unblock it. The ignored disposition is inherited by the processes
    this one starts, also across `exec`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
