"""A sample's states from their stored bytes, decoded after its header and their size are
checked (corecap/store/checks.py), so nothing is allocated or read by a header that lies.
"""

from __future__ import annotations

import numpy as np
import torch

from corecap.dtypes import DTYPES
from corecap.errors import CorecapError
from corecap.store import codec as codecs, fp8
from corecap.store.checks import check_stored, stored_bytes
from corecap.store.format import FP8, Sample, SampleHeader, decode_header


def decode_states(key: str, header: SampleHeader, payload, out: torch.Tensor | None = None) -> Sample:
    """The sample `key`, whose (checked: `header_problems`) header is `header`, from its stored
    states, decoded into `out` (a contiguous tensor of their shape and dtype) or new memory;
    CorecapError when they do not decode to what the header declares. A header with a prefix
    gives the states of its own positions [n, T) only (corecap/store/refs.py assembles)."""
    expected, _ = stored_bytes(header, key)
    dtype = DTYPES[header.dtype]
    shape = (len(header.layers), header.num_tokens - header.num_prefix, header.hidden_size)
    ids = np.frombuffer(header.input_ids, dtype="<i4").copy()
    try:
        if header.codec == FP8:
            check_stored(key, header, payload)
            return Sample(header, ids, fp8.dequantize_fp8(payload, shape, dtype, out))
        if header.codec == "raw" and out is None:
            if memoryview(payload).nbytes != expected:
                raise CorecapError(f"sample {key!r}: payload is {memoryview(payload).nbytes} bytes, "
                                   f"expected {expected}")
            # the reader's own buffer, or a copy
            raw = payload if not memoryview(payload).readonly else bytearray(payload)
            crc, states = codecs.crc32(raw), (torch.frombuffer(raw, dtype=torch.uint8) if len(raw)
                                              else torch.empty(0, dtype=torch.uint8))
        else:
            states = torch.from_numpy(np.empty(expected, np.uint8)) if out is None else out.view(-1).view(torch.uint8)
            crc = codecs.decode_into(payload, header.dtype, expected, header.codec, states.numpy())
    except codecs.CodecError as e:
        raise CorecapError(f"sample {key!r}: {e}") from None
    except MemoryError:
        raise CorecapError(f"sample {key!r}: its {expected} bytes of states do not fit in memory") from None
    if crc != header.checksum:
        raise CorecapError(f"sample {key!r}: checksum mismatch (stored data is corrupt)")
    return Sample(header, ids, states.view(dtype).view(shape) if out is None else out)


def decode_sample(key: str, header_value, payload, num_layers: int) -> Sample:
    """A sample from its stored header and states (without a store: `Store.get` also checks the
    header against the store's metadata)."""
    header = decode_header(key, header_value)
    if len(header.layers) != num_layers:
        raise CorecapError(f"sample {key!r}: header has {len(header.layers)} layers, the store {num_layers}")
    stored_bytes(header, key)
    return decode_states(key, header, payload)
