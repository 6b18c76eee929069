"""The sink process's CPU work, piece by piece, on the CPU it runs on:

  check        the writer's NaN/Inf check of one sample (4 layers x 1,024 tokens x 4,096, one
               torch thread as in the sink): torch.isfinite(x).all() vs writer.all_finite(x)
  encode       the writer's whole encode of that sample (check + zstd-planes + checksum)
  fp8          fp8 per sample of 4 x 256 x 2,048 and 4 x 1,024 x 4,096 bf16: quantize_fp8, the
               writer's whole encode (Writer._encode_checked) and dequantize_fp8
  parts        the pieces of that zstd-planes encode: check, checksum of the states, byte-plane
               split, each plane's compression, the codec's own checksum
  scaling      K threads encoding samples at once (`--encoders`): samples/s and ms per sample,
               to see how many encode threads the machine's cores and memory carry
  scaling-1b   the same for Llama-3.2-1B's 256-token samples (4 x 256 x 2,048 bf16), the
               writer's zstd-planes encode and its fp8 one
  reassembly   the collector's take() of one 16,384-token chunk (4 x 4,096 bf16, 537 MB) into
               16 samples of 1,024 tokens, into fresh vs reused buffers (collect.BufferPool),
               with one copy thread and with the sink's number (sink.copy_threads)
  contention   that take() while K threads encode samples as the writer does: as before
               (torch's default intra-op threads, serial copies) and as the sink runs now
               (one intra-op thread, the sink's copy threads); copy times, encoders' samples/s

    python -m tools.bench.sink [--repeat 5] [--encoders 0,1,2] [--only check,encode,parts,scaling,decode,...]
"""

from __future__ import annotations

import argparse
import platform
import threading
import time
import types

import numpy as np
import torch

from corecap.sink import process as sink
from corecap.store import codec, fp8
from corecap.transport import wire
from corecap.sink.collect import BufferPool, Collector
from corecap.store import FP8, encode_sample
from corecap.sink.writer import Writer, all_finite

LAYERS, HIDDEN, SAMPLE, SAMPLES = 4, 4096, 1024, 16
LAYER_IDS = (2, 16, 29, 32)
FP8_SHAPES = ((4, 256, 2048), (4, 1024, 4096))  # Llama-3.2-1B's 256-token samples; the 8B shape above


def timed(fn, repeat: int, clock=time.perf_counter) -> list[float]:
    fn()  # warm: allocator, zstd contexts
    out = []
    for _ in range(repeat):
        t = clock()
        fn()
        out.append(clock() - t)
    return sorted(out)


def ms(times: list[float]) -> str:
    return f"median {times[len(times) // 2] * 1e3:6.1f} ms (min {times[0] * 1e3:.1f}, max {times[-1] * 1e3:.1f})"


def encode(sample: torch.Tensor, ids: np.ndarray, check=all_finite) -> None:
    """What Writer._encode_checked does for a finite sample."""
    assert check(sample)
    encode_sample("k", ids, sample, LAYER_IDS, codec="zstd-planes")


def bench_check(repeat: int) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(LAYERS, SAMPLE, HIDDEN).to(dtype)
        mask = timed(lambda: bool(torch.isfinite(x).all()), repeat)
        fast = timed(lambda: all_finite(x), repeat)
        print(f"check {str(dtype):15s} isfinite().all() {ms(mask)}   all_finite {ms(fast)}")


def bench_encode(repeat: int) -> None:
    x = torch.randn(LAYERS, SAMPLE, HIDDEN).bfloat16()
    ids = np.arange(SAMPLE, dtype=np.int32)
    old = timed(lambda: encode(x, ids, lambda s: bool(torch.isfinite(s).all())), repeat)
    new = timed(lambda: encode(x, ids), repeat)
    print(f"encode one bf16 sample ({x.nbytes / 1e6:.0f} MB): "
          f"with isfinite().all() {ms(old)}   with all_finite {ms(new)}")


def bench_parts(repeat: int) -> None:
    x = torch.randn(LAYERS, SAMPLE, HIDDEN).bfloat16()
    raw = x.view(torch.uint8).numpy().reshape(-1)
    planes = codec._split_planes(raw, 2)
    parts = [("check (all_finite)", lambda: all_finite(x)), ("checksum of the states", lambda: codec.crc32(raw)),
             ("byte-plane split", lambda: codec._split_planes(raw, 2))]
    parts += [(f"plane {k} compression", lambda k=k: codec._compress_plane(planes[k])) for k in range(2)]
    payloads = [codec._compress_plane(p)[1] for p in planes]
    parts.append(("codec checksum", lambda: [codec.crc32(p) for p in payloads]))
    parts.append(("whole encode", lambda: encode(x, np.arange(SAMPLE, dtype=np.int32))))
    for name, fn in parts:
        print(f"encode part, one bf16 sample ({x.nbytes / 1e6:.0f} MB): {name:<24} {ms(timed(fn, repeat))}")


def bench_scaling(encoders: list[int], seconds: float = 2.0, shape=(LAYERS, SAMPLE, HIDDEN), fp8: bool = False) -> None:
    sample = torch.randn(shape).bfloat16()
    ids = np.arange(shape[1], dtype=np.int32)
    writer = types.SimpleNamespace(layers=LAYER_IDS, codec=FP8, nonfinite="stop", flagged=[])
    if fp8:
        work = lambda: Writer._encode_checked(writer, "k", ids, sample, None, None)  # noqa: E731
    else:
        work = lambda: encode(sample, ids)  # noqa: E731
    what = f"{'fp8' if fp8 else 'zstd-planes'} {'x'.join(map(str, shape))}"
    for k in encoders:
        if k < 1:
            continue
        stop, times = threading.Event(), [[] for _ in range(k)]

        def encoder(mine: list) -> None:
            while not stop.is_set():
                t = time.perf_counter()
                work()
                mine.append((t, time.perf_counter()))

        start = time.perf_counter()
        threads = [threading.Thread(target=encoder, args=(times[i],), daemon=True) for i in range(k)]
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        end = time.perf_counter()
        for t in threads:
            t.join()
        inside = [b for mine in times for _, b in mine if b <= end]  # not those finishing after
        every = sorted(b - a for mine in times for a, b in mine)
        print(f"scaling {what}: {k:2d} encoder thread(s): {len(inside) / (end - start):6.1f} samples/s, "
              f"per sample {ms(every)}")


def bench_fp8(repeat: int) -> None:
    """fp8 per sample, one thread: quantize alone, the writer's whole encode of a sample (what its
    pool threads run: the NaN/Inf check, quantize, checksum, header) and the decode."""
    for shape in FP8_SHAPES:
        x = torch.randn(shape).bfloat16()
        x[..., :1] *= 300  # an outlier channel, as in real residual streams
        ids = np.arange(shape[1], dtype=np.int32)
        writer = types.SimpleNamespace(layers=LAYER_IDS, codec=FP8, nonfinite="stop", flagged=[])
        payload = fp8.quantize_fp8(x)
        runs = {
            "quantize": lambda: fp8.quantize_fp8(x),
            "writer encode": lambda: Writer._encode_checked(writer, "k", ids, x, None, None),
            "dequantize": lambda: fp8.dequantize_fp8(payload, shape, torch.bfloat16),
        }
        for name, fn in runs.items():
            # this thread's CPU time too: on a shared machine the wall clock counts other work
            wall, cpu = timed(fn, repeat), timed(fn, repeat, time.thread_time)
            print(f"fp8 {'x'.join(map(str, shape))} bf16 ({x.nbytes / 1e6:.0f} MB): {name:<14} "
                  f"wall {ms(wall)}; CPU {ms(cpu)}")


def chunk(step: torch.Tensor) -> wire.DecodedChunk:
    """One worker chunk holding SAMPLES whole samples of SAMPLE tokens."""
    segments = tuple(wire.Segment(str(i), SAMPLE) for i in range(SAMPLES))
    positions = np.tile(np.arange(SAMPLE, dtype=np.int32), SAMPLES)
    header = wire.Chunk(
        version=wire.WIRE_VERSION, rank=0, step=0, dtype="bfloat16", layers=LAYER_IDS, hidden_size=HIDDEN,
        num_tokens=SAMPLES * SAMPLE, segments=segments, crcs=wire.checksums(segments, positions, positions, step),
    )
    return wire.DecodedChunk(header, positions.copy(), positions, step)


def reassemble(collector: Collector, msg: wire.DecodedChunk, done: list) -> float:
    """The collector's whole take() of one chunk (checks, copies, hand-over), in seconds."""
    ids = np.arange(SAMPLE, dtype=np.int32)
    for seg in msg.header.segments:
        collector.expect(seg.req_id, seg.req_id, ids)
    t = time.perf_counter()
    collector.take(msg, t)
    seconds = time.perf_counter() - t
    for states in done:
        if collector.buffers:
            collector.buffers.give(states)
    done.clear()
    return seconds


def collector(pool: bool, threads: int, done: list) -> Collector:
    return Collector(LAYER_IDS, lambda p: done.append(p.states), BufferPool(2 << 30) if pool else None,
                     copy_threads=threads)


def bench_reassembly(step: torch.Tensor, repeat: int, threads: int) -> None:
    msg, done = chunk(step), []
    for copy_threads in sorted({1, threads}):
        fresh, reused = collector(False, copy_threads, done), collector(True, copy_threads, done)
        reassemble(reused, msg, done)  # fills the pool
        a = sorted(reassemble(fresh, msg, done) for _ in range(repeat))
        b = sorted(reassemble(reused, msg, done) for _ in range(repeat))
        print(f"reassembly of {step.nbytes / 1e6:.0f} MB, {copy_threads} copy thread(s): "
              f"fresh buffers {ms(a)}   reused {ms(b)}")
        fresh.close(), reused.close()


def decode_chunk(num_requests: int, position: int) -> wire.DecodedChunk:
    """One decode step's chunk: a token for each of `num_requests` requests, at `position`."""
    segments = tuple(wire.Segment(str(i), 1) for i in range(num_requests))
    states = torch.randn(LAYERS, num_requests, HIDDEN).bfloat16()
    ids = np.full(num_requests, 7, dtype=np.int32)
    positions = np.full(num_requests, position, dtype=np.int32)
    header = wire.Chunk(
        version=wire.WIRE_VERSION, rank=0, step=0, dtype="bfloat16", layers=LAYER_IDS, hidden_size=HIDDEN,
        num_tokens=num_requests, segments=segments, crcs=wire.checksums(segments, ids, positions, states),
    )
    return wire.DecodedChunk(header, ids, positions, states)


def bench_decode(repeat: int, threads: int, num_requests: int = 400, position: int = 1023) -> None:
    """take() of decode steps: one token for each of `num_requests` samples being generated
    (`corecap run --max-tokens`), each sample's buffer made by its first chunk."""
    msg = decode_chunk(num_requests, position)
    for copy_threads in sorted({1, threads}):
        c = collector(True, copy_threads, [])
        for seg in msg.header.segments:
            c.expect(seg.req_id, seg.req_id, np.full(position, 7, dtype=np.int32), None, None, max_new=512)
        c.take(msg, 0.0)  # the buffers
        seconds = []
        for _ in range(repeat):
            for p in c.pending.values():
                p.covered[:] = False
                p.num_covered = 0
            t = time.perf_counter()
            c.take(msg, t)
            seconds.append(time.perf_counter() - t)
        print(f"decode step of {num_requests} requests x {LAYERS} layers x {HIDDEN} bf16, {copy_threads} copy "
              f"thread(s): take {ms(sorted(seconds))} ({min(seconds) / num_requests * 1e3:.3f} ms a request at best)")
        c.close()


def bench_contention(step: torch.Tensor, repeat: int, encoders: list[int], default_threads: int, threads: int) -> None:
    sample = torch.randn(LAYERS, SAMPLE, HIDDEN).bfloat16()
    ids = np.arange(SAMPLE, dtype=np.int32)
    msg, done = chunk(step), []
    for torch_threads, copy_threads in ((default_threads, 1), (1, threads)):  # before, and as the sink runs now
        torch.set_num_threads(torch_threads)
        reused = collector(True, copy_threads, done)
        reassemble(reused, msg, done)
        for k in encoders:
            stop, encoded = threading.Event(), [0]

            def encoder() -> None:
                while not stop.is_set():
                    encode(sample, ids)
                    encoded[0] += 1

            pool_threads = [threading.Thread(target=encoder, daemon=True) for _ in range(k)]
            for t in pool_threads:
                t.start()
            time.sleep(0.5)  # every encoder under way
            start, before = time.perf_counter(), encoded[0]
            copies = sorted(reassemble(reused, msg, done) for _ in range(repeat))
            rate = (encoded[0] - before) / (time.perf_counter() - start)
            stop.set()
            for t in pool_threads:
                t.join()
            print(
                f"contention: {torch_threads} torch thread(s), {copy_threads} copy thread(s), {k} encoder(s): "
                f"reassembly {ms(copies)}; encoders {rate:5.1f} samples/s"
            )
        reused.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--encoders", default="0,1,2", help="encoder thread counts for the contention runs")
    ap.add_argument("--only", default="check,encode,fp8,parts,reassembly,decode,contention,scaling")
    args = ap.parse_args()
    parts = set(args.only.split(","))
    default_threads = torch.get_num_threads()
    print(f"{platform.node()}: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"default intra-op threads {default_threads}")
    if parts & {"reassembly", "contention"}:
        step = torch.randn(LAYERS, SAMPLES * SAMPLE, HIDDEN).bfloat16()
    torch.set_num_threads(1)  # as in the sink
    threads = sink.copy_threads()
    if "reassembly" in parts:
        bench_reassembly(step, args.repeat, threads)
    if "decode" in parts:
        bench_decode(args.repeat, threads)
    if "contention" in parts:
        bench_contention(step, args.repeat, [int(k) for k in args.encoders.split(",")], default_threads, threads)
        torch.set_num_threads(1)
    if "check" in parts:
        bench_check(args.repeat)
    if "encode" in parts:
        bench_encode(args.repeat)
    if "fp8" in parts:
        bench_fp8(args.repeat)
    if "parts" in parts:
        bench_parts(args.repeat)
    if "scaling" in parts:
        bench_scaling([int(k) for k in args.encoders.split(",")])
    if "scaling-1b" in parts:
        for fp8 in (False, True):
            bench_scaling([int(k) for k in args.encoders.split(",")], shape=FP8_SHAPES[0], fp8=fp8)


if __name__ == "__main__":
    main()
