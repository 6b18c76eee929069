"""fp8 quantised where the states are made: on the worker's device, a step at a time.

`--store-dtype fp8` stores `quantize_fp8`'s payload (corecap/store/fp8.py): e4m3 values
[L, T, H], then float32 row scales [L, T]. Quantising in the sink cost more CPU per sample than
zstd-planes, so on a disk-bound 1B shape fewer bytes stored fewer tokens a second
(docs/benchmarks.md, "Quantized"). The workers quantise each step instead (`quantize_fp8_rows`, on the GPU
where they run), so the ring, the wire and the sink's reassembly carry rows of H + 4 bytes (the
row's codes, then its scale) instead of 2H (bf16) or 4H, and the writer only regroups the rows
into the stored layout (`fp8_payload`) and checksums them. The formula is `quantize_fp8`'s, op
for op, so the payload is the same to the bit (tests/test_fp8.py, against an independent
reference); a row with a NaN or an Inf gets a NaN or an infinite scale, which `fp8_payload`
refuses.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from corecap.dtypes import FP8_ROW_EXTRA, ITEMSIZE
from corecap.store.fp8 import _MAGNITUDES, FP8_MAX, FP8_MIN_SCALE, NonFiniteStates

ROW_EXTRA = FP8_ROW_EXTRA  # bytes after a row's H codes: its float32 scale, little-endian


def quantize_fp8_rows(layers: Sequence[torch.Tensor], num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` rows of each layer's [T, H] states (one device; bf16, fp16 or
    float32) → uint8 [L, num_tokens, H + 4] on that device: each row's float8_e4m3fn codes
    `e4m3(float32(x) / s)`, then `s = max(float32(absmax) / 448, 2^-126)`'s bytes. One layer at a
    time, so the float32 temporaries are one layer's."""
    first = layers[0]
    if first.dim() != 2 or first.dtype not in _MAGNITUDES:
        raise ValueError(f"fp8: expected [T, H] bf16/fp16/fp32 states, got {first.dtype} {list(first.shape)}")
    hidden = first.shape[-1]
    int_dtype, mask, _ = _MAGNITUDES[first.dtype]
    out = torch.empty((len(layers), num_tokens, hidden + ROW_EXTRA), dtype=torch.uint8, device=first.device)
    for i, states in enumerate(layers):
        x = states[:num_tokens]
        row_max = torch.amax(torch.bitwise_and(x.view(int_dtype), mask), dim=1)  # sign masked off: |x|'s bits
        scale = row_max.view(x.dtype).to(torch.float32)
        # A tensor divisor: CUDA multiplies by a Python number's reciprocal, which rounds otherwise.
        scale.div_(scale.new_tensor(FP8_MAX)).clamp_min_(FP8_MIN_SCALE)
        out[i, :, :hidden].view(torch.float8_e4m3fn).copy_(x.to(torch.float32, copy=True).div_(scale[:, None]))
        out[i, :, hidden:].copy_(scale.view(torch.uint8).view(num_tokens, ROW_EXTRA))
    return out


def hidden_size(rows: torch.Tensor) -> int:
    return rows.shape[-1] - ROW_EXTRA


def captured_nbytes(rows: torch.Tensor, dtype: str) -> int:
    """The size of the `dtype` states the rows quantise: what a reader gets back."""
    return rows.shape[0] * rows.shape[1] * hidden_size(rows) * ITEMSIZE[dtype]


def fp8_payload(rows: torch.Tensor) -> np.ndarray:
    """uint8 [L, T, H + 4] host rows → `quantize_fp8`'s payload (codes [L, T, H], then the
    scales [L, T]); NonFiniteStates if a row held a NaN or an Inf (its scale is not finite)."""
    num_layers, num_tokens, _ = rows.shape
    hidden = hidden_size(rows)
    num_values = num_layers * num_tokens * hidden
    payload = np.empty(num_values + ROW_EXTRA * num_layers * num_tokens, np.uint8)
    a = rows.numpy()
    payload[:num_values].reshape(num_layers, num_tokens, hidden)[...] = a[..., :hidden]
    scales = payload[num_values:].reshape(num_layers, num_tokens, ROW_EXTRA)
    scales[...] = a[..., hidden:]
    finite = np.isfinite(scales.view("<f4"))
    if not finite.all():
        raise NonFiniteStates((~finite).reshape(num_layers, num_tokens).sum(axis=1).tolist())
    return payload
