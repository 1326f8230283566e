"""Quest-like query-aware page selection (Tang et al., 2024): read only the pages the query may need.

The prompt is cut into pages of `page_size` rows (the last, partial one stays with the output, the
window). Each page keeps, per KV head,
the element-wise minimum and maximum of its keys; they bound every key of the page, so for a query
q the page's largest attention logit is at most sum_d max(q_d lo_d, q_d hi_d). At each decode step
the pages with the highest bounds are read and attended exactly, with the last rows and the output.

As in Quest, pages are chosen per KV head and step, from the bounds alone. Unlike Quest, which keeps
every page in GPU memory, the pages live in the host pool (nothing is evicted) and the fast tier holds
the bounds, the window and the pages read per step. With GQA a KV head's pages are ranked by the
largest bound among its query heads, each head's bounds first normalised by their log-sum-exp over
the pages (heads' logit scales differ). Lossless when every page is read. With `kv_bits` below 16
the window and the pages are kept quantized (`kv_quantization.py`; the bounds stay at the KV dtype,
from the prompt's keys as prefill computed them, the output's as the window kept them): a page read
costs fewer bytes, so the same budget reads more.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from sekv_vllm.methods.base import MethodSettings
from sekv_vllm.methods.kv_quantization import KVQuantization, KVQuantSettings


class Quest(MethodSettings, KVQuantSettings):
    name: ClassVar[str] = "quest"

    page_size: int = Field(16, ge=2, le=256, description="rows per page: one pair of key bounds per page and KV head")
    recent_rows: int = Field(0, ge=0, description="last prompt rows always attended, beside the partial last page "
                             "and the output (0: none, as Quest)")

    def paged_rows(self, prompt_len: int) -> int:
        """Prompt rows cut into whole pages: the rest (`recent_rows` and the partial page) is attended at every
        step."""
        return max(prompt_len - self.recent_rows, 0) // self.page_size * self.page_size


def page_bounds(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key bounds of each page: k [P * page_size, Hkv, D] -> lo, hi [P, Hkv, D] (element-wise min and max)."""
    pages = k.view(-1, page_size, *k.shape[1:])
    return pages.amin(dim=1), pages.amax(dim=1)


def page_box(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each page's key box as centre and half-width: lo, hi [P, Hkv, D] -> [P, Hkv, D] each, in their dtype (the
    bytes of the bounds; kept so that a decode step does not derive them again)."""
    lo32, hi32 = lo.float(), hi.float()
    return ((hi32 + lo32) / 2).to(lo.dtype), ((hi32 - lo32) / 2).to(lo.dtype)


def box_scores(q: torch.Tensor, centre: torch.Tensor, half: torch.Tensor, scale: float) -> torch.Tensor:
    """Each page's rank per KV head: q [H, D], centre, half [P, Hkv, D] (`page_box`) -> [Hkv, P] float32.

    Per query head the upper bound of the page's logits, sum_d max(q_d lo_d, q_d hi_d) = q . centre +
    |q| . half, log-softmax-normalised over the pages; per KV head the largest among its query heads.
    """
    H, D = q.shape
    Hkv = centre.shape[1]
    qg = q.float().view(Hkv, H // Hkv, D)
    centre, half = centre.float(), half.float()  # no copy for a float32 cache
    bound = (torch.einsum("kgd,pkd->kgp", qg, centre) + torch.einsum("kgd,pkd->kgp", qg.abs(), half)) * scale
    return torch.log_softmax(bound, dim=-1).amax(dim=1)


def page_scores(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, scale: float) -> torch.Tensor:
    """`box_scores` from the pages' key bounds lo, hi [P, Hkv, D]."""
    return box_scores(q, *page_box(lo, hi), scale)


def top_pages(scores: torch.Tensor, n: int) -> torch.Tensor:
    """The n best pages of each KV head, ascending: scores [Hkv, P] -> [Hkv, n] int64."""
    return scores.topk(n, dim=-1).indices.sort(dim=-1).values


def gather_pages(pages: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The rows of each KV head's chosen pages: pages [P, page_size, Hkv, D], chosen [Hkv, n] ->
    [n * page_size, Hkv, D] (row j of KV head h from its own pages, in page order)."""
    heads = torch.arange(pages.shape[2], device=pages.device)[:, None]
    rows = pages[chosen, :, heads]  # [Hkv, n, page_size, D]
    return rows.flatten(1, 2).transpose(0, 1)


def to_host_pages(k: torch.Tensor, v: torch.Tensor, page_size: int,
                  codec: KVQuantization | None) -> tuple[torch.Tensor, ...]:
    """Rows k, v [P * page_size, Hkv, D] as host pages: (k, v) [P, page_size, Hkv, D] (copies), or with `codec`
    (their codes [P, page_size, row_bytes] uint8,)."""
    if codec is None:
        return k.reshape(-1, page_size, *k.shape[1:]).clone(), v.reshape(-1, page_size, *v.shape[1:]).clone()
    codes = codec.encode(k, v)
    return (codes.view(-1, page_size, codes.shape[1]),)


def read_host_pages(pages: tuple[torch.Tensor, ...], chosen: torch.Tensor, codec: KVQuantization | None,
                    row_shape: tuple[int, int], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of each KV head's chosen pages (`to_host_pages`' form; chosen [Hkv, n]) -> k, v
    [n * page_size, Hkv, D] of `dtype`; quantized pages are decoded once each, whichever heads chose them."""
    if codec is None:
        return gather_pages(pages[0], chosen), gather_pages(pages[1], chosen)
    union, where = torch.unique(chosen, return_inverse=True)
    codes = pages[0][union]  # [u, page_size, row_bytes]
    u, page_size = codes.shape[:2]
    k, v = codec.decode(codes.reshape(u * page_size, -1), *row_shape, dtype)
    return (gather_pages(k.view(u, page_size, *row_shape), where),
            gather_pages(v.view(u, page_size, *row_shape), where))
