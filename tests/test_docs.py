"""The code in docs/usage.md runs as written."""
from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_usage_example_runs():
    text = (DOCS / "usage.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/usage.md", "exec"), {})
