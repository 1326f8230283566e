"""KV quantization of kept rows (plain torch): a step a row-keeping method composes with its choice of rows.

Each row's K and V are quantized per KV head in groups of `group` channels: asymmetric min-max codes of
`bits` bits (8, 4 or 2) with a float16 scale and minimum per group, packed into bytes. A row is stored as
one byte string (K codes, K scales, K minima, then V's), so rows pack densely into the engine's pages and
the bytes a method holds are the bytes its codes take. At a given byte budget quantized rows buy more rows:
the method keeps `budget bytes / quantized row bytes` of them (evicting fewer) and attends their
dequantized values.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, Field

KV_BITS = (2, 4, 8)
_SCALE_DTYPE = torch.float16


class KVQuantSettings(BaseModel):
    """The settings of a method whose kept rows may be quantized (a mixin of its pydantic settings)."""

    kv_bits: Literal[2, 4, 8, 16] = Field(16, description="bits per element of the kept K/V rows: 16 keeps "
                                          "them in the KV cache dtype; 8, 4 or 2 quantizes them per KV head "
                                          "and group of channels (float16 scale and minimum per group)")
    kv_quant_group: Literal[16, 32, 64, 128] = Field(32, description="channels per quantization group "
                                                     "(must divide the model's head size)")

    def kv_quantization(self, bits: int | None = None) -> "KVQuantization | None":
        """The codec for `bits` (default: the setting); None at 16 bits (rows kept as they are)."""
        bits = self.kv_bits if bits is None else bits
        return None if bits == 16 else KVQuantization(bits=bits, group=self.kv_quant_group)

    def request_quantization(self, bits: int | None, D: int) -> "tuple[KVQuantization | None, str]":
        """The codec of a request (its `sekv_kv_bits`, else the setting) for heads of size D, and "" ; or
        (None, why) when its groups do not divide the heads (a request's bits on such a model keep full KV)."""
        codec = self.kv_quantization(bits)
        try:
            if codec is not None:
                codec.check_head_size(D)
        except ValueError as err:
            return None, str(err)
        return codec, ""


@dataclass(frozen=True)
class KVQuantization:
    """Rows k, v [n, Hkv, D] <-> bytes [n, row_bytes] uint8."""

    bits: int
    group: int

    def __post_init__(self) -> None:
        if self.bits not in KV_BITS:
            raise ValueError(f"kv_bits: {self.bits} is not one of {KV_BITS}")

    def check_head_size(self, D: int) -> None:
        if D % self.group:
            raise ValueError(f"kv_quant_group: {self.group} does not divide the model's head size {D}; "
                             f"allowed: a divisor of {D} among 16, 32, 64, 128")

    def tensor_bytes(self, Hkv: int, D: int) -> int:
        """Bytes of one row's K (or V) of every KV head: codes, then scales and minima."""
        return Hkv * (D * self.bits // 8 + 2 * (D // self.group) * _SCALE_DTYPE.itemsize)

    def row_bytes(self, Hkv: int, D: int) -> int:
        """Bytes of one row (K and V of every KV head)."""
        return 2 * self.tensor_bytes(Hkv, D)

    @functools.lru_cache(maxsize=8)  # read at every eviction of every layer: the same few shapes
    def head_bytes(self, Hkv: int, D: int, device: torch.device) -> torch.Tensor:
        """[Hkv, m] int64: the offsets in a row of every byte of each KV head (its K and V codes, scales and
        minima)."""
        codes, scales = D * self.bits // 8, (D // self.group) * _SCALE_DTYPE.itemsize
        heads = torch.arange(Hkv, device=device)[:, None]
        parts = []
        for base in (0, self.tensor_bytes(Hkv, D)):  # K, then V
            parts.append(base + heads * codes + torch.arange(codes, device=device))
            for i in range(2):  # scales, then minima
                start = base + Hkv * codes + i * Hkv * scales
                parts.append(start + heads * scales + torch.arange(scales, device=device))
        return torch.cat(parts, dim=1)

    def _quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, Hkv, D] -> bytes [n, tensor_bytes]."""
        n, Hkv, D = x.shape
        self.check_head_size(D)
        groups = x.float().reshape(n, Hkv, D // self.group, self.group)
        low = groups.amin(dim=-1).to(_SCALE_DTYPE)
        levels = (1 << self.bits) - 1
        scale = ((groups.amax(dim=-1) - low.float()) / levels).to(_SCALE_DTYPE)
        scale = scale.clamp_min(torch.finfo(_SCALE_DTYPE).tiny)  # a constant group: any positive scale
        codes = ((groups - low.float()[..., None]) / scale.float()[..., None]).round().clamp(0, levels)
        per_byte = 8 // self.bits
        codes = codes.to(torch.uint8).reshape(n, Hkv, D // per_byte, per_byte)
        shifts = torch.arange(per_byte, device=x.device, dtype=torch.uint8) * self.bits
        packed = (codes << shifts).sum(dim=-1, dtype=torch.uint8)  # disjoint bits: the sum is their OR
        return torch.cat([packed.reshape(n, Hkv * D // per_byte), _bytes(scale, n), _bytes(low, n)], dim=1)

    def _dequantize(self, raw: torch.Tensor, Hkv: int, D: int, dtype: torch.dtype) -> torch.Tensor:
        """bytes [n, tensor_bytes] -> x [n, Hkv, D] of `dtype`."""
        n, per_byte, G = raw.shape[0], 8 // self.bits, D // self.group
        code_bytes, scale_bytes = Hkv * D // per_byte, Hkv * G * _SCALE_DTYPE.itemsize
        packed = raw[:, :code_bytes].reshape(n, Hkv, D // per_byte, 1)
        shifts = torch.arange(per_byte, device=raw.device, dtype=torch.uint8) * self.bits
        codes = ((packed >> shifts) & ((1 << self.bits) - 1)).reshape(n, Hkv, G, self.group)
        scale = _floats(raw[:, code_bytes : code_bytes + scale_bytes], n, Hkv, G)
        low = _floats(raw[:, code_bytes + scale_bytes :], n, Hkv, G)
        return (codes.float() * scale[..., None] + low[..., None]).reshape(n, Hkv, D).to(dtype)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """k, v [n, Hkv, D] -> rows [n, row_bytes] uint8."""
        return torch.cat([self._quantize(k), self._quantize(v)], dim=1)

    def decode(self, rows: torch.Tensor, Hkv: int, D: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [n, row_bytes] uint8 -> k, v [n, Hkv, D] of `dtype`."""
        half = self.tensor_bytes(Hkv, D)
        return (self._dequantize(rows[:, :half], Hkv, D, dtype),
                self._dequantize(rows[:, half:], Hkv, D, dtype))


def _bytes(x: torch.Tensor, n: int) -> torch.Tensor:
    """float16 [n, Hkv, G] -> its bytes [n, Hkv * G * 2] uint8."""
    return x.contiguous().view(torch.uint8).reshape(n, x.shape[1] * x.shape[2] * x.element_size())


def _floats(raw: torch.Tensor, n: int, Hkv: int, G: int) -> torch.Tensor:
    """bytes [n, Hkv * G * 2] -> float32 [n, Hkv, G] (stored as float16)."""
    return raw.contiguous().view(_SCALE_DTYPE).reshape(n, Hkv, G).float()
