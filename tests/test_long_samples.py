"""A 32k-token sample whose states exceed --buffer-gb, end to end (corecap/sink/stream.py): a run
SIGKILLed while the sample streams to disk leaves the store as it was; the rerun redoes the
sample, whose states then equal HF transformers' at every token (float32), with the sink's peak
resident memory within --buffer-gb of what it held before its first chunk; and what streaming
cannot do yet (here: vLLM's prefix caching) is refused before the model loads.

Two engine starts (the killed run, the rerun) and one HF forward over 32k tokens: ~60-90 s."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import transformers

from corecap.config import PRENORM, build
from corecap.errors import CorecapError
from corecap.run import run
from corecap.store import Store, segments
from corecap.store.verify import verify_store
from support import kill_loop
from support.reference import hf_hidden_states, record_error, relative_errors, write_jsonl
from support.tiny_models import build as build_tiny

pytestmark = [pytest.mark.engine, pytest.mark.full]  # two engine starts of its own (~80 s)
TOLERANCE = 1e-4  # float32, per token
LONG = 32768
LAYERS = (0, 1, 2, 4, PRENORM)
TOKEN_BYTES = len(LAYERS) * 64 * 4  # the tiny llama's hidden size, float32
BUFFER_GB = 0.0375  # 38.4 MiB, less than the long sample's 40 MiB: it cannot be held, half of it streams
PAUSE_AT_STEP = 8  # of ~17 steps of 2,048 tokens: the long sample half way into its spill file
LIVENESS = 600  # seconds: a hung run fails the test, nothing here times the capture

def _options(model: str, data: str, store: str) -> dict:
    return dict(model=model, data=data, store=store, layers=LAYERS, dtype="float32", max_len=LONG + 64,
                max_batched_tokens=2048, buffer_bytes=int(BUFFER_GB * 2**30), enable_prefix_caching=False,
                enforce_eager=True)


def _argv(options: dict) -> list[str]:
    return ["run", "--model", options["model"], "--data", options["data"], "--store", options["store"],
            "--layers", ",".join(map(str, LAYERS)), "--dtype", "float32", "--max-model-len", str(LONG + 64),
            "--max-num-batched-tokens", "2048", "--buffer-gb", str(BUFFER_GB), "--no-enable-prefix-caching",
            "--enforce-eager"]


def _spill_files(store: str) -> list[str]:
    return [name for name in os.listdir(store) if name.startswith("spill-")] if os.path.isdir(store) else []


def _state_bytes(store: str) -> tuple[int, int]:
    """(bytes of the state files, bytes the committed pointers name): equal where nothing is orphaned."""
    on_disk = sum(os.path.getsize(segments.segment_path(store, n)) for n in segments.segment_numbers(store))
    with Store.open(store) as s, s.env.begin() as txn:
        named = sum(segments.POINTER.unpack(v)[2] for _, v in txn.cursor(db=s.samples_db))
    return on_disk, named


def _kill_while_streaming(options: dict, workdir) -> dict:
    """`corecap run` paused at PAUSE_AT_STEP (kill_loop.paused_until), its short samples committed
    and the long one in its spill file; then SIGKILL to its group."""
    store = options["store"]
    cmd = kill_loop.RunCommand((sys.executable, "-m", "corecap.cli", *_argv(options)), store, str(workdir))
    with kill_loop.paused_until(cmd, "streaming", PAUSE_AT_STEP,
                                lambda: _spill_files(store) and kill_loop.num_committed(store) == 2,
                                "the long sample streaming and the short ones committed", LIVENESS):
        spill_bytes = sum(os.path.getsize(os.path.join(store, n)) for n in _spill_files(store))
    with Store.open(store) as s:
        keys = sorted(s.keys())
    return dict(keys=keys, spill_bytes=spill_bytes, verified=verify_store(store).ok, state_bytes=_state_bytes(store))


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("long")
    model = build_tiny("llama", str(tmp / "model"), overrides={"max_position_embeddings": LONG + 64})
    rng = np.random.default_rng(34)
    rows = [{"id": "short-a", "input_ids": rng.integers(3, 512, 200).tolist()},
            {"id": "short-b", "input_ids": rng.integers(3, 512, 40).tolist()},
            {"id": "long", "input_ids": rng.integers(3, 512, LONG).tolist()}]
    options = _options(model, write_jsonl(tmp / "data.jsonl", rows), str(tmp / "store"))
    killed = _kill_while_streaming(options, tmp)
    lines = []
    summary = run(build(**options), log=lines.append)
    return options, rows, killed, summary, lines


def test_a_kill_while_the_sample_streams_leaves_the_store_as_before(long_run):
    _, _, killed, _, _ = long_run
    assert killed["keys"] == ["short-a", "short-b"]  # committed before the kill; the long one not
    assert killed["spill_bytes"] == LONG * TOKEN_BYTES  # it was streaming, in its spill file at its full size
    assert killed["verified"]
    on_disk, named = killed["state_bytes"]
    assert named > 0 and on_disk >= named  # bytes past the committed end are the next writer's to cut


def test_the_rerun_redoes_the_long_sample_and_leaves_nothing_behind(long_run):
    options, _, _, summary, _ = long_run
    store = options["store"]
    assert (summary.num_committed, summary.num_skipped, summary.num_streamed) == (1, 2, 1)
    assert not _spill_files(store) and verify_store(store).ok
    on_disk, named = _state_bytes(store)
    assert on_disk == named  # no byte of the killed run's stream left in the state files
    with Store.open(store) as s:
        assert s.get("long").header.codec == "raw"  # streamed: stored raw whatever --codec


def test_every_token_matches_hf(long_run):
    options, rows, _, _, _ = long_run
    hf_model = transformers.LlamaForCausalLM.from_pretrained(options["model"], dtype="float32").eval()
    with Store.open(options["store"]) as store:
        for row in rows:
            sample = store.get(row["id"])
            assert sample.input_ids.tolist() == row["input_ids"]
            ref = hf_hidden_states(hf_model, row["input_ids"], LAYERS)
            assert sample.hidden_states.shape == ref.shape == (len(LAYERS), len(row["input_ids"]), 64)
            per_sample, per_token = relative_errors(sample.hidden_states, ref)
            record_error(f"long sample ({row['id']})", per_sample, per_token)
            assert per_token.max() <= TOLERANCE, (row["id"], per_token.tolist())


def test_the_sinks_peak_memory_stays_within_the_buffer_bound(long_run):
    """The kernel's high-water mark (VmHWM) of the sink process, less its resident memory before
    its first chunk, against --buffer-gb; the sample held whole would need its 40 MiB."""
    _, _, _, summary, lines = long_run
    growth = summary.sink_rss_peak - summary.sink_rss_start
    assert summary.buffer_bytes == int(BUFFER_GB * 2**30) < LONG * TOKEN_BYTES
    assert 0 < growth <= summary.buffer_bytes, (growth, summary.buffer_bytes)
    assert summary.sink_buffers_peak == 0  # the rerun's one sample streamed: it took no buffer
    print(f"\nsink RSS {summary.sink_rss_start / 2**20:.1f} MiB at start, peak {summary.sink_rss_peak / 2**20:.1f} MiB "
          f"(+{growth / 2**20:.1f} MiB) against --buffer-gb {summary.buffer_bytes / 2**20:.1f} MiB")


def test_prefix_caching_with_a_sample_that_would_stream_is_refused_before_the_model_loads(long_run, tmp_path):
    options = dict(long_run[0], store=str(tmp_path / "other"), enable_prefix_caching=True)
    with pytest.raises(CorecapError, match=r"a sample of 32768 tokens holds 40 MiB of states, .* streams to disk, "
                                           r"which prefix caching cannot do yet; raise --buffer-gb to 0.0781 or add "
                                           r"--no-enable-prefix-caching"):
        run(build(**options), log=lambda line: None)
    assert not os.path.exists(os.path.join(options["store"], "data.mdb"))


def test_the_run_says_what_streamed(long_run):
    _, _, _, summary, _ = long_run
    line = summary.line()
    assert "streamed to disk: 1 samples longer than half of --buffer-gb (the sink's memory " in line, line
