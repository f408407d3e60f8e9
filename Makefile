# The two set-up commands (see README):
#   make run    install, then run the main job
#   make test   install, then check the CPU container image and run the whole test suite (what CI runs)
# Installing happens once: scripts/install.sh does nothing (and asks no package index) while
# pyproject.toml is unchanged since the last install into $(VENV).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test install install-test lint test-image

install:
	VENV=$(VENV) scripts/install.sh

install-test:
	VENV=$(VENV) scripts/install.sh test

# The server and the chat UI on the embedded SmolLM2 (CPU): http://127.0.0.1:8080, Ctrl-C stops.
run: install
	$(VENV)/bin/pagedserve up

lint: install-test
	$(VENV)/bin/ruff check .

# Builds docker/Dockerfile.cpu with podman and answers one chat request from inside the image's
# filesystem (scripts/test_image.sh: needs root or sudo, apt-get and PyPI). Measured on a busy
# 2-core machine: 10 min with nothing cached (debootstrap 2.6 min, build 6.5 min), 43 s cached.
test-image: install
	VENV=$(VENV) scripts/test_image.sh

test: install-test lint test-image
	$(PY) -m pytest
