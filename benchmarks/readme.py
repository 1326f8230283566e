"""Write a generated block between `<!-- NAME:begin -->` and `<!-- NAME:end -->` in the README or the doc
under docs/ that holds it."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))


def write_block(name: str, body: str, docs: tuple[Path, ...] = DOCS) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body}\n{end}"
    holders = [d for d in docs if begin in d.read_text() and end in d.read_text()]
    if len(holders) != 1:
        raise SystemExit(f"{begin} ... {end}: found in {len(holders)} of {[str(d) for d in docs]}, expected 1")
    readme = holders[0]
    text = readme.read_text()
    readme.write_text(re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S))
    return block


def table_head(head: list[str]) -> list[str]:
    """The header and separator lines of a markdown table."""
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
