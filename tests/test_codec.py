"""Tests for corecap.store.codec: lossless round trips are bit-exact, damage is a ValueError, fp8 keeps
its stated error bound. The reference is the input itself (bytes) or the bound derived from
e4m3's 3 mantissa bits, never the codec's own output."""

from __future__ import annotations

import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from corecap.store import codec
from corecap.store import fp8
from corecap.store.codec import CODECS, decode, encode, encode_parts
from corecap.store.fp8 import dequantize_fp8, quantize_fp8
from support import fuzz

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LOSSLESS = [c for c in CODECS]
SHAPES = [(1, 1, 1), (1, 1, 7), (3, 5, 33), (2, 17, 129), (1, 0, 16), (2, 3, 0)]


def _random_states(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1] or 1)[: shape[-1]]
    return x.to(dtype)


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(-1) if t.numel() else np.empty(0, np.uint8)


def _round_trip(raw: np.ndarray, dtype: str, name: str) -> None:
    buf = encode(raw, dtype, name)
    out = decode(buf, dtype, raw.nbytes, name)
    # writable: torch.frombuffer takes it as is
    assert not memoryview(out).readonly and memoryview(out).nbytes == raw.nbytes
    assert bytes(out) == raw.tobytes()


def test_default_codec_is_lossless_and_listed():
    from corecap.config import DEFAULT_CODEC

    assert DEFAULT_CODEC in CODECS and "raw" in CODECS


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_random(name, dtype, shape):
    _round_trip(_raw(_random_states(shape, TORCH_DTYPES[dtype])), dtype, name)


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_round_trip_structured(name, dtype):
    torch_dtype = TORCH_DTYPES[dtype]
    rows = _random_states((1, 4, 64), torch_dtype)
    for states in (
        torch.zeros(2, 9, 31, dtype=torch_dtype),
        torch.full((2, 9, 31), -3.5, dtype=torch_dtype),
        torch.arange(3 * 11 * 17, dtype=torch.float32).view(3, 11, 17).to(torch_dtype),
        rows.repeat(3, 50, 1),  # repeated tokens, as at the embedding layer
    ):
        _round_trip(_raw(states), dtype, name)


@pytest.mark.parametrize("name", LOSSLESS)
@pytest.mark.parametrize("dtype", list(TORCH_DTYPES))
def test_round_trip_large_planes_take_probe_path(name, dtype):
    # planes over 4 probe slices: the mantissa planes are stored, the exponent plane compressed
    states = _random_states((2, 300, 1024), TORCH_DTYPES[dtype])
    _round_trip(_raw(states), dtype, name)


def test_every_bf16_and_fp16_bit_pattern_survives():
    patterns = np.arange(1 << 16, dtype="<u2").view(np.uint8)  # NaN payloads, ±Inf, ±0, subnormals
    for dtype in ("bfloat16", "float16"):
        for name in LOSSLESS:
            _round_trip(patterns, dtype, name)


def test_float32_nan_payloads_and_infinities_survive():
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x80000000, 0x00000001], "<u4")
    noise = np.random.default_rng(0).integers(0, 1 << 32, 5000, dtype=np.uint64).astype("<u4")
    raw = np.concatenate([special, noise]).view(np.uint8)
    for name in LOSSLESS:
        _round_trip(raw, "float32", name)


@pytest.mark.parametrize("name", LOSSLESS)
def test_accepts_bytes_memoryview_and_arrays(name):
    states = _random_states((2, 5, 40), torch.bfloat16)
    raw = _raw(states)
    for form in (raw, raw.tobytes(), memoryview(raw.tobytes()), bytearray(raw.tobytes())):
        assert encode(form, "bfloat16", name) == encode(raw, "bfloat16", name)
    assert b"".join(bytes(memoryview(p)) for p in encode_parts(raw, "bfloat16", name)) == encode(
        raw, "bfloat16", name
    )


def test_zstd_planes_compresses_gaussian_bf16():
    states = torch.randn(2, 256, 1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    raw = _raw(states)
    assert raw.nbytes / len(encode(raw, "bfloat16", "zstd-planes")) > 1.3


def test_concurrent_encode_decode_match_single_thread():
    raws = [_raw(_random_states((2, 200, 700), torch.bfloat16, seed=i)) for i in range(8)]
    expected = [encode(r, "bfloat16", "zstd-planes") for r in raws]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda r: encode(r, "bfloat16", "zstd-planes"), raws))
        back = list(pool.map(lambda b, r: decode(b, "bfloat16", r.nbytes, "zstd-planes"), got, raws))
    assert got == expected
    assert [bytes(b) for b in back] == [r.tobytes() for r in raws]


@given(data=st.binary(max_size=3000), dtype=st.sampled_from(list(TORCH_DTYPES)), name=st.sampled_from(LOSSLESS))
@settings(max_examples=fuzz.examples(150), deadline=None)
def test_property_any_bytes_round_trip(data, dtype, name):
    itemsize = codec.ITEMSIZE[dtype]
    raw = np.frombuffer(data[: len(data) - len(data) % itemsize], dtype=np.uint8)
    _round_trip(raw, dtype, name)


# --- damaged or mismatched input ---------------------------------------------------------------


def _encoded(shape=(2, 40, 96), dtype="bfloat16"):
    raw = _raw(_random_states(shape, TORCH_DTYPES[dtype]))
    return raw, encode(raw, dtype, "zstd-planes")


def test_every_truncation_is_an_error_naming_codec_and_sizes():
    raw, buf = _encoded()
    for cut in sorted({0, 1, 4, 19, 20, 37, len(buf) // 2, len(buf) - 1}):
        with pytest.raises(ValueError, match=r"zstd-planes.*expected %d" % raw.nbytes):
            decode(buf[:cut], "bfloat16", raw.nbytes, "zstd-planes")


def test_any_flipped_byte_is_an_error():
    raw, buf = _encoded()
    rng = np.random.default_rng(1)
    positions = list(range(0, 40)) + list(rng.integers(40, len(buf), 60))
    for pos in positions:
        damaged = bytearray(buf)
        damaged[pos] ^= 0x5A
        with pytest.raises(ValueError, match="zstd-planes"):
            decode(damaged, "bfloat16", raw.nbytes, "zstd-planes")


def test_trailing_bytes_and_wrong_size_or_dtype_are_errors():
    raw, buf = _encoded()
    with pytest.raises(ValueError, match="zstd-planes"):
        decode(buf + b"\0", "bfloat16", raw.nbytes, "zstd-planes")
    with pytest.raises(ValueError, match=str(raw.nbytes + 2)):
        decode(buf, "bfloat16", raw.nbytes + 2, "zstd-planes")
    with pytest.raises(ValueError, match="itemsize"):
        decode(buf, "float32", raw.nbytes, "zstd-planes")
    with pytest.raises(ValueError, match="raw.*%d.*%d" % (raw.nbytes - 1, raw.nbytes)):
        decode(raw.tobytes()[:-1], "bfloat16", raw.nbytes, "raw")
    with pytest.raises(ValueError, match="unknown codec"):
        decode(buf, "bfloat16", raw.nbytes, "lzma")
    with pytest.raises(ValueError, match="unknown dtype"):
        encode(raw, "int8", "zstd-planes")
    with pytest.raises(ValueError, match="whole number"):
        encode(raw[:-1], "bfloat16", "zstd-planes")


def test_plane_declaring_another_size_is_refused_before_decompressing():
    # a well-formed container (right crc) whose zstd frame claims more bytes than the plane has
    itemsize, nbytes = 2, 64
    frame = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    table = codec._PLANE.pack(codec._ZSTD, len(frame)) + codec._PLANE.pack(codec._STORED, nbytes // 2)
    body = table + frame + b"\0" * (nbytes // 2)
    head = codec._HEAD.pack(codec._MAGIC, itemsize, itemsize, 0, nbytes, zlib.crc32(body))
    with pytest.raises(ValueError, match="declares 1048576 bytes, expected 32"):
        decode(head + body, "bfloat16", nbytes, "zstd-planes")


def test_unknown_plane_method_is_an_error():
    body = codec._PLANE.pack(7, 1) + codec._PLANE.pack(codec._STORED, 1) + b"ab"
    head = codec._HEAD.pack(codec._MAGIC, 2, 2, 0, 2, zlib.crc32(body))
    with pytest.raises(ValueError, match="unknown method 7"):
        decode(head + body, "bfloat16", 2, "zstd-planes")


# --- fp8 ------------------------------------------------------------------------------------


def _fp8_round_trip(states: torch.Tensor, out_dtype=torch.float32):
    payload = quantize_fp8(states)
    shape = tuple(states.shape)
    assert len(payload) == states.numel() + 4 * shape[0] * shape[1]
    scales = payload[states.numel() :].view("<f4").reshape(shape[:2])
    return dequantize_fp8(payload, shape, out_dtype), scales


def _assert_fp8_bound(states: torch.Tensor, restored: torch.Tensor, scales: np.ndarray):
    """|x_hat - x| <= max(2^-4 |x|, 2^-10 s) and <= absmax / 28 (half an ulp of e4m3's top
    binade, 16 of 448; 16 s for rows at the floor scale), plus float32 rounding slack."""
    x = states.double()
    s = torch.from_numpy(scales.astype(np.float64))[..., None]
    bound = torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s) * (1 + 2.0**-20) + 2.0**-149
    err = (restored.double() - x).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    absmax = x.abs().amax(dim=-1, keepdim=True)
    row_bound = torch.where(s > fp8.FP8_MIN_SCALE, absmax / 28 * (1 + 2.0**-20), 16 * s) + 2.0**-149
    assert (err <= row_bound).all()


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES.values()))
@pytest.mark.parametrize("shape", [(1, 1, 1), (1, 1, 7), (3, 5, 33), (2, 17, 129)])
def test_fp8_error_within_bound(dtype, shape):
    states = _random_states(shape, dtype)
    states[..., :1] *= 300  # an outlier channel, as in real residual streams
    restored, scales = _fp8_round_trip(states)
    _assert_fp8_bound(states, restored, scales)


@pytest.mark.parametrize("dtype", list(TORCH_DTYPES.values()))
def test_fp8_output_in_requested_dtype_keeps_bound_plus_its_rounding(dtype):
    states = _random_states((2, 9, 65), torch.float32)
    restored, _ = _fp8_round_trip(states, out_dtype=dtype)
    assert restored.dtype == dtype
    absmax = states.abs().amax(dim=-1, keepdim=True).double()
    # the output dtype's own rounding adds half its ulp: 2^-9 relative for bf16, 2^-12 for fp16
    assert ((restored.double() - states.double()).abs() <= (1 / 28 + 2.0**-8) * absmax + 2.0**-24).all()


def test_fp8_scales_are_row_absmax_over_448():
    states = _random_states((3, 6, 50), torch.bfloat16)
    _, scales = _fp8_round_trip(states)
    expected = (states.float().abs().amax(dim=-1) / 448).numpy()
    np.testing.assert_array_equal(scales, expected)


def test_fp8_zero_rows_stay_zero():
    states = _random_states((2, 4, 32), torch.bfloat16)
    states[0, 1] = 0
    states[1] = 0
    restored, scales = _fp8_round_trip(states)
    assert (restored[0, 1] == 0).all() and (restored[1] == 0).all()
    assert np.isfinite(scales).all() and (scales > 0).all()
    _assert_fp8_bound(states, restored, scales)


def test_fp8_rows_below_floor_scale_keep_their_bound():
    # absmax under 448 * 2^-126: the scale is the float32 floor, not absmax / 448
    states = torch.tensor([[[272 * 2.0**-126, 17 * 2.0**-126, -(2.0**-140)], [1.0, -0.5, 0.0]]])
    restored, scales = _fp8_round_trip(states)
    assert scales[0, 0] == fp8.FP8_MIN_SCALE and scales[0, 1] == np.float32(1 / 448)
    _assert_fp8_bound(states, restored, scales)


@pytest.mark.parametrize("shape", [(0, 0, 0), (2, 0, 16), (2, 3, 0)])
def test_fp8_empty(shape):
    restored, scales = _fp8_round_trip(torch.empty(shape, dtype=torch.bfloat16), torch.bfloat16)
    assert restored.shape == shape and restored.dtype == torch.bfloat16 and scales.shape == shape[:2]


def _fp8_reference(states: torch.Tensor) -> bytes:
    """The fp8 payload by the plain formula: each layer divided as a float32 copy."""
    x = states.to(torch.float32)
    scale = (x.abs().amax(dim=2) / 448.0).clamp_min(2.0**-126)
    q = (x / scale[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(torch.uint8).numpy().tobytes() + scale.numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_payload_is_the_plain_formula_to_the_bit(dtype):
    g = torch.Generator().manual_seed(3)
    spread = (torch.logspace(-6, 4, 33)[None, :, None] if dtype == torch.float16
              else torch.logspace(-30, 30, 33)[None, :, None])
    states = (torch.randn(3, 33, 24, generator=g) * spread).to(dtype)
    states[0, 0] = 0  # a zero row: the floor scale
    assert quantize_fp8(states).tobytes() == _fp8_reference(states)


def test_fp8_refuses_non_finite_and_bad_input():
    states = torch.ones(2, 3, 4)
    states[1, 2, 0] = float("nan")
    with pytest.raises(ValueError, match="layer index 1 has 1 rows"):
        quantize_fp8(states)
    with pytest.raises(ValueError, match=r"\[L, T, H\]"):
        quantize_fp8(torch.ones(3, 4))
    payload = quantize_fp8(torch.ones(2, 3, 4)).tobytes()
    with pytest.raises(ValueError, match=r"payload is 47 bytes, expected 48 for shape \[2, 3, 4\]"):
        dequantize_fp8(payload[:-1], (2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match=r"payload is 49 bytes, expected 48"):
        dequantize_fp8(payload + b"\0", (2, 3, 4), torch.float32)


@given(
    values=hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=3, max_dims=3, min_side=1, max_side=9),
        elements=st.floats(-(2.0**127), 2.0**127, allow_nan=False, allow_infinity=False, width=32),
    ),
    dtype=st.sampled_from(list(TORCH_DTYPES.values())),
)
@settings(max_examples=fuzz.examples(150), deadline=None)
def test_property_fp8_bound(values, dtype):
    states = torch.from_numpy(values)
    if dtype != torch.float32:  # keep inputs finite in the narrower dtype
        limit = torch.finfo(dtype).max
        states = states.clamp(-limit, limit).to(dtype)
    restored, scales = _fp8_round_trip(states)
    _assert_fp8_bound(states, restored, scales)


def test_crc32_is_zlibs_checksum_from_zlib_ng():
    """Stored checksums are zlib's CRC-32; zlib-ng (a dependency) computes the same, faster."""
    import zlib

    from zlib_ng import zlib_ng

    from corecap.store.codec import crc32

    assert crc32 is zlib_ng.crc32
    data = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for buf in (b"", data, memoryview(data)[7:], data.tobytes()):
        assert crc32(buf) == zlib.crc32(buf)
    assert crc32(data[5000:], crc32(data[:5000])) == zlib.crc32(data)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_planes_are_byte_k_of_every_element(itemsize):
    from corecap.store.codec import _split_planes

    buf = np.random.default_rng(itemsize).integers(0, 256, 1 + 999 * itemsize, dtype=np.uint8)
    data = buf[1:]  # unaligned for the word view
    planes = _split_planes(data, itemsize)
    assert planes.shape == (itemsize, 999)
    for k in range(itemsize):
        assert np.array_equal(planes[k], data[k::itemsize])
