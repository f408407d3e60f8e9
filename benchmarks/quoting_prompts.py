"""A quoting workload for speculative decoding (issue 27): chat prompts whose answers copy
from the prompt (code edits that return the whole function, passages quoted back), built
from pagedserve's own source so the file needs no download. Writes JSONL ({"prompt": ...})
for `pagedserve bench serve --dataset-name custom --dataset-path FILE`.

    python benchmarks/quoting_prompts.py OUT.jsonl [count]
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "pagedserve"


def functions(limit: int) -> list[tuple[str, str, str]]:
    """(name, source, docstring) of short documented functions, in a fixed order."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
                src = ast.get_source_segment(text, node) or ""
                if 6 <= src.count("\n") <= 30:
                    found.append((node.name, src, ast.get_docstring(node)))
    return found[:limit]


def prompts(count: int) -> list[str]:
    out = []
    for i, (name, src, doc) in enumerate(functions(count)):
        if i % 2 == 0:
            out.append(f"Here is a Python function:\n\n```python\n{src}\n```\n\nRename it to "
                       f"`{name}_v2` and give back the whole function, otherwise unchanged.")
        else:
            out.append(f"Here is a passage of documentation:\n\n{doc}\n\nQuote the passage back "
                       "exactly, word for word.")
    return out


if __name__ == "__main__":
    dest, n = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 128
    items = prompts(n)
    dest.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in items))
    print(f"{len(items)} prompts -> {dest}")
