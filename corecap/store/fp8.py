"""Lossy fp8 for stored hidden states (`--store-dtype fp8`), beside the lossless codecs of
corecap/store/codec.py; the workers' step-at-a-time variant is corecap/store/fp8rows.py.

Lossy fp8 (`quantize_fp8` / `dequantize_fp8`): each row (one token at one layer) is scaled by
s = max(absmax / 448, 2^-126) into float8_e4m3fn, whose largest value is 448. With 3 mantissa
bits, rounding moves a normal e4m3 value by at most half an ulp, 2^-4 of the value; below e4m3's
normal range (2^-6) by at most 2^-10 in scaled units. The top binade [256, 448] has an ulp of 32,
so no scaled error exceeds 16 = 448/28. Before rounding to the output dtype, every element obeys
    |x_hat - x| <= max(2^-4 |x|, 2^-10 s)     and     |x_hat - x| <= absmax(row) / 28  (~0.036)
(the second for rows with absmax >= 448 * 2^-126 ~ 5e-36; tinier rows use the floor scale and
are off by at most 16 * 2^-126).
On real activations the largest error sits at the second bound (measured: docs/codec.md; docs/benchmarks.md,
"Figures the code cites").
Rows must be finite; all-zero rows come back as zeros.

Thread safety: all functions may be called from several threads at once.
"""

from __future__ import annotations

import numpy as np
import torch

from corecap.store.codec import CodecError

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_MIN_SCALE = 2.0**-126  # smallest normal float32: keeps x / scale finite for tiny or zero rows

class NonFiniteStates(ValueError):
    """States that fp8 cannot encode: some row holds a NaN or an Inf."""

    def __init__(self, rows_per_layer):
        """`rows_per_layer`: how many rows of each layer hold a NaN or an Inf (some do)."""
        self.layer_indices = [i for i, n in enumerate(rows_per_layer) if n]  # those layers, by index
        i = self.layer_indices[0]
        super().__init__(f"fp8: layer index {i} has {int(rows_per_layer[i])} rows with NaN or Inf; "
                         "fp8 needs finite states")


# Each dtype's bit patterns as integers, with the sign bit masked off and the pattern of +Inf:
# IEEE magnitudes order as their patterns do, so a row's largest masked pattern is its absmax
# (exact, -0 included), and one at or above Inf's is an Inf or a NaN.
_MAGNITUDES = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
}
# Rows are quantized a chunk at a time, so their float32 values (2 MiB) stay in cache between
# the division and the cast; smaller chunks lose more to per-call overhead than they gain.
_FP8_CHUNK_VALUES = 1 << 19


def quantize_fp8(states: torch.Tensor) -> np.ndarray:
    """[L, T, H] float states → the fp8 payload, one uint8 array: float8_e4m3fn values [L, T, H],
    then float32 row scales [L, T]. NaN or Inf in any row is a NonFiniteStates (a ValueError).

    The payload is `e4m3(clamp(float32(x) / s, -448, 448))` with `s = max(absmax / 448, 2^-126)`
    in float32, to the bit. Row maxima come from the bit patterns (sign masked off, one integer
    pass), and rows go a chunk at a time through one float32 buffer: widen, divide, cast. The
    clamp is left out as it never changes a code: s rounds absmax / 448 to within 2^-24, so
    |x| / s stays under 448 * (1 + 2^-22), and the cast maps [448, 464) (464: 448's rounding
    boundary) to 448, as clamping first would (CPU torch gives NaN, or saturates, only from 464).
    Faster than the old per-layer formula (abs, amax, divide, clamp), per sample on one thread in
    CPU time; what is left is mostly torch's float32 → e4m3 cast, scalar on AVX2 (measured:
    `python -m tools.bench.sink --only fp8`; docs/benchmarks.md, "Quantized")."""
    if states.dim() != 3 or states.dtype not in _MAGNITUDES:
        raise ValueError(f"fp8: expected a [L, T, H] bf16/fp16/fp32 tensor, got {states.dtype} {list(states.shape)}")
    num_layers, num_tokens, hidden = states.shape
    num_rows = num_layers * num_tokens
    num_values = num_rows * hidden
    payload = np.empty(num_values + 4 * num_rows, np.uint8)
    scales = torch.full((num_rows,), FP8_MIN_SCALE, dtype=torch.float32)
    if num_values:
        int_dtype, mask, inf = _MAGNITUDES[states.dtype]
        mask = torch.tensor(mask, dtype=int_dtype)  # a tensor: and-ing a Python int is slower (docs/benchmarks.md)
        x = states.contiguous().view(num_rows, hidden)
        bits = x.view(int_dtype)
        q = torch.from_numpy(payload[:num_values]).view(torch.float8_e4m3fn).view(num_rows, hidden)
        step = min(num_rows, max(1, _FP8_CHUNK_VALUES // hidden))
        work = torch.empty((step, hidden), dtype=torch.float32)
        magnitude = torch.empty((step, hidden), dtype=int_dtype)
        row_max = torch.empty(num_rows, dtype=int_dtype)
        for start in range(0, num_rows, step):
            end = min(start + step, num_rows)
            n = end - start
            torch.amax(torch.bitwise_and(bits[start:end], mask, out=magnitude[:n]), dim=1, out=row_max[start:end])
            scale = scales[start:end]
            scale.copy_(row_max[start:end].view(states.dtype)).div_(FP8_MAX).clamp_min_(FP8_MIN_SCALE)
            if states.dtype == torch.float32:
                torch.div(x[start:end], scale[:, None], out=work[:n])
            else:  # widen, then divide: the same float32 quotient as a mixed-dtype div, sooner
                work[:n].copy_(x[start:end]).div_(scale[:, None])
            q[start:end].copy_(work[:n])
        if int(row_max.max()) >= inf:  # NaN and Inf rows made garbage above; the payload is dropped
            raise NonFiniteStates((row_max >= inf).view(num_layers, num_tokens).sum(dim=1).tolist())
    payload[num_values:] = scales.numpy().view(np.uint8)
    return payload


def dequantize_fp8(payload, shape: tuple[int, int, int], dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of `quantize_fp8`, up to the documented rounding error, in `dtype` (into `out`)."""
    num_layers, num_tokens, hidden = shape
    mv = memoryview(payload).cast("B")
    num_values = num_layers * num_tokens * hidden
    if mv.nbytes != num_values + 4 * num_layers * num_tokens:
        raise CodecError(
            f"fp8: payload is {mv.nbytes} bytes, expected {num_values + 4 * num_layers * num_tokens} "
            f"for shape {list(shape)} (values, then float32 row scales)"
        )
    out = torch.empty(shape, dtype=dtype) if out is None else out
    if not num_values:
        return out
    values = torch.frombuffer(_writable(mv[:num_values]), dtype=torch.uint8).view(torch.float8_e4m3fn).view(shape)
    scale = torch.frombuffer(bytearray(mv[num_values:]), dtype=torch.float32).view(num_layers, num_tokens, 1)  # aligned
    for i in range(num_layers):  # one layer at a time bounds the float32 temporaries
        out[i].copy_(values[i].to(torch.float32) * scale[i])
    return out


def _writable(mv: memoryview):
    """torch.frombuffer wants a writable buffer: the reader's bytearray is one, else a copy."""
    return mv if not mv.readonly else bytearray(mv)
