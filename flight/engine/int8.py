"""int8 quantisation of decode-record KV (`--decode-kv-compression int8`, docs/engine.md).

The one option that gives up bitwise identity after a resume in decode; off by default.
"""

from __future__ import annotations

import torch


def quantize(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric int8 with one float32 scale per token and head (over the head dimension), so
    the scales stay a small fraction (1/head_dim) of the values however few steps a record holds."""
    as_float = values.float()
    scale = (as_float.abs().amax(dim=-1, keepdim=True) / 127.0).clamp_min(1e-12)
    return {"q": torch.round(as_float / scale).clamp_(-127, 127).to(torch.int8), "scale": scale}


def dequantize(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype) -> torch.Tensor:
    """Tensor `name` of a decode record as `dtype`: as stored, or rebuilt from its int8 values
    and `<name>.scale` when the record was written quantised."""
    if f"{name}.scale" not in tensors:
        return tensors[name]
    return (tensors[name].float() * tensors[f"{name}.scale"]).to(dtype)
