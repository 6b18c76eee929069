"""A damaged or hostile store cannot crash or exhaust a reader.

Small real stores (Store + encode_sample, no engine: raw, zstd-planes and fp8 samples) are
damaged the ways a failing disk, a killed writer or a hand edit leave them, and every reader
must either return exactly the data the store was made from or raise CorecapError with one line
naming the store, promptly and in bounded memory:
- regression tests for the damage first reported (a pointer claiming 2^40 and 8 GiB), through
  the real CLI in a process whose address space is limited;
- a hypothesis fuzz over header, pointer, metadata, states_end, state-file bytes and LMDB
  records (bit flips, cuts, huge and negative-looking integers, wrong msgpack and JSON types,
  records deleted or renamed, files replaced), each mutant read by every reader of
  tests/support/hostile_readers.py (get, ls, info, verify, merge, merge into a clean store) in one
  long-lived child process whose peak RSS is checked against 10 x the store's size plus a fixed
  allowance, and whose address space is limited once it is warm;
- trace.json, writer.lock and LMDB page damage.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import shutil
import struct
import subprocess
import sys
import time

import lmdb
import msgspec
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from corecap.cli import info, ls, trace
from corecap.errors import CorecapError
from corecap.store import FP8, FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample
from corecap.store import codec as codecs, fp8
from corecap.store import decode_header, input_fingerprint
from corecap.dtypes import DTYPES
from corecap.store.format import Segment, header_crc
from corecap.store.refs import layout, within
from corecap.store.segments import END, POINTER, segment_path
from corecap.store.verify import verify_store
from corecap.trace.analysis import summarize
from corecap.trace.timeline import load_trace
from corecap.trace.views import to_chrome
from support import fuzz

LAYERS = (2, 4, "prenorm")
HIDDEN = 32
IDENTITY = ModelIdentity(path="/m", architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
                         num_layers=8, hidden_size=HIDDEN, vocab_size=100)
WORKER = os.path.join(os.path.dirname(__file__), "support", "hostile_readers.py")
# thorough: ~2 minutes on CI's 2 cores (the report of the branch that added it measured it)
MAX_EXAMPLES = fuzz.examples(1000)
LIVENESS_S = 60  # one mutant, all readers: normally well under a second
RSS_ALLOWANCE = 96 << 20  # above the warm worker's peak: Python's own churn over hundreds of mutants
AS_ALLOWANCE = 512 << 20  # address space above the warm worker's peak: a huge allocation fails instead


def _meta(codec: str, dtype: str) -> StoreMeta:
    return StoreMeta(
        format_version=FORMAT_VERSION, model=IDENTITY, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype=dtype,
        hidden_size=HIDDEN, corecap_version="0", vllm_version="0", codec=codec,
    )


def _states(seed: int, num_tokens: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(LAYERS), num_tokens, HIDDEN, generator=g).to(dtype)


# key → (codec, tokens, loss mask?): every codec, an empty sample, a mask of 0/1 flags; samples
# stored once (format 4): key → (the sample whose prefix it starts with, prefix length), the
# second one referring through the first (its header names zstd-b and ref-e)
LOSSLESS = {"raw-a": ("raw", 7, True), "zstd-b": ("zstd-planes", 40, False), "zstd-c": ("zstd-planes", 1, True),
            "raw-d": ("raw", 0, False), "ref-e": ("zstd-planes", 8, True), "ref-f": ("raw", 3, False)}
LOSSY = {"f-a": (FP8, 5, False), "f-b": (FP8, 9, True), "f-c": (FP8, 3, False)}
REFERS = {"ref-e": ("zstd-b", 16), "ref-f": ("ref-e", 20), "f-c": ("f-b", 4)}


def _build(path: str, samples: dict, codec: str, dtype, prefix: str = "", seed: int = 0) -> dict:
    """A store of `samples`; returns key → the reference the readers compare against (made from
    the inputs directly: fp8 through the codec's own round trip, not through the store)."""
    reference, records, layouts = {}, [], {}
    for i, (key, (sample_codec, n, masked)) in enumerate(samples.items()):
        name, key = key, prefix + key
        ids = torch.arange(n, dtype=torch.int32) * 7 + i
        states = _states(seed + i, n, dtype)
        if sample_codec == FP8:
            states = fp8.dequantize_fp8(fp8.quantize_fp8(states), tuple(states.shape), dtype)
        owner, shared = REFERS.get(name, (None, 0))
        segments = within(layouts[prefix + owner], 0, shared) if owner else None
        if owner:  # its prefix: the owner's ids and states (fp8: as decoded)
            ids = torch.cat([reference[prefix + owner]["input_ids"][:shared], ids])
            states = torch.cat([reference[prefix + owner]["hidden_states"][:, :shared], states], dim=1)
        layouts[key] = layout(key, segments, shared, len(ids))
        mask = torch.tensor([(j + i) % 2 for j in range(len(ids))], dtype=torch.uint8) if masked else None
        records.append(encode_sample(key, ids.numpy(), states, LAYERS, codec=sample_codec,
                                     loss_mask=None if mask is None else mask.numpy(), prefix=segments))
        reference[key] = {"input_ids": ids, "hidden_states": states,
                          **({"loss_mask": mask} if mask is not None else {})}
    with Store.create_or_open(path, _meta(codec, str(dtype).removeprefix("torch."))) as store:
        store.put_many(records[:2])  # two commits, as a run makes
        store.put_many(records[2:])
    return reference


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{name: (store, a clean store of other keys to merge into, reference)} and the reference file."""
    root = tmp_path_factory.mktemp("hostile")
    out, reference = {}, {}
    for name, samples, codec, dtype in (("lossless", LOSSLESS, "zstd-planes", torch.bfloat16),
                                        ("fp8", LOSSY, FP8, torch.float32)):
        ref = _build(str(root / name), samples, codec, dtype)
        into_ref = _build(str(root / f"{name}-into"), samples, codec, dtype, prefix="z-", seed=100)
        out[name] = (str(root / name), str(root / f"{name}-into"), ref, list(into_ref))
        reference.update(ref)
        reference.update(into_ref)
    with Store.open(out["lossless"][0]) as store:  # the zstd planes really are zstd frames
        header = store.get("zstd-b").header
        assert header.codec == "zstd-planes"
    torch.save(reference, str(root / "reference.pt"))
    return _Quiet((out, str(root / "reference.pt")))


class _Quiet(tuple):
    """The fixture's value, with a short repr for hypothesis' report of a failing example."""

    def __repr__(self) -> str:
        return "<the base stores>"


# --- regression: the damage first reported, through the real CLI --------------------------------


def _limited(limit: int):
    def preexec():
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return preexec


def _cli(*args: str, limit: int = 4 << 30) -> subprocess.CompletedProcess:
    """`python -m corecap.cli ...` in at most `limit` bytes of address space, promptly: a
    regression fails here instead of taking the machine down."""
    return subprocess.run([sys.executable, "-m", "corecap.cli", *args], capture_output=True, text=True,
                          timeout=LIVENESS_S, preexec_fn=_limited(limit))


def _set_pointer(path: str, key: str, length: int) -> None:
    with lmdb.open(path, max_dbs=4) as env:
        samples = env.open_db(b"samples", create=False)
        with env.begin(write=True) as txn:
            segment, offset, _ = POINTER.unpack(txn.get(key.encode(), db=samples))
            txn.put(key.encode(), POINTER.pack(segment, offset, length), db=samples)


@pytest.mark.parametrize("claim", [1 << 40, 8 << 30], ids=["2^40", "8GiB"])
def test_a_pointer_claiming_huge_states_is_one_line_for_get_and_verify(bases, tmp_path, claim):
    path, _, reference, _ = bases[0]["lossless"]
    store = str(tmp_path / "s")
    shutil.copytree(path, store)
    _set_pointer(store, "zstd-b", claim)
    started = time.monotonic()
    got = _cli("get", "zstd-b", "--store", store)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.splitlines() == [
        f"corecap: error: {store}: sample 'zstd-b': pointer (samples database) claims {claim} bytes, "
        "its header allows at most "
        f"{codecs.max_encoded_bytes(3 * 40 * HIDDEN * 2, 2, 'zstd-planes')}"
    ]
    checked = _cli("verify", "--store", store)
    assert checked.returncode == 1 and checked.stderr == ""
    lines = checked.stdout.splitlines()
    assert lines[0].startswith(f"zstd-b: pointer (samples database) claims {claim} bytes") and len(lines) == 4
    # the samples stored once with zstd-b's prefix cannot be read either, and say why
    assert lines[1:3] == [f"{key}: its prefix comes from sample 'zstd-b', which has problems"
                          for key in ("ref-e", "ref-f")]
    assert lines[3] == f"{store}: 3 of {len(reference)} samples have problems"  # it went on past the damage
    assert time.monotonic() - started < LIVENESS_S
    assert _cli("get", "raw-a", "--store", store).returncode == 0  # the others read as before


def test_a_header_claiming_a_billion_tokens_is_one_line(bases, tmp_path):
    path = bases[0]["lossless"][0]
    store = str(tmp_path / "s")
    shutil.copytree(path, store)
    with lmdb.open(store, max_dbs=4) as env:
        headers = env.open_db(b"headers", create=False)
        with env.begin(write=True) as txn:
            fields = msgspec.msgpack.decode(txn.get(b"raw-a", db=headers))
            fields[1] = 10**9
            txn.put(b"raw-a", msgspec.msgpack.encode(fields), db=headers)
    got = _cli("get", "raw-a", "--store", store)
    assert got.returncode == 2 and len(got.stderr.splitlines()) == 1
    assert f"{store}: sample 'raw-a': header has num_tokens=1000000000 and 28 bytes of input_ids" in got.stderr


# --- the fuzz -------------------------------------------------------------------------------------

SPECIAL_INTS = [0, 1, -1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**53, 2**63 - 1, 2**63, 2**64 - 1, -(2**63),
                10**9]
ints = st.one_of(st.sampled_from(SPECIAL_INTS), st.integers(-(2**63), 2**64 - 1), st.integers(-3, 300))
leaves = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=False), st.text(max_size=8),
                   st.binary(max_size=16))
msgpack_values = st.recursive(
    leaves, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.integers(-(2**70), 2**70),
              st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8,
)
positions = st.integers(0, 1 << 20)  # taken modulo the length of what they damage
byte_damage = st.one_of(
    st.tuples(st.just("flip"), st.lists(st.tuples(positions, st.integers(0, 7)), min_size=1, max_size=4)),
    st.tuples(st.just("cut"), positions),
    st.tuples(st.just("grow"), st.binary(min_size=1, max_size=64)),
    st.tuples(st.just("put"), positions, st.sampled_from([1, 2, 4, 8]), ints),  # an integer written over bytes
    st.tuples(st.just("replace"), st.binary(max_size=64)),
)
sample_index = st.integers(0, 7)  # modulo the number of samples
META_PATHS = ["format_version", "layers", "layer_meaning", "dtype", "hidden_size", "codec", "model", "model.num_layers",
              "model.hidden_size", "model.path", "corecap_version", "extra"]
damage = st.one_of(
    st.tuples(st.just("header-field"), sample_index, st.integers(0, 14), msgpack_values),  # 13: the prefix
    # a reference's segment changed, the header's crc made to match: only the reference checks can tell
    st.tuples(st.just("header-prefix"), sample_index, st.integers(0, 2), st.integers(0, 2),
              st.one_of(ints, st.sampled_from([*LOSSLESS, *LOSSY, "", "x" * 600]))),
    st.tuples(st.just("header-field-delta"), sample_index, st.sampled_from([1, 4, 8, 9, 12]), st.integers(-3, 3)),
    st.tuples(st.just("header-drop-field"), sample_index, st.integers(0, 12)),
    st.tuples(st.just("header-bytes"), sample_index, byte_damage),
    st.tuples(st.just("header-tokens"), sample_index, st.integers(0, 1 << 20)),  # consistent in itself
    st.tuples(st.just("pointer-field"), sample_index, st.integers(0, 2), ints),
    st.tuples(st.just("pointer-bytes"), sample_index, byte_damage),
    st.tuples(st.just("pointer-other"), sample_index, sample_index),
    st.tuples(st.just("end-field"), st.integers(0, 1), ints),
    st.tuples(st.just("end-bytes"), byte_damage),
    st.tuples(st.just("end-delete")),
    st.tuples(st.just("meta-set"), st.sampled_from(META_PATHS), json_values),
    st.tuples(st.just("meta-delete"), st.sampled_from(META_PATHS)),
    st.tuples(st.just("meta-bytes"), byte_damage),
    st.tuples(st.just("meta-record"), st.sampled_from(["delete", "deep", "not-json"])),
    st.tuples(st.just("states-bytes"), sample_index, byte_damage),
    st.tuples(st.just("states-file"),
              st.sampled_from(["cut", "grow", "missing", "directory", "fifo", "dev-zero", "empty"]), positions),
    st.tuples(st.just("record-delete"), st.sampled_from([b"headers", b"samples"]), sample_index),
    st.tuples(st.just("record-rename"), sample_index, st.binary(min_size=1, max_size=12)),
    st.tuples(st.just("record-orphan"), st.sampled_from([b"headers", b"samples"]), st.binary(min_size=1, max_size=12),
              st.binary(max_size=40)),
)


def _damage_bytes(data: bytes, how) -> bytes:
    kind = how[0]
    if kind == "flip":
        out = bytearray(data)
        for pos, bit in how[1]:
            if out:
                out[pos % len(out)] ^= 1 << bit
        return bytes(out)
    if kind == "cut":
        return data[: how[1] % (len(data) + 1)]
    if kind == "grow":
        return data + how[1]
    if kind == "put":
        _, pos, width, value = how
        packed = (value % (1 << (8 * width))).to_bytes(width, "little")
        pos = pos % (len(data) + 1)
        return data[:pos] + packed + data[pos + width :]
    return how[1]  # replace


def _apply(store: str, mutation) -> None:
    """One mutation of the store at `store`, with raw LMDB writes and file edits."""
    kind = mutation[0]
    if kind.startswith("states-file"):
        return _damage_state_file(store, mutation[1], mutation[2])
    with lmdb.open(store, max_dbs=4, sync=False, map_size=1 << 30) as env:
        dbs = {name: env.open_db(name, create=False) for name in (b"meta", b"headers", b"samples")}
        with env.begin(write=True) as txn:
            keys = sorted(bytes(k) for k in txn.cursor(db=dbs[b"headers"]).iternext(values=False)) or [b"none"]
            key = (keys[mutation[1] % len(keys)]
                   if kind[:6] in ("header", "pointe", "states") or kind == "record-rename" else None)
            if kind.startswith("header"):
                value = txn.get(key, db=dbs[b"headers"])
                if value is not None:
                    txn.put(key, _damage_header(value, mutation), db=dbs[b"headers"])
            elif kind.startswith("pointer"):
                value = txn.get(key, db=dbs[b"samples"])
                if value is not None:
                    if kind == "pointer-other":
                        value = txn.get(keys[mutation[2] % len(keys)], db=dbs[b"samples"]) or value
                    txn.put(key, _damage_struct(value, POINTER, mutation), db=dbs[b"samples"])
            elif kind.startswith("end"):
                value = txn.get(b"states_end", db=dbs[b"meta"])
                if kind == "end-delete":
                    txn.delete(b"states_end", db=dbs[b"meta"])
                elif value is not None:
                    txn.put(b"states_end",
                            _damage_struct(value, END, ("end", None, *mutation[1:]) if kind == "end-field"
                                           else ("end", None, mutation[1])),
                            db=dbs[b"meta"])
            elif kind.startswith("meta"):
                _damage_meta(txn, dbs[b"meta"], mutation)
            elif kind == "states-bytes":
                pointer = txn.get(key, db=dbs[b"samples"])
                if pointer is not None and len(pointer) == POINTER.size:
                    _damage_states(store, pointer, mutation[2])
            elif kind == "record-delete":
                txn.delete(keys[mutation[2] % len(keys)], db=dbs[mutation[1]])
            elif kind == "record-rename":
                new = mutation[2]
                for db in (b"headers", b"samples"):
                    value = txn.get(key, db=dbs[db])
                    txn.delete(key, db=dbs[db])
                    if value is not None:
                        txn.put(new, value, db=dbs[db])
            elif kind == "record-orphan":
                txn.put(mutation[2], mutation[3], db=dbs[mutation[1]])


def _damage_header(value: bytes, mutation) -> bytes:
    kind = mutation[0]
    if kind == "header-bytes":
        return _damage_bytes(value, mutation[2]) or b"\xc0"
    try:
        fields = msgspec.msgpack.decode(value)
    except msgspec.DecodeError:  # damaged by an earlier mutation
        return value
    if not isinstance(fields, list) or not fields:
        return value
    if kind == "header-field":
        index = mutation[2]
        fields = fields + [None] * (index + 1 - len(fields)) if index >= len(fields) else fields
        fields[index] = mutation[3]
    elif kind == "header-field-delta":
        index = mutation[2]
        if index < len(fields) and isinstance(fields[index], int) and not isinstance(fields[index], bool):
            fields[index] += mutation[3] or 1
    elif kind == "header-drop-field":
        del fields[mutation[2] % len(fields)]
    elif kind == "header-prefix":
        try:
            header = decode_header("k", value)
        except CorecapError:  # damaged by an earlier mutation
            return value
        if not header.prefix:
            return value
        segments = [list(msgspec.structs.astuple(x)) for x in header.prefix]
        _, _, which, field, new = mutation
        segment = segments[which % len(segments)]
        segment[field] = new if isinstance(new, str) == (field == 0) else segment[field]
        header = msgspec.structs.replace(header, prefix=tuple(Segment(*x) for x in segments))
        return msgspec.msgpack.encode(msgspec.structs.replace(header, header_crc=header_crc(header)))
    elif kind == "header-tokens":  # a crafted header, consistent in itself and checksummed: T tokens
        try:
            header = decode_header("k", value)
        except CorecapError:  # damaged by an earlier mutation
            return value
        ids = np.arange(mutation[2], dtype="<i4")
        header = msgspec.structs.replace(
            header, num_tokens=len(ids), input_ids=ids.tobytes(), input_fingerprint=input_fingerprint(ids),
            payload_bytes=len(header.layers) * len(ids) * header.hidden_size * DTYPES[header.dtype].itemsize,
            loss_mask=None if header.loss_mask is None else bytes(len(ids)),
        )
        return msgspec.msgpack.encode(msgspec.structs.replace(header, header_crc=header_crc(header)))
    return msgspec.msgpack.encode(fields)


def _damage_struct(value: bytes, layout: struct.Struct, mutation) -> bytes:
    if mutation[0] in ("pointer-bytes",) or mutation[0] == "end" and not isinstance(mutation[2], int):
        return _damage_bytes(value, mutation[2])
    if mutation[0] == "pointer-other":
        return value
    if len(value) != layout.size:
        return value
    fields = list(layout.unpack(value))
    index, number = mutation[2] % len(fields), mutation[3]
    fields[index] = number % (1 << (8 * struct.calcsize("<" + layout.format[1 + index])))
    return layout.pack(*fields)


def _damage_meta(txn, meta_db, mutation) -> None:
    kind = mutation[0]
    raw = txn.get(b"store", db=meta_db)
    if kind == "meta-record":
        if mutation[1] == "delete":
            txn.delete(b"store", db=meta_db)
        else:
            txn.put(b"store", b"[" * 100_000 + b"]" * 100_000 if mutation[1] == "deep" else b"\xff\xfe not json",
                    db=meta_db)
        return
    if raw is None:
        return
    if kind == "meta-bytes":
        txn.put(b"store", _damage_bytes(raw, mutation[1]) or b" ", db=meta_db)
        return
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):  # damaged by an earlier mutation
        return
    where, name = ((meta.get("model"), mutation[1].split(".")[1]) if mutation[1].startswith("model.")
                   else (meta, mutation[1]))
    if not isinstance(meta, dict) or not isinstance(where, dict):
        return
    if kind == "meta-set":
        where[name] = mutation[2]
    else:
        where.pop(name, None)
    txn.put(b"store", json.dumps(meta).encode(), db=meta_db)


def _damage_states(store: str, pointer: bytes, how) -> None:
    segment, offset, length = POINTER.unpack(pointer)
    path = segment_path(store, segment)
    if not os.path.isfile(path) or offset + length > os.path.getsize(path):  # a pointer damaged earlier
        return
    with open(path, "r+b") as f:
        f.seek(offset)
        original = f.read(length)
        damaged = _damage_bytes(original, how)
        f.seek(offset)
        f.write(damaged.ljust(len(original), b"\x00") if how[0] == "cut" else damaged)  # may run into the next sample


def _damage_state_file(store: str, how: str, n: int) -> None:
    path = segment_path(store, 0)
    if os.path.islink(path) or not os.path.isfile(path):  # replaced by an earlier mutation
        return
    if how == "cut":
        os.truncate(path, n % (os.path.getsize(path) + 1))
    elif how == "grow":
        with open(path, "ab") as f:
            f.write(bytes(n % 4096 + 1))
    elif how == "empty":
        os.truncate(path, 0)
    else:
        os.unlink(path)
        if how == "directory":
            os.mkdir(path)
        elif how == "fifo":
            os.mkfifo(path)
        elif how == "dev-zero":
            os.symlink("/dev/zero", path)


class Worker:
    """tests/support/hostile_readers.py in a child process: one JSON line out, one back, within LIVENESS_S."""

    def __init__(self, reference: str, log: str):
        self.log = open(log, "w+")
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        self.proc = subprocess.Popen([sys.executable, WORKER, reference], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)

    def ask(self, line: dict) -> dict:
        self.proc.stdin.write(json.dumps(line) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], LIVENESS_S)
        reply = self.proc.stdout.readline() if ready else ""
        if not reply:
            self.proc.kill()
            self.log.seek(0)
            raise AssertionError(
                f"the readers {'died (' + str(self.proc.wait()) + ')' if ready else f'took over {LIVENESS_S} s'}: "
                f"{self.log.read()[-3000:]}"
            )
        return json.loads(reply)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        self.log.close()


def _store_bytes(path: str) -> int:
    return sum(os.lstat(os.path.join(path, name)).st_size for name in os.listdir(path))


FORGEABLE = ("wrong: input_ids", "wrong: loss_mask")


def _check_results(store: str, keys: list[str], results: dict, forged: bool = False) -> None:
    """What every reader must do with any store: the right data or one line naming the store.
    `forged`: a header was rewritten consistent in itself (header-tokens); when its token count
    is its states' own, no reader can tell, and its ids and mask read back as forged."""
    for name, result in results.items():
        assert "crash" not in result, f"{name} crashed:\n{result['crash']}"
        error = result.get("error")
        if error is not None:
            assert "\n" not in error and error.strip() == error, f"{name}: not one line: {error!r}"
            assert store in error or name.startswith("merge"), f"{name}: {error!r} does not name the store"
            assert "do not fit in memory" not in error, f"{name}: {error}"
    get = results["get"].get("ok")
    for reader in ("get", "dataset"):
        for key, outcome in (results[reader].get("ok") or {}).items():
            assert not outcome.startswith("wrong") or forged and outcome in FORGEABLE, f"{reader} {key}: {outcome}"
            if outcome.startswith("error"):
                assert "\n" not in outcome and store in outcome and "do not fit in memory" not in outcome, (
                    f"{reader}: {outcome}"
                )
    dataset = results["dataset"].get("ok")
    if get is not None and dataset is not None:  # StoreDataset reads what Store.get reads
        assert ({k: v.startswith("right") for k, v in get.items()}
                == {k: v.startswith("right") for k, v in dataset.items()})
    exported = results["export"].get("ok")
    assert all(v == "right" or forged and v == "wrong: exported states or ids" for v in (exported or {}).values()), (
        f"export: {exported}"
    )
    verify = results["verify"].get("ok")
    if get is not None and verify is not None and not verify["store_problems"]:
        for key in keys:  # verify reports exactly the samples get cannot read
            if f"no sample with key {key!r}" in get[key]:
                continue  # gone (deleted or renamed): verify may still see its orphaned states
            assert get[key].startswith("error") == (key in verify["problems"]), (
                f"{key}: get {get[key]!r}, verify {verify['problems'].get(key)}"
            )
    for name in ("merge", "merge_into"):
        merged = results[name].get("ok")
        assert not (merged or {}).get("left_behind") and not (merged or {}).get("changed"), f"{name}: {merged}"
        if merged is not None:
            assert all(v == "right" or "no sample with key" in v or forged and v in FORGEABLE
                       for v in merged["get"].values()), f"{name}: {merged['get']}"
            assert not merged["verify"]["problems"] and not merged["verify"]["store_problems"], (
                f"{name}: {merged['verify']}"
            )


@pytest.fixture(scope="module")
def worker(bases, tmp_path_factory):
    stores, reference = bases
    w = Worker(reference, str(tmp_path_factory.mktemp("worker") / "stderr"))
    scratch = str(tmp_path_factory.mktemp("warm"))
    for _ in range(3):  # warm: every reader on every clean store, then the worker's peak is the baseline
        for name, (path, into, reference, into_keys) in stores.items():
            fresh = os.path.join(scratch, "into")
            shutil.rmtree(fresh, ignore_errors=True)
            shutil.copytree(into, fresh)
            shutil.rmtree(os.path.join(scratch, "merged"), ignore_errors=True)
            reply = w.ask({"store": path, "keys": list(reference), "scratch": scratch, "into": fresh,
                           "into_keys": into_keys})
            _check_results(path, list(stores[name][2]), reply["results"])
            assert all(v == "right" for v in reply["results"]["get"]["ok"].values()), reply
            assert reply["results"]["verify"]["ok"]["problems"] == {}
    w.baseline_rss = reply["maxrss"]
    assert w.ask({"limit_as": reply["vm_peak"] + AS_ALLOWANCE})["limited"]
    yield w
    w.close()


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(base=st.sampled_from(["lossless", "fp8"]), mutations=st.lists(damage, min_size=1, max_size=3))
def test_every_reader_survives_every_damage(bases, worker, tmp_path_factory, base, mutations):
    stores, _ = bases
    path, into, reference, into_keys = stores[base]
    scratch = str(tmp_path_factory.getbasetemp() / "fuzz")
    shutil.rmtree(scratch, ignore_errors=True)
    os.makedirs(scratch)
    store = os.path.join(scratch, "store")
    shutil.copytree(path, store)
    shutil.copytree(into, os.path.join(scratch, "into"))
    for mutation in mutations:
        _apply(store, mutation)
    size = _store_bytes(store)
    reply = worker.ask({"store": store, "keys": list(reference), "scratch": scratch,
                        "into": os.path.join(scratch, "into"), "into_keys": into_keys})
    _check_results(store, list(reference), reply["results"], forged=any(m[0] == "header-tokens" for m in mutations))
    bound = worker.baseline_rss + 10 * size + RSS_ALLOWANCE
    assert reply["maxrss"] <= bound, f"peak RSS {reply['maxrss']} over {bound} (store of {size} bytes)"


# --- what the fuzz draws rarely, or cannot: named cases --------------------------------------------


def _copy(bases, tmp_path, name: str = "lossless") -> str:
    store = str(tmp_path / "s")
    shutil.copytree(bases[0][name][0], store)
    return store


def _edit(store: str, fn) -> None:
    """fn(txn, {name: db}) in one raw LMDB write transaction."""
    with lmdb.open(store, max_dbs=4) as env:
        dbs = {name: env.open_db(name, create=False) for name in (b"meta", b"headers", b"samples")}
        with env.begin(write=True) as txn:
            fn(txn, dbs)


def _one_line(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("corecap: error: "), result.stderr
    return lines[0]


@pytest.mark.parametrize("damage, expected", [
    (lambda txn, dbs: txn.put(b"\xff\xfe-key", txn.get(b"raw-a", db=dbs[b"headers"]), db=dbs[b"headers"]),
     r"key b'\\xff\\xfe-key' \(headers database\) is not UTF-8"),
    (lambda txn, dbs: txn.put(b"store", b'{"format_version": 99}', db=dbs[b"meta"]),
     r"store format version 99, this corecap reads \[2, 3, 4\]"),
    (lambda txn, dbs: txn.put(b"store", b'{"format_version": 3, "layers": "all"}', db=dbs[b"meta"]),
     r"the store's metadata is damaged \("),
    (lambda txn, dbs: txn.put(b"store", b"[" * 100_000, db=dbs[b"meta"]), r"is not a JSON object"),
    (lambda txn, dbs: txn.delete(b"store", db=dbs[b"meta"]), r"not a corecap store \(no corecap metadata\)"),
])
def test_ls_and_info_on_damaged_keys_and_metadata_are_one_line(bases, tmp_path, damage, expected):
    store = _copy(bases, tmp_path)
    _edit(store, damage)
    runner = CliRunner()
    listed = runner.invoke(ls, ["--store", store])
    line = _one_line(listed)
    assert line.startswith(f"corecap: error: {store}: ")
    import re

    assert re.search(expected, line), line
    if "UTF-8" not in expected:  # info reads no keys
        assert re.search(expected, _one_line(runner.invoke(info, ["--store", store])))
    else:
        assert runner.invoke(info, ["--store", store]).exit_code == 0


def test_get_of_keys_that_cannot_be_keys_is_one_line(bases, tmp_path):
    from corecap.cli import get

    store = _copy(bases, tmp_path)
    for key in ("", "k" * 600):
        line = _one_line(CliRunner().invoke(get, [key, "--store", store]))
        assert "no sample with key" in line and "a key is 1 to 511 bytes" in line


@pytest.mark.parametrize("what", ["empty directory", "data.mdb is a directory", "data.mdb is garbage",
                                  "data.mdb is empty", "meta is not a database", "no headers database"])
def test_directories_that_are_not_stores_are_one_line_exit_2(tmp_path, what):
    path = tmp_path / "s"
    path.mkdir()
    if what == "data.mdb is a directory":
        (path / "data.mdb").mkdir()
    elif what == "data.mdb is garbage":
        (path / "data.mdb").write_bytes(os.urandom(3 * 4096))
    elif what == "data.mdb is empty":
        (path / "data.mdb").write_bytes(b"")
    elif what in ("meta is not a database", "no headers database"):
        with lmdb.open(str(path), max_dbs=4) as env:
            if what == "meta is not a database":
                with env.begin(write=True) as txn:
                    txn.put(b"meta", b"plain value")
            else:
                meta = env.open_db(b"meta")
                with env.begin(write=True) as txn:
                    txn.put(b"store", msgspec.json.encode(_meta("raw", "bfloat16")), db=meta)
    from corecap.cli import verify

    for command, args in ((verify, []), (ls, []), (info, [])):
        line = _one_line(CliRunner().invoke(command, ["--store", str(path), *args]))
        assert f"{path}: not a corecap store" in line or f"{path}: cannot open the store's LMDB" in line, line


def test_verify_reports_store_damage_and_goes_on(bases, tmp_path):
    """states_end missing or malformed: every sample is still checked (against its file), the
    store's own problem is listed, and the exit status is 1."""
    from corecap.cli import verify

    for damage in (lambda txn, dbs: txn.delete(b"states_end", db=dbs[b"meta"]),
                   lambda txn, dbs: txn.put(b"states_end", b"\x00" * 7, db=dbs[b"meta"])):
        store = _copy(bases, tmp_path)
        _edit(store, damage)
        result = CliRunner().invoke(verify, ["--store", store])
        assert result.exit_code == 1 and result.stderr == ""
        lines = result.stdout.strip().splitlines()
        assert len(lines) == 2 and "states_end" in lines[0] and lines[0].startswith(f"{store}: ")
        assert lines[1] == f"{store}: 0 of {len(LOSSLESS)} samples have problems; the store itself has 1"
        shutil.rmtree(store)


def test_a_pointer_past_the_committed_end_is_refused(bases, tmp_path):
    """Bytes past states_end belong to no sample (a run killed between its two halves), even when
    they are on disk and hold the right states."""
    store = _copy(bases, tmp_path)

    def cut_after_raw_a(txn, dbs):  # raw-a was written first
        segment, offset, length = POINTER.unpack(txn.get(b"raw-a", db=dbs[b"samples"]))
        assert (segment, offset) == (0, 0)
        txn.put(b"states_end", END.pack(0, length), db=dbs[b"meta"])

    _edit(store, cut_after_raw_a)
    with Store.open(store) as s:
        assert s.get("raw-a").header.num_tokens == 7
        with pytest.raises(CorecapError, match=r"sample 'zstd-b': pointer \(samples database\) names bytes \d+\.\.\d+ "
                                               r"of states-000000.bin, past the committed end "
                                               r"\(byte 1344 of states-000000.bin\): no commit wrote them"):
            s.get("zstd-b")
    report = verify_store(store)
    assert report.store_problems == [] and set(report.problems) == {"zstd-b", "zstd-c", "raw-d", "ref-e", "ref-f"}


def test_a_damaged_lmdb_page_is_one_line_and_verify_reports_it(bases, tmp_path):
    """A damaged page of data.mdb itself (LMDB finds a page of the wrong type): every reader says
    so in one line; verify lists it as the store's problem and exits 1."""
    from corecap.cli import get, verify

    store = _copy(bases, tmp_path)
    with Store.open(store) as s:
        fingerprint = s.get("zstd-b").header.input_fingerprint.encode()
    with open(os.path.join(store, "data.mdb"), "r+b") as f:
        data = bytearray(f.read())
        pages = {i // 4096 for i in range(len(data)) if data.startswith(fingerprint, i)}
        assert pages
        for page in pages:  # every copy of the headers' leaf page: its flags say "no type"
            data[page * 4096 + 10 : page * 4096 + 12] = b"\x00\x00"
        f.seek(0)
        f.write(data)
    runner = CliRunner()
    line = _one_line(runner.invoke(get, ["zstd-b", "--store", store]))
    assert f"{store}: reading sample 'zstd-b', its LMDB is damaged (CorruptedError: " in line
    assert "its LMDB is damaged (CorruptedError" in _one_line(runner.invoke(ls, ["--store", store]))
    result = runner.invoke(verify, ["--store", store])
    assert result.exit_code == 1 and result.stderr == ""
    assert f"{store}: its LMDB is damaged (CorruptedError: " in result.stdout and "were not checked" in result.stdout


def test_state_file_replaced_or_unreadable(bases, tmp_path):
    for how in ("directory", "fifo", "dev-zero"):
        store = _copy(bases, tmp_path)
        _damage_state_file(store, how, 0)
        with Store.open(store) as s:
            with pytest.raises(CorecapError, match="states file states-000000.bin is not a regular file"):
                s.get("raw-a")
        assert set(verify_store(store).problems) == set(LOSSLESS)
        shutil.rmtree(store)


def test_merge_refuses_a_damaged_input_and_leaves_out_as_it_was(bases, tmp_path):
    """merge copies records as stored, so it checks them first (header, pointer, the crc32 over
    the stored bytes): a damaged input refuses the whole merge, naming input, key and field, and
    OUT keeps its LMDB byte for byte and its state files' sizes; a new OUT is not left behind."""
    from corecap.cli import merge
    from corecap.store.merge import merge_stores

    damaged = _copy(bases, tmp_path)
    with Store.open(damaged) as s, s.env.begin() as txn:
        segment, offset, length = POINTER.unpack(txn.get(b"zstd-c", db=s.samples_db))
    with open(segment_path(damaged, segment), "r+b") as f:  # one flipped bit in a zstd plane
        f.seek(offset + length - 3)
        byte = f.read(1)
        f.seek(offset + length - 3)
        f.write(bytes([byte[0] ^ 0x04]))
    into = str(tmp_path / "into")
    shutil.copytree(bases[0]["lossless"][1], into)
    before = {name: open(os.path.join(into, name), "rb").read() for name in ("data.mdb", "states-000000.bin")}
    line = _one_line(CliRunner().invoke(merge, [into, damaged]))
    assert line.startswith(f"corecap: error: {damaged}: sample 'zstd-c': codec 'zstd-planes': checksum mismatch"), line
    assert {name: open(os.path.join(into, name), "rb").read() for name in before} == before
    assert not verify_store(into).problems
    with pytest.raises(CorecapError, match="checksum mismatch"):
        merge_stores(tmp_path / "new", [bases[0]["lossless"][1], damaged])
    assert not os.path.exists(tmp_path / "new")


def test_a_crafted_zstd_frame_cannot_make_decode_allocate_more_than_declared():
    """A zstd-planes container whose crc32 is right but whose plane's frame declares more (or
    less) than the header's size is refused before decompressing; one that declares the right
    size decodes to exactly that."""
    raw = _states(1, 9, torch.bfloat16).view(torch.uint8).numpy().tobytes()
    good = codecs.encode(raw, "bfloat16", "zstd-planes")
    assert bytes(codecs.decode(good, "bfloat16", len(raw), "zstd-planes")) == raw
    import zlib

    import zstandard

    bomb = zstandard.ZstdCompressor().compress(bytes(1 << 30))  # 1 GiB of zeros in ~33 KB
    plane = len(raw) // 2
    head = struct.pack("<4sBBHQI", b"CZP1", 2, 2, 0, len(raw), 0)
    table = struct.pack("<BQ", 1, len(bomb)) + struct.pack("<BQ", 0, plane)
    body = table + bomb + bytes(plane)
    crafted = head[:-4] + struct.pack("<I", zlib.crc32(body)) + body
    with pytest.raises(codecs.CodecError, match=rf"plane 0 declares {1 << 30} bytes, expected {plane}"):
        codecs.decode(crafted, "bfloat16", len(raw), "zstd-planes")
    with pytest.raises(codecs.CodecError, match="buffer holds"):  # the header's size is the bound, not the container's
        codecs.decode(crafted, "bfloat16", 1 << 31, "zstd-planes")


# --- writer.lock and state files: never followed, garbage named as such ---------------------------


def test_writer_lock_holding_garbage_names_no_pid(bases, tmp_path):
    store = _copy(bases, tmp_path)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from corecap.store.segments import _take_lock; _take_lock(sys.argv[1]); "
         "open(sys.argv[1] + '/writer.lock', 'wb').write(bytes(range(256))); print('locked', flush=True); "
         "sys.stdin.read()", store],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(CorecapError, match=r"another process \(pid unknown\) is writing this store"):
            Store.create_or_open(store, _meta("zstd-planes", "bfloat16"))
    finally:
        holder.communicate("", timeout=60)


@pytest.mark.parametrize("name", ["writer.lock", "states-000000.bin"])
def test_a_writer_never_writes_through_a_link(bases, tmp_path, name):
    """A store that travelled may hold a link where its lock or a state file should be: a writer
    refuses it in one line and the file it points at is untouched."""
    store = _copy(bases, tmp_path)
    victim = tmp_path / "precious"
    victim.write_bytes(b"precious bytes, longer than any committed end" * 1000)
    os.unlink(os.path.join(store, name)) if os.path.exists(os.path.join(store, name)) else None
    os.symlink(victim, os.path.join(store, name))
    with pytest.raises(CorecapError) as e:
        with Store.create_or_open(store, _meta("zstd-planes", "bfloat16")) as s:
            s.put_many([encode_sample("new", np.arange(3), _states(9, 3, torch.bfloat16), LAYERS)])
    assert "\n" not in str(e.value) and name in str(e.value)
    assert victim.read_bytes() == b"precious bytes, longer than any committed end" * 1000


def test_writer_lock_that_is_a_directory_is_one_line(bases, tmp_path):
    store = _copy(bases, tmp_path)
    os.unlink(os.path.join(store, "writer.lock"))
    os.mkdir(os.path.join(store, "writer.lock"))
    with pytest.raises(CorecapError, match=r"writer.lock: cannot open the writer lock \(Is a directory\)"):
        Store.create_or_open(store, _meta("zstd-planes", "bfloat16"))


# --- trace.json ------------------------------------------------------------------------------------


def _trace() -> dict:
    steps, chunks, commits, encodes, writes = [], [], [], [], []
    t = 1_000.0
    for i in range(4):
        steps.append({"start": t, "schedule": t + 0.01, "execute": t + 0.05, "sample": t + 0.06, "update": t + 0.07,
                      "end": t + 0.07, "num_tokens": 64, "num_reqs": 2, "finished": [str(i)]})
        chunks.append({"step": i + 1, "num_tokens": 64, "nbytes": 4096, "t_copy": t + 0.04, "t_ready": t + 0.045,
                       "t_recv": t + 0.046, "t_done": t + 0.08})
        encodes.append({"start": t + 0.08, "end": t + 0.09})
        writes.append({"start": t + 0.09, "end": t + 0.095, "num_samples": 1, "nbytes": 2000})
        commits.append({"start": t + 0.095, "end": t + 0.1, "num_samples": 1, "nbytes": 2000})
        t += 0.1
    return {"version": 1, "start": 1_000.0, "end": t + 0.05, "steps": steps, "chunks": chunks, "commits": commits,
            "encodes": encodes, "writes": writes, "workers": [{"rank": 0, "steps": 4, "ring_wait_s": 0.5}]}


def _paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _paths(v, prefix + (i,))


trace_values = st.recursive(
    st.one_of(st.none(), st.booleans(), ints, st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["start", "end", "rank", "steps", "x"]),
                                                                inner, max_size=3),
    max_leaves=6,
)
trace_damage = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10_000), trace_values),
    st.tuples(st.just("delete"), st.integers(0, 10_000)),
    st.tuples(st.just("bytes"), byte_damage),
)


@settings(max_examples=MAX_EXAMPLES // 2, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(trace_damage, min_size=1, max_size=4))
def test_corecap_trace_survives_every_damage(tmp_path, mutations):
    """trace.json edited anywhere (values of any JSON type, NaN and infinities, keys deleted,
    bytes damaged): load_trace refuses it in one line, or the phase table and the Chrome trace are
    made from it without an error."""
    trace, text = _trace(), None
    for kind, *how in mutations:
        if kind == "bytes":
            text = _damage_bytes(text if text is not None else json.dumps(trace).encode(), how[0])
            continue
        if text is not None:
            break  # the file is no longer JSON we can walk
        paths = list(_paths(trace))
        path = paths[how[0] % len(paths)]
        if not path:
            trace = how[1] if kind == "set" else {}
            continue
        parent = trace
        for part in path[:-1]:
            parent = parent[part]
        if kind == "set":
            parent[path[-1]] = how[1]
        else:
            del parent[path[-1]]
    file = tmp_path / "trace.json"
    file.write_bytes(text if text is not None else json.dumps(trace).encode())
    try:
        record = load_trace(str(tmp_path))
    except CorecapError as e:
        assert "\n" not in str(e) and str(file) in str(e) or str(tmp_path) in str(e)
        return
    summarize(record)
    json.dumps(to_chrome(record))


def test_trace_json_that_is_not_a_file_or_not_ours_is_one_line(tmp_path):
    for make, expected in ((lambda p: p.mkdir(), "not a regular file"), (lambda p: os.mkfifo(p), "not a regular file"),
                           (lambda p: p.write_bytes(b"\xff\xfe"), "not valid JSON"),
                           (lambda p: p.write_text("[1, 2]"), "expected a JSON object"),
                           (lambda p: p.write_text("[" * 100_000), "not valid JSON|nested too deep"),
                           (lambda p: p.write_text(json.dumps({**_trace(), "start": float("nan")})),
                            "missing number 'start'"),
                           (lambda p: p.write_text(json.dumps(
                               {**_trace(), "workers": [{"rank": 0, "steps": 1, "ring_wait_s": "x"}]})),
                            "workers\\[0\\]")):
        store = tmp_path / f"s{len(os.listdir(tmp_path))}"
        store.mkdir()
        make(store / "trace.json")
        result = CliRunner().invoke(trace, ["--store", str(store)])
        import re

        assert re.search(expected, _one_line(result)), result.stderr


def test_a_writer_refuses_a_states_end_that_would_cut_committed_states(bases, tmp_path):
    """A writer cuts the state files back to states_end (an interrupted run's tail); a damaged
    states_end before committed states must not make it destroy them."""
    store = _copy(bases, tmp_path)
    size = os.path.getsize(segment_path(store, 0))
    for end in (b"", END.pack(0, 10)):
        _edit(store, lambda txn, dbs: txn.put(b"states_end", end, db=dbs[b"meta"]) if end
              else txn.delete(b"states_end", db=dbs[b"meta"]))
        with pytest.raises(CorecapError, match="no states_end in the meta database|refusing to write"):
            with Store.create_or_open(store, _meta("zstd-planes", "bfloat16")) as s:
                s.put_many([encode_sample("new", np.arange(3), _states(9, 3, torch.bfloat16), LAYERS)])
        assert os.path.getsize(segment_path(store, 0)) == size
    _edit(store, lambda txn, dbs: txn.put(b"states_end", END.pack(0, size), db=dbs[b"meta"]))
    with Store.create_or_open(store, _meta("zstd-planes", "bfloat16")) as s:  # the right end: writing goes on
        s.put_many([encode_sample("new", np.arange(3), _states(9, 3, torch.bfloat16), LAYERS)])
    assert not verify_store(store).problems


def test_a_writer_refuses_a_state_file_cut_short(bases, tmp_path):
    store = _copy(bases, tmp_path)
    os.truncate(segment_path(store, 0), 100)
    with pytest.raises(CorecapError, match=r"states_end \(meta database\) says byte \d+ of states-000000.bin, "
                                           r"which has 100: the state file was cut short"):
        with Store.create_or_open(store, _meta("zstd-planes", "bfloat16")) as s:
            s.put_many([encode_sample("new", np.arange(3), _states(9, 3, torch.bfloat16), LAYERS)])
    assert os.path.getsize(segment_path(store, 0)) == 100


@pytest.mark.parametrize("edit", [
    lambda t: t["steps"][1].update(end=2**53),  # the largest number a trace may hold
    lambda t: t.update(start=-(2**53)),
    lambda t: t.update(steps=[], chunks=[]),
    lambda t: (t["steps"][0].update(execute=-5), t["commits"][0].update(end=0)),  # phases that end before they start
    lambda t: t.update(end=t["start"]),  # no wall time
])
def test_trace_with_extreme_but_valid_numbers_prints_and_draws(tmp_path, edit):
    record = _trace()
    edit(record)
    (tmp_path / "trace.json").write_text(json.dumps(record))
    result = CliRunner().invoke(trace, ["--store", str(tmp_path), "--chrome", str(tmp_path / "c.json"),
                                        "--plot", str(tmp_path / "t.png")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "c.json").read_text())["traceEvents"] and (tmp_path / "t.png").stat().st_size > 0
