"""fp8's payload to the bit, against an independent reference of its documented math.

The reference computes in numpy float32 (IEEE division, correctly rounded)
    s = max(absmax(row) / 448, 2^-126),   v = clamp(x / s, -448, 448)
and rounds v to float8_e4m3fn by nearest-value search over e4m3's 127 finite magnitudes, ties to
the even code, the sign kept (also for -0 and values that round to zero): no torch cast involved.
Inputs are chosen where a fast implementation could go wrong: exact e4m3 midpoints and their
neighbours, e4m3 subnormals, rows below the floor scale, the dtypes' extremes and subnormals,
zero and -0 rows, rows whose x / s rounds above 448, and chunk boundaries.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from corecap.store import fp8, fp8rows
from corecap.store.fp8 import NonFiniteStates, quantize_fp8
from corecap.store.fp8rows import fp8_payload, quantize_fp8_rows

# e4m3fn magnitudes by code 0..126 (127 is NaN): subnormals m * 2^-9, normals (1 + m/8) 2^(e-7)
_CODES = np.arange(127)
_E4M3 = np.where(_CODES >> 3 == 0, (_CODES & 7) * 2.0**-9, (1 + (_CODES & 7) / 8) * 2.0 ** ((_CODES >> 3) - 7))


def _e4m3_codes(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float8_e4m3fn codes of float32 values within ±448."""
    a = np.abs(v.astype(np.float64))
    assert a.max(initial=0) <= 448
    hi = np.clip(np.searchsorted(_E4M3, a), 1, 126)  # _E4M3[hi - 1] < a <= _E4M3[hi], or a == 0
    lo = hi - 1
    d_lo, d_hi = a - _E4M3[lo], _E4M3[hi] - a
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == 0, 0, code)
    return (code | np.where(np.signbit(v), 0x80, 0)).astype(np.uint8)


def _reference(states: torch.Tensor) -> bytes:
    x = states.float().numpy()
    absmax = np.abs(x).max(axis=2, initial=0)
    s = np.maximum(absmax / np.float32(448), np.float32(2.0**-126)).astype(np.float32)
    v = np.clip(x / s[:, :, None], np.float32(-448), np.float32(448))
    return _e4m3_codes(v).tobytes() + s.tobytes()


_MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}


def _hard_rows(dtype: torch.dtype, hidden: int = 48) -> torch.Tensor:
    """[rows, hidden] in `dtype`: each row one of the cases the module docstring names."""
    g = torch.Generator().manual_seed(11)
    finfo = torch.finfo(dtype)
    mids = (_E4M3[:-1] + _E4M3[1:]) / 2  # exact in every dtype: at most 5 significant bits
    ulp = 2.0 ** (np.floor(np.log2(mids)) - _MANTISSA_BITS[dtype])
    exact = np.concatenate([_E4M3, mids, mids - ulp, mids + ulp])
    exact = np.concatenate([exact, -exact])
    rows = []
    for part in np.array_split(exact, -(-len(exact) // (hidden - 1))):
        # absmax 448 makes s exactly 1, so x / s = x: e4m3 values, midpoints (ties), their neighbours
        rows.append(torch.tensor(np.concatenate([[448.0], part, np.zeros(hidden - 1 - len(part))])))
    rows.append(torch.zeros(hidden, dtype=torch.float64))  # all zero: the floor scale
    rows.append(-torch.zeros(hidden, dtype=torch.float64))  # all -0: codes 0x80
    rows.append(torch.tensor([1.0] + [-1e-30] * (hidden - 1)))  # tiny negatives round to -0
    rows.append(torch.linspace(-finfo.max, finfo.max, hidden, dtype=torch.float64))  # the extremes
    rows.append(finfo.tiny * torch.arange(hidden, dtype=torch.float64))  # smallest normals
    rows.append(finfo.tiny / 4 * torch.randn(hidden, generator=g).double())  # subnormals
    rows.append(2.0**-130 * torch.randn(hidden, generator=g).double())  # under the floor scale
    for exponent in range(-40, 40, 2):  # spread rows; some divide past 448 (see below)
        rows.append(2.0**exponent * (torch.randn(hidden, generator=g) * (1 + torch.rand(hidden, generator=g))).double())
    return torch.stack(rows).clamp(-finfo.max, finfo.max).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("chunk", [None, 5 * 48, 7])  # the default, several rows, one row a chunk
def test_payload_matches_the_documented_math_to_the_bit(dtype, chunk, monkeypatch):
    if chunk is not None:
        monkeypatch.setattr(fp8, "_FP8_CHUNK_VALUES", chunk)
    rows = _hard_rows(dtype)
    states = rows[: len(rows) // 3 * 3].view(3, -1, rows.shape[1])  # 3 layers, ragged last chunk
    assert quantize_fp8(states).tobytes() == _reference(states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_some_rows_divide_past_448_so_the_clamp_would_bind(dtype):
    x = _hard_rows(dtype).float().numpy()
    s = np.maximum(np.abs(x).max(axis=1) / np.float32(448), np.float32(2.0**-126))
    assert ((np.abs(x) / s[:, None]).max(axis=1) > 448).any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_states_match_to_the_bit(dtype):
    g = torch.Generator().manual_seed(5)
    states = torch.randn(4, 37, 300, generator=g) * torch.logspace(-3, 3, 37)[None, :, None]
    states[1, 3, 7] = 0.0
    states[2, :, 0] *= 300  # an outlier channel
    states = states.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype)
    assert quantize_fp8(states).tobytes() == _reference(states)
    assert quantize_fp8(states.transpose(0, 1).contiguous().transpose(0, 1)).tobytes() == _reference(states)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -float("nan")])
def test_nan_and_inf_are_refused_naming_the_first_layer(dtype, value):
    states = torch.randn(3, 4, 40).to(dtype)
    states[1, 2, 5] = value
    states[1, 0, 39] = value
    states[2, 1, 0] = value
    with pytest.raises(NonFiniteStates, match="fp8: layer index 1 has 2 rows with NaN or Inf") as refused:
        quantize_fp8(states)
    assert refused.value.layer_indices == [1, 2]
    assert issubclass(NonFiniteStates, ValueError)  # what callers caught before it had a name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_reference_agrees_with_torchs_plain_formula(dtype):
    """The payload before quantize_fp8 was made fast: a float32 copy divided, clamped and cast by
    torch (tests/test_codec.py's reference). Stores written then hold these bytes."""
    states = _hard_rows(dtype)[None]
    x = states.float()
    scale = (x.abs().amax(dim=2) / 448.0).clamp_min(2.0**-126)
    q = (x / scale[:, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    assert q.view(torch.uint8).numpy().tobytes() + scale.numpy().tobytes() == _reference(states)


def test_fp8_stores_encode_on_at_most_four_threads_and_lossless_on_all_it_is_given():
    """fp8's encode slows past 4 threads on the H200 host (corecap/config.py FP8_ENCODE_THREADS)."""
    from corecap.config import RunConfig
    from corecap.run import sink_encode_threads
    from corecap.store import FP8

    assert sink_encode_threads(RunConfig(codec=FP8, encode_threads=8)) == 4
    assert sink_encode_threads(RunConfig(codec=FP8, encode_threads=2)) == 2
    assert sink_encode_threads(RunConfig(encode_threads=8)) == 8


# --- the workers' rows (corecap/store/fp8rows.py) ------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_quantised_by_the_workers_give_the_same_payload_to_the_bit(dtype):
    """What a worker sends under --store-dtype fp8, regrouped by the writer, is the payload the
    reference gives for the states, taken from each layer's first rows (a step's padded tail is
    not quantised), and the model's outputs are left as they were."""
    hard = _hard_rows(dtype)
    num_tokens = hard.shape[0]
    layers = [torch.cat([hard, torch.full((5, hard.shape[1]), 7.0, dtype=dtype)]), -hard.flip(0), hard * 0.5]
    layers = [t if i != 2 else t.t().contiguous().t() for i, t in enumerate(layers)]  # one not row-contiguous
    before = [t.clone() for t in layers]
    rows = quantize_fp8_rows(layers, num_tokens)
    assert rows.dtype == torch.uint8 and rows.shape == (3, num_tokens, hard.shape[1] + fp8rows.ROW_EXTRA)
    assert all(torch.equal(t, b) for t, b in zip(layers, before))
    assert fp8_payload(rows).tobytes() == _reference(torch.stack([t[:num_tokens] for t in layers]))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_rows_of_nan_or_inf_are_refused_naming_the_first_layer(value):
    layers = [torch.randn(4, 40, dtype=torch.bfloat16) for _ in range(3)]
    layers[1][2, 5] = layers[1][0, 39] = layers[2][1, 0] = value
    rows = quantize_fp8_rows(layers, 4)
    with pytest.raises(NonFiniteStates, match="fp8: layer index 1 has 2 rows with NaN or Inf") as refused:
        fp8_payload(rows)
    assert refused.value.layer_indices == [1, 2]


def test_a_sample_of_rows_encodes_as_its_states_do():
    """The stored record (header and payload) is the same whether the writer gets the states or
    the workers' rows of them; a reference's tail is cut from the rows as from the states."""
    from corecap.store import FP8, encode_sample
    from corecap.store.format import Segment

    states = torch.randn(2, 9, 32).to(torch.bfloat16)
    rows = quantize_fp8_rows(list(states), 9)
    for prefix in (None, (Segment("other", 0, 4),)):
        a = encode_sample("k", np.arange(9), states, (3, "prenorm"), codec=FP8, prefix=prefix)
        b = encode_sample("k", np.arange(9), rows, (3, "prenorm"), codec=FP8, prefix=prefix, dtype="bfloat16")
        assert (a.header, bytes(a.payload), a.num_prefix) == (b.header, bytes(b.payload), b.num_prefix)
