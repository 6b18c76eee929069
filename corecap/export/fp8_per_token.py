"""speculators 0.9.0's fp8 hidden-state files (`corecap export --format speculators --dtype fp8`):
the states of one sample as float8_e4m3fn codes [T, L, H] and ONE float32 scale per token,
`hidden_states_scales` [T, 1, 1], shared by all its layers, as hs_connectors 0.9.0's fp8 backend
writes them (`hs_connectors/fp8_utils.py`, `quantize_tensor_to_fp8`):

    scale = clamp(float32(amax over the token's layers and hidden units) / 448, min=1e-12)
    codes = e4m3(float32(x) / scale)

speculators reads such a file only through that backend's reader (`--hidden-states-backend fp8`:
`hs_connectors/transfer.py`, `FP8Transfer`), which dequantizes wherever the scales key is present:
`codes.to(bf16) * scale.to(bf16)`. corecap's own fp8 store keeps a scale per token AND layer
(corecap/store/fp8.py), so a store of that kind is read back (dequantized, in its dtype) and
quantized again here; the error that costs is bounded in docs/export.md, "speculators fp8 files".
"""

from __future__ import annotations

import torch

from corecap.export.files import scratch_tensor

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max, which hs_connectors divides by
MIN_SCALE = 1e-12  # hs_connectors' floor: an all-zero token gets codes 0 and this scale
SCALES_KEY = "hidden_states_scales"  # its presence is what makes FP8Transfer dequantize a file


def quantize_per_token(states: torch.Tensor, positions) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored states [L_stored, T, H] at `positions` → (codes float8_e4m3fn [T, L, H], scales
    float32 [T, 1, 1]), hs_connectors' formula op for op, so the file is the one its writer would
    make of the same states (tests/test_export_speculators_fp8.py). The codes and the float32
    work buffer are this thread's reused buffers (corecap/export/files.py): valid until its next
    sample."""
    num_tokens, hidden = states.shape[1], states.shape[2]
    shape = (num_tokens, len(positions), hidden)
    work = scratch_tensor(shape, torch.float32, 0)
    for j, p in enumerate(positions):  # [T, L, H] gathered and widened in one copy per layer
        work[:, j].copy_(states[p])
    # max |x| per token from its min and max: no |x| copy of the sample
    low, high = torch.aminmax(work.view(num_tokens, len(positions) * hidden), dim=1)
    amax = torch.maximum(high, low.neg()).view(num_tokens, 1, 1)
    scales = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    codes = scratch_tensor(shape, torch.float8_e4m3fn, 1)
    codes.copy_(work.div_(scales))  # the float32 quotient hs_connectors casts, in place
    return codes, scales
