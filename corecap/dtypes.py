"""What the wire (corecap/transport/wire.py) and the store (corecap/store/) agree on about the
bytes of states, kept here so that neither imports the other: the dtypes states are captured,
sent and stored in, by name; the CRC-32 that checks their bytes on the wire and on disk; and
the layout of a row of fp8 states (its H codes, then its scale)."""

from __future__ import annotations

import torch

try:  # the same CRC-32 as zlib's, with SIMD: much faster (docs/benchmarks.md, "Figures the code cites")
    from zlib_ng.zlib_ng import crc32
except ImportError:  # a platform without zlib-ng's wheel: the same values, slower
    from zlib import crc32

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}

FP8_ROW_EXTRA = 4  # bytes after an fp8 row's H codes: its float32 scale, little-endian (corecap/store/fp8rows.py)

__all__ = ["DTYPES", "DTYPE_NAMES", "FP8_ROW_EXTRA", "ITEMSIZE", "crc32"]
