"""What the engine tests share: the tiny Llama's shape (conftest builds it from SEED), HF
transformers' reference states for a sample, the worst errors measured (printed at the end of
the test session), the exactness dataset and the run logs of the shared runs."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import torch

from corecap.config import PRENORM
from support.tiny_models import relative_errors  # noqa: F401  (the tests import it from here)

SEED = 1234
NUM_LAYERS = 8
VOCAB = 512
MAX_POSITIONS = 512  # the tiny model's context: exact_run captures a sample of exactly this length

# Worst relative errors seen per test case, printed at the end of the test session (conftest).
ERRORS: dict[str, dict[str, float]] = {}
RUN_LOGS: dict[str, list[str]] = {}  # the log lines of the shared runs, by fixture
INPUT_PASSES: dict[str, list[bool]] = {}  # each pass a shared run made over its input: tokenizing or not


@contextlib.contextmanager
def counting_input_passes(name: str):
    """Record each pass corecap's data reader makes over the input during a run (INPUT_PASSES)."""
    from corecap.data import samples

    original = samples._outcomes
    passes = INPUT_PASSES.setdefault(name, [])

    def counted(*args, **kwargs):
        passes.append(kwargs.get("render", True))
        return original(*args, **kwargs)

    samples._outcomes = counted
    try:
        yield
    finally:
        samples._outcomes = original


def engine_line(lines: list[str]) -> str:
    """A run's first line after any line saying what killed runs left in /dev/shm."""
    return next(line for line in lines if not line.startswith("removed "))


def hf_hidden_states(hf_model, token_ids, layers) -> torch.Tensor:
    """HF transformers' output_hidden_states at `layers`, [L, T, H], float32: the reference.
    "prenorm" is the output of the last decoder layer, taken with a forward hook: HF's own
    hidden_states[N] is after the final norm."""
    seen = {}
    hook = hf_model.model.layers[-1].register_forward_hook(
        lambda module, args, output: seen.__setitem__("prenorm", output[0] if isinstance(output, tuple) else output)
    )
    try:
        with torch.no_grad():
            out = hf_model(torch.tensor([list(map(int, token_ids))]), output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([seen["prenorm"][0] if k == PRENORM else out.hidden_states[k][0] for k in layers])


def record_error(case: str, per_sample: torch.Tensor, per_token: torch.Tensor) -> None:
    worst = ERRORS.setdefault(case, {"per_sample_layer": 0.0, "per_token": 0.0})
    worst["per_sample_layer"] = max(worst["per_sample_layer"], float(per_sample.max()))
    worst["per_token"] = max(worst["per_token"], float(per_token.max()))


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def exactness_rows(rng: np.random.Generator) -> list:
    """Every case the capture must get right, in one dataset (one engine run)."""
    prefix = rng.integers(3, VOCAB, size=200).tolist()
    dup = rng.integers(3, VOCAB, size=150).tolist()
    rows = [
        {"id": "one-token", "input_ids": [7]},
        {"id": "long-chunked", "input_ids": rng.integers(0, VOCAB, size=300).tolist()},
        {"id": "long-full-context", "input_ids": rng.integers(0, VOCAB, size=MAX_POSITIONS).tolist()},
        {"id": "prefix-a", "input_ids": prefix + rng.integers(0, VOCAB, size=40).tolist()},
        {"id": "prefix-b", "input_ids": prefix + rng.integers(0, VOCAB, size=73).tolist()},
        {"id": "dup-1", "input_ids": dup},
        {"id": "dup-2", "input_ids": dup},
        {"id": 17, "input_ids": rng.integers(0, VOCAB, size=33).tolist()},
        {"id": "text", "text": "the quick brown fox jumps over the lazy dog; hidden states"},
        "",  # blank lines are skipped but counted
        {"input_ids": rng.integers(0, VOCAB, size=64).tolist()},  # no id: key is the line number
    ]
    rows += [{"id": f"rand-{i}", "input_ids": rng.integers(0, VOCAB, size=int(n)).tolist()}
             for i, n in enumerate(rng.integers(2, 130, size=10))]
    return rows


def same_meta(a, b) -> bool:
    """Two stores' metadata agree on everything but the format version, which is 4 once a store
    holds a sample that refers to another for its prefix (prefix caching on, which shares what
    a run's batches happen to share) and 3 otherwise."""
    import msgspec

    return msgspec.structs.replace(a, format_version=0) == msgspec.structs.replace(b, format_version=0)
