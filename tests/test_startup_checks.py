"""Start-up settings that cannot work are refused before anything loads (issue 55, finding 6):
an empty API key, one no HTTP header can carry, a port already taken; and the IPC folders of
killed servers are removed on the next start."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
from server_helpers import free_port

from pagedserve.cli.main import main
from pagedserve.ipc_dirs import new_ipc_dir, remove_stale_ipc_dirs
from pagedserve.server.startup_checks import check_port_free, resolve_api_key


@pytest.mark.parametrize(("flag", "env", "says"), [
    ("", None, "--api-key is empty"),
    ("   ", None, "--api-key is empty"),
    (None, "", "$PAGEDSERVE_API_KEY is empty"),
    (" secret", None, "--api-key has leading or trailing spaces"),
    ("secret\n", None, "--api-key has leading or trailing spaces"),
    ("sécret", None, "--api-key holds characters an HTTP header cannot carry ('é')"),
    ("se\x01cret", None, "--api-key holds characters"),
    (None, "ke\u2028y", "$PAGEDSERVE_API_KEY holds characters"),
])
def test_unusable_api_keys_are_refused_by_name(flag, env, says):
    with pytest.raises(ValueError) as caught:
        resolve_api_key(flag, env)
    assert str(caught.value).startswith(says), caught.value


def test_usable_api_keys_pass():
    assert resolve_api_key("sk-abc 123~", None) == "sk-abc 123~"  # (inner spaces travel)
    assert resolve_api_key(None, "from-env") == "from-env"
    assert resolve_api_key("flag", "env") == "flag"
    assert resolve_api_key(None, None) is None


@pytest.fixture
def no_serving(monkeypatch):
    """`serve` past its checks would load the model: make that an error the test sees."""
    import pagedserve.server.launch as launch

    def loading(*_a, **_k):
        raise AssertionError("the server began to start")

    monkeypatch.setattr(launch, "serve", loading)
    monkeypatch.delenv("PAGEDSERVE_API_KEY", raising=False)
    return monkeypatch


@pytest.mark.parametrize(("argv", "env", "says"), [
    (["--api-key", ""], None, "--api-key is empty"),
    (["--api-key", "key "], None, "--api-key has leading or trailing spaces"),
    (["--api-key", "ключ"], None, "--api-key holds characters"),
    ([], "", "$PAGEDSERVE_API_KEY is empty"),
])
def test_serve_refuses_the_key_before_loading(no_serving, capsys, argv, env, says):
    if env is not None:
        no_serving.setenv("PAGEDSERVE_API_KEY", env)
    assert main(["serve", "--port", str(free_port()), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedserve: error: {says}"), err


def _run_cli(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PAGEDSERVE_API_KEY", None)
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "2048", "--kv-cache-memory", str(256 << 20), "--log-level", "WARNING",
           *args]
    t0 = time.monotonic()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"`serve {' '.join(args)}` still ran after {timeout} s (it started serving)")
    return done, time.monotonic() - t0


def test_an_empty_key_ends_the_command_at_once():
    """`--api-key "$UNSET"`: exit 2 naming the flag, before any model loads (it used to serve
    without authentication)."""
    done, took = _run_cli("--port", str(free_port()), "--api-key", "", timeout=30)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "--api-key is empty" in done.stderr
    print(f"`serve --api-key ''` exited 2 after {took:.2f} s")


def test_a_taken_port_ends_the_command_before_the_model_loads():
    """A second server on a taken port: exit 2 naming the port in about a second (it used to load
    the whole model, then exit 3)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
        done, took = _run_cli("--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr, done.stderr[-2000:]
    assert "--port" in done.stderr
    assert took < 10, f"a taken port was reported only after {took:.1f} s"
    print(f"a taken port: exit 2 after {took:.2f} s")


def test_a_bad_host_is_named():
    with pytest.raises(ValueError, match="--host no-such-host.invalid does not resolve"):
        check_port_free("no-such-host.invalid", free_port())
    with pytest.raises(ValueError, match="cannot listen on 192.0.2.1:"):  # (not this machine's)
        check_port_free("192.0.2.1", free_port())


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_ipc_folders_of_gone_processes_are_removed(tmp_path):
    """Only folders named pagedserve-<pid>-* (or pagedserve-tp-<pid>-*) whose pid is gone."""
    dead = _dead_pid()
    stale = [tmp_path / f"pagedserve-{dead}-abc", tmp_path / f"pagedserve-tp-{dead}-x"]
    kept = [tmp_path / f"pagedserve-{os.getpid()}-abc",  # a live process's
            tmp_path / "pagedserve-abc12345",  # another naming (an older server's)
            tmp_path / "unrelated-1-x"]
    for d in stale + kept:
        d.mkdir()
        (d / "in").write_text("")
    (tmp_path / f"pagedserve-{dead}-file").write_text("")  # not a folder
    removed = remove_stale_ipc_dirs(str(tmp_path))
    assert sorted(removed) == sorted(map(str, stale))
    assert all(d.exists() for d in kept) and not any(d.exists() for d in stale)
    assert (tmp_path / f"pagedserve-{dead}-file").exists()


def test_new_ipc_folders_carry_the_pid():
    path = new_ipc_dir()
    try:
        assert os.path.basename(path).startswith(f"pagedserve-{os.getpid()}-")
        assert path not in remove_stale_ipc_dirs(os.path.dirname(path))  # (this process lives)
        assert os.path.isdir(path)
    finally:
        os.rmdir(path)
