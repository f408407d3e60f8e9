"""Every environment variable pagedserve reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models are cached: $PAGEDSERVE_CACHE_DIR, else ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pagedserve"


def api_key() -> str | None:
    """$PAGEDSERVE_API_KEY: the key clients must send, if set."""
    return os.environ.get("PAGEDSERVE_API_KEY") or None


def log_level() -> str:
    """$PAGEDSERVE_LOG_LEVEL (default INFO)."""
    return os.environ.get("PAGEDSERVE_LOG_LEVEL", "INFO").upper()

