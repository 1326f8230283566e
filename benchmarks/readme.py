"""Write a generated block into the README between `<!-- NAME:begin -->` and `<!-- NAME:end -->`."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def write_block(name: str, body: str, readme: Path = README) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body}\n{end}"
    text = readme.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{readme} has no {begin} ... {end} block")
    readme.write_text(re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S))
    return block


def table_head(head: list[str]) -> list[str]:
    """The header and separator lines of a markdown table."""
    return ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
