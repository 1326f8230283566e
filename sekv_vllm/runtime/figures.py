"""What a compressed request holds where: one record for every method, the method's own figures beside it."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

Figure = int | float | bool | str


@dataclass(frozen=True)
class EnginePages:
    """The request's vLLM pages (set by the engine adapter): bytes held and handed back to vLLM's pool,
    and the pages kept of the output's compressed rows."""

    held_bytes: int
    returned_bytes: int
    output_pages_kept: int = 0


@dataclass(frozen=True)
class CompressionFigures:
    """A request's figures once compressed.

    budget_rows:     its budget, in full-KV rows' worth of fast-tier bytes
    full_kv_bytes:   its prompt's K and V rows in every layer, in the KV dtype
    fast_tier_bytes: what the method holds in the fast tier for the prompt, everything counted
    host_pool_bytes: what it holds in the host pool
    spans:           SeKV's spans (0 for the other methods)
    own:             the method's own figures by name (kept rows, zoom rows, pages read per step, ...)
    pages:           the engine's pages, once the adapter has filed them
    """

    req_id: str
    method: str
    prompt_tokens: int
    budget_rows: int
    full_kv_bytes: int
    fast_tier_bytes: int
    host_pool_bytes: int
    spans: int = 0
    own: Mapping[str, Figure] = field(default_factory=dict)
    pages: EnginePages | None = None

    @property
    def fast_tier_fraction(self) -> float:
        return self.fast_tier_bytes / self.full_kv_bytes

    def as_dict(self) -> dict[str, Figure]:
        """One flat mapping (a JSON line of `stats_path`, what `SeKVRuntime.figures` returns)."""
        out: dict[str, Figure] = {
            "req_id": self.req_id, "method": self.method, "prompt_tokens": self.prompt_tokens,
            "budget_rows": self.budget_rows, "spans": self.spans, "full_kv_bytes": self.full_kv_bytes,
            "fast_tier_bytes": self.fast_tier_bytes, "fast_tier_fraction": self.fast_tier_fraction,
            "host_pool_bytes": self.host_pool_bytes, **self.own,
        }
        if self.pages is not None:
            out.update(vllm_pages_held_bytes=self.pages.held_bytes, vllm_pages_returned_bytes=self.pages.returned_bytes,
                       vllm_output_pages_kept=self.pages.output_pages_kept)
        return out
