"""What a safetensors checkpoint holds, from its files' headers and its index alone (no tensor is
read): every tensor's name, and the file's own consistency. An interrupted download leaves a
shard absent or cut short; both are told here, whatever the architecture:

- a shard the index (`model.safetensors.index.json`) names that is not there;
- a tensor the index places in a shard whose header does not hold it;
- a file shorter than its header says (the header's largest data offset past the file's end),
  or whose header does not parse.

Which files count is vLLM's rule: with an index, the shards it names; without, every
`*.safetensors` in the directory.
"""

from __future__ import annotations

import json
import os
import struct

from corecap.errors import CorecapError

INDEX = "model.safetensors.index.json"
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header's size


def header(path: str) -> dict:
    """The safetensors header of `path` ({name: {dtype, shape, data_offsets}}, no `__metadata__`),
    checked against the file's size."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorecapError(f"{path}: {size} bytes, too short for a safetensors file (an interrupted download?)")
        (length,) = struct.unpack("<Q", head)
        if length > _MAX_HEADER or 8 + length > size:
            raise CorecapError(f"{path}: its header claims {length} bytes and the file holds {size}: "
                               "cut short (an interrupted download?) or not a safetensors file")
        try:
            entries = json.loads(f.read(length))
        except (UnicodeDecodeError, ValueError):
            raise CorecapError(f"{path}: its safetensors header is not valid JSON (a damaged file?)") from None
    if not isinstance(entries, dict):
        raise CorecapError(f"{path}: its safetensors header is not a JSON object (a damaged file?)")
    entries.pop("__metadata__", None)
    end = max((_end(path, name, entry) for name, entry in entries.items()), default=0)
    if 8 + length + end > size:
        raise CorecapError(f"{path}: {size} bytes, but its tensors end at byte {8 + length + end}: "
                           "the file is cut short (an interrupted download?)")
    return entries


def _end(path: str, name: str, entry) -> int:
    try:
        start, end = entry["data_offsets"]
        return int(end)
    except (TypeError, KeyError, ValueError):
        raise CorecapError(f"{path}: tensor {name!r} has no data offsets in the header (a damaged file?)") from None


def tensor_names(model_dir: str) -> set[str] | None:
    """Every tensor name the checkpoint in `model_dir` holds, after checking its files; None
    where it has no safetensors files (other formats are vLLM's to read)."""
    index_path = os.path.join(model_dir, INDEX)
    if not os.path.exists(index_path):
        files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
        if not files:
            return None
        return {name for f in files for name in header(os.path.join(model_dir, f))}
    try:
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise CorecapError(f"{index_path}: not a safetensors index (expected JSON with a weight_map)") from None
    absent = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
    if absent:
        raise CorecapError(f"{model_dir}: {len(absent)} of the {len(shards)} weight files that {INDEX} names are "
                           f"missing ({few(absent)}): an interrupted download? Download them again")
    names: set[str] = set()
    for shard in shards:
        held = header(os.path.join(model_dir, shard))
        lacking = sorted(name for name, s in weight_map.items() if s == shard and name not in held)
        if lacking:
            raise CorecapError(f"{os.path.join(model_dir, shard)}: lacks {len(lacking)} tensors that {INDEX} places "
                               f"there ({few(lacking)}): a damaged or mismatched file? Download it again")
        names.update(held)
    return names


def few(names: list[str], shown: int = 3) -> str:
    more = f", and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
