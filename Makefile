# The two set-up commands (see README):
#   make run    install, then run the main job
#   make test   install, then run the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test install install-test lint

install:
	VENV=$(VENV) scripts/install.sh

install-test:
	VENV=$(VENV) scripts/install.sh test

run: install
	$(VENV)/bin/pagedserve generate --chat --max-tokens 64 \
		--prompt "What is the capital of France? Answer in one sentence."

lint: install-test
	$(VENV)/bin/ruff check .

test: install-test lint
	$(PY) -m pytest
