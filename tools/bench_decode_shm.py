"""Where a DataLoader worker's time goes for one EAGLE-3-sized sample (4 x 2,048 x 4,096 bf16,
67 MB; zstd-planes 44.7 MB), one thread, best and median of 5: a copy into fresh numpy memory
against one into fresh shared memory (what torch's pickler makes every worker-returned tensor
go through, for StoreDataset and speculators' files alike), the CRC-32s, corecap's decode,
`codec.decode_into` into memory already touched (what StoreDataset's workers do), and the
prototype of that: a chunked decode (both planes streamed 256 KiB at a time, joined and CRC'd
while in cache) into warm, fresh and shared memory. A measurement for issue 15, not a reader.

    PYTHONPATH=$PWD python3 tools/bench_decode_shm.py
"""
import ctypes
import io
import time

import numpy as np
import torch
import zstandard

from corecap.store import codec
from corecap.store.codec import crc32
torch.set_num_threads(1)
x = (torch.randn(4, 2048, 4096) * 3).to(torch.bfloat16)
raw = x.view(torch.uint8).numpy().reshape(-1)
N = raw.nbytes
enc = codec.encode(raw, "bfloat16", "zstd-planes")
print("enc MB", len(enc)/1e6, "raw MB", N/1e6)
def best(fn, n=5):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
    return f"{min(ts)*1e3:.1f} ms (med {sorted(ts)[n//2]*1e3:.1f})"
libc = ctypes.CDLL("libc.so.6", use_errno=True)
def fresh_fill():
    a = np.empty(N, np.uint8); a[:] = raw
def fresh_shared(populate: bool) -> np.ndarray:
    """N bytes of fresh shared memory (as torch's pickler allocates it), its pages populated for
    writing first (madvise MADV_POPULATE_WRITE, 23) when `populate`."""
    t = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(N))
    if populate:
        r = libc.madvise(ctypes.c_void_p(t.data_ptr() & ~4095), ctypes.c_size_t(N), 23)
        assert r == 0, ctypes.get_errno()
    return t.numpy()
def shm_fill(populate=False):
    fresh_shared(populate)[:] = raw
warm = np.empty(N, np.uint8); warm[:] = 1
print("memcpy warm", best(lambda: np.copyto(warm, raw)))
print("fresh np + copy", best(fresh_fill))
print("shm + copy", best(lambda: shm_fill(False)))
print("shm + populate + copy", best(lambda: shm_fill(True)))
print("crc32 raw", best(lambda: crc32(raw)))
print("crc32 enc", best(lambda: crc32(enc)))
print("decode current", best(lambda: codec.decode(enc, "bfloat16", N, "zstd-planes")))
print("decode + crc32 (what a reader did before decode_into)", best(lambda: crc32(codec.decode(enc, "bfloat16", N, "zstd-planes"))))
touched = np.ones(N, np.uint8)
print("decode_into memory already touched (a reused pool slot), crc32 included", best(lambda: codec.decode_into(enc, "bfloat16", N, "zstd-planes", touched)))
planes = codec.check_planes(enc, "bfloat16", N)
print("check_planes (crc)", best(lambda: codec.check_planes(enc, "bfloat16", N)))
dctx = zstandard.ZstdDecompressor()
print("methods", [m for m,p in planes]); print("zstd planes whole", best(lambda: [dctx.decompress(p, max_output_size=N//2) for m,p in planes if m==1]))
CH = 1 << 18
def chunked(out):
    d16 = out.view("<u2")
    n = N // 2
    rs = [dctx.stream_reader(p) if m == 1 else io.BytesIO(p) for m, p in planes]
    sc = [np.empty(CH, np.uint8) for _ in rs]
    c = 0
    for s in range(0, n, CH):
        m = min(CH, n - s)
        for r, b in zip(rs, sc):
            mv = memoryview(b)[:m]; got = 0
            while got < m:
                k = r.readinto(mv[got:])
                assert k
                got += k
        d = d16[s:s+m]
        np.left_shift(sc[1][:m], 8, out=d, dtype=np.uint16)
        np.bitwise_or(d, sc[0][:m], out=d)
        c = crc32(d, c)
    return c
o = np.empty(N, np.uint8)
print("chunked into warm", best(lambda: chunked(o)))
assert (o == raw).all() and chunked(o) == crc32(raw)
def chunked_shm(populate):
    chunked(fresh_shared(populate))
print("chunked into shm", best(lambda: chunked_shm(False)))
print("chunked into shm+populate", best(lambda: chunked_shm(True)))
print("chunked into fresh np", best(lambda: chunked(np.empty(N, np.uint8))))
