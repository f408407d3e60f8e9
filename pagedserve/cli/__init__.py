"""The `pagedserve` command (`main.py`) and its flags: engine flags (`engine_args.py`), the
server's (`serve_args.py`), value types (`types.py`) and the parser class (`parser.py`)."""
