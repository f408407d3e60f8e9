"""Start-up settings that parse but cannot work, refused before anything loads.

Each check raises ValueError with one line that names the setting and the fix (the CLI prints
it and exits 2): an API key that is empty or that no HTTP client can send, and a port that
another process already listens on (found in well under a second, instead of after the model
has loaded).
"""

from __future__ import annotations

import errno
import socket


def resolve_api_key(flag: str | None, env: str | None) -> str | None:
    """The key clients must send: `--api-key` if given, else $PAGEDSERVE_API_KEY if set, else
    None (no authentication).

    A key given but empty (`--api-key "$KEY"` with KEY unset) would turn authentication off
    without a word, and one with outer spaces or characters outside printable ASCII can never
    arrive in an `Authorization` header: both are refused."""
    if flag is not None:
        source, key = "--api-key", flag
    elif env is not None:
        source, key = "$PAGEDSERVE_API_KEY", env
    else:
        return None
    if not key.strip():
        fix = ("unset the variable" if source.startswith("$") else "leave the flag out")
        raise ValueError(f"{source} is empty: authentication would be off. Give a key, or "
                         f"{fix} to serve without one")
    if key != key.strip():
        raise ValueError(f"{source} has leading or trailing spaces, which an HTTP header cannot "
                         "carry (clients could never match it): remove them")
    bad = sorted({c for c in key if not " " <= c <= "~"})
    if bad:
        shown = ", ".join(repr(c) for c in bad[:5])
        raise ValueError(f"{source} holds characters an HTTP header cannot carry ({shown}): use "
                         "printable ASCII only")
    return key


def check_port_free(host: str, port: int, what: str = "the server's") -> None:
    """Raise ValueError if `host`:`port` cannot be listened on (bound with SO_REUSEADDR on every
    address `host` resolves to, as uvicorn's asyncio server does, then closed at once)."""
    try:
        infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                   0, socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"--host {host} does not resolve ({e.strerror}): give an address of "
                         "this machine, e.g. 127.0.0.1 or 0.0.0.0") from None
    for family, kind, proto, _, address in infos:
        try:
            s = socket.socket(family, kind, proto)
        except OSError:  # (a family this machine lacks: asyncio skips it too)
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # (as asyncio)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ValueError(f"{what} port {port} on {host} is already in use: another "
                                     "process listens there; stop it or pick another port "
                                     "(--port)") from None
                raise ValueError(f"cannot listen on {host}:{port} ({e.strerror}): check --host "
                                 "and --port") from None



def kv_capacity_problem(capacity_tokens: int, max_model_len: int,
                        max_model_len_given: bool) -> tuple[bool, str] | None:
    """None when a KV cache of `capacity_tokens` holds one request of `max_model_len` tokens;
    else (refuse, the message). A request that grows to max_model_len would wait for room
    that never comes: vLLM refuses to start then, and so does pagedserve when max_model_len is
    the model's own limit. A --max-model-len the user gave is kept (refuse False): they asked
    for it, and longer requests than the cache holds get a 400."""
    if capacity_tokens >= max_model_len:
        return None
    fix = (f"give --max-model-len {capacity_tokens} or less, or the KV cache more memory "
           "(--kv-cache-memory BYTES; on a GPU, a higher --gpu-memory-utilization)")
    if max_model_len_given:
        return False, (f"the KV cache holds {capacity_tokens} tokens, fewer than --max-model-len "
                       f"{max_model_len}: a request longer than {capacity_tokens} tokens is "
                       f"refused (400); to serve every length, {fix}")
    return True, (f"the KV cache holds {capacity_tokens} tokens, fewer than max_model_len "
                  f"{max_model_len} (the model's limit): a request of that length could never "
                  f"run. To start, {fix}")
