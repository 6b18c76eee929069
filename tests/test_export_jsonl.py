"""What a store of generated samples (`corecap run --max-tokens`) shows: `get`, `ls --long`,
`info`, StoreDataset's items, and `corecap export --format jsonl` read back, its text against
the tokenizer's own decoding and the strings the prompts were made from. The store is built
without an engine: the tiny model's tokenizer (conftest's `tiny_model`) makes the prompts."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from support.reference import SEED
from corecap.cli import main
from corecap.store.generated import Generation

LAYERS = (2, "prenorm")
HIDDEN = 16
PROMPTS = {"gen-text": "the quick brown fox", "gen-stop": "hidden states for", "gen-unknown": "the lazy dog"}
MESSAGES = [{"role": "user", "content": "hidden states for a draft head"}]
SAMPLING = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 20}
UNKNOWN_ID = 500  # past the tiny tokenizer's vocabulary (about 315), inside the model's (512)


def _samples(tokenizer) -> dict:
    """key → (input_ids, loss_mask or None, Generation or None, the prompt's source text or None)."""
    rng = np.random.default_rng(SEED + 34)
    vocab = len(tokenizer)
    chat = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    responses = {
        "gen-text": (tokenizer.encode(" jumps over the lazy dog") + [tokenizer.eos_token_id], "eos", None),
        "gen-stop": (tokenizer.encode(" a draft head"), "stop", " head"),
        "gen-unknown": ([int(rng.integers(3, vocab)), UNKNOWN_ID, int(rng.integers(3, vocab))], "length", None),
        "gen-length": (rng.integers(3, vocab, size=20).tolist(), "length", None),
        "gen-chat": (tokenizer.encode("the lazy dog"), "length", None),
    }
    out = {}
    for i, (key, (response, reason, stop)) in enumerate(responses.items()):
        source = chat if key == "gen-chat" else PROMPTS.get(key)
        prompt = (tokenizer.encode(source, add_special_tokens=False) if source is not None
                  else rng.integers(3, vocab, size=9).tolist())
        ids = np.array(prompt + response, dtype=np.int32)
        mask = np.array([0] * len(prompt) + [1] * len(response), dtype=np.uint8)
        out[key] = (ids, mask, Generation(
            num_prompt=len(prompt), num_generated=len(response), finish_reason=reason, stop=stop, seed=1000 + i,
            sampling=SAMPLING,
        ), source)
    text_ids = np.array(tokenizer.encode("hidden states"), dtype=np.int32)
    out["plain-mask"] = (text_ids, (np.arange(len(text_ids)) % 2).astype(np.uint8), None, "hidden states")
    out["plain-nomask"] = (rng.integers(3, vocab, size=12).astype(np.int32), None, None, None)
    return out


def _write_store(path: str, model_path: str, samples: dict) -> str:
    from corecap.store import FORMAT_VERSION, LAYER_MEANING, ModelIdentity, Store, StoreMeta, encode_sample

    identity = ModelIdentity(
        path=model_path, architecture="LlamaForCausalLM", config_hash="c" * 32, weights_fingerprint="w" * 32,
        num_layers=8, hidden_size=HIDDEN, vocab_size=512,
    )
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=LAYERS, layer_meaning=LAYER_MEANING, dtype="float32",
        hidden_size=HIDDEN, corecap_version="test", vllm_version="none", codec="raw",
    )
    gen = torch.Generator().manual_seed(SEED)
    records = [
        encode_sample(key, ids, torch.randn(len(LAYERS), len(ids), HIDDEN, generator=gen), LAYERS, codec="raw",
                      loss_mask=mask, generation=generation)
        for key, (ids, mask, generation, _) in samples.items()
    ]
    with Store.create_or_open(path, meta) as store:
        store.put_many(records[:3])
        store.put_many(records[3:])
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from corecap.model import load_tokenizer

    return load_tokenizer(tiny_model)


@pytest.fixture(scope="module")
def generated(tiny_model, tokenizer, tmp_path_factory):
    samples = _samples(tokenizer)
    return _write_store(str(tmp_path_factory.mktemp("generated") / "store"), tiny_model, samples), samples


def _corecap(*args):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def _read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_export_jsonl_reads_back_as_the_tokenizer_decodes(generated, tokenizer, tmp_path):
    store, samples = generated
    out = tmp_path / "samples.jsonl"
    r = _corecap("export", "--store", store, "--format", "jsonl", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    assert (f"{out}: 7 samples" in r.stdout and "5 with the model's response" in r.stdout
            and "no hidden states" in r.stdout)
    assert "1 of 7 samples hold token ids the tokenizer has no token for" in r.stdout
    lines = _read_jsonl(out)
    assert [line["id"] for line in lines] == sorted(samples)  # the store's key order
    for line in lines:
        ids, mask, generation, source = samples[line["id"]]
        assert line["loss_mask"] == (None if mask is None else mask.tolist())
        if generation is None:
            assert set(line) == {"id", "text", "input_ids", "loss_mask"}
            assert line["input_ids"] == ids.tolist() and line["text"] == tokenizer.decode(ids.tolist())
            if source is not None:
                assert line["text"] == source
            continue
        prompt, response = ids[: generation.num_prompt].tolist(), ids[generation.num_prompt :].tolist()
        assert line["prompt_ids"] == prompt and line["response_ids"] == response
        assert line["prompt"] == tokenizer.decode(prompt) and line["response"] == tokenizer.decode(response)
        if source is not None:  # the text the prompt was tokenized from (a chat: as its template rendered it)
            assert line["prompt"] == source
        assert (line["finish_reason"], line["stop"], line["seed"], line["sampling"]) == (
            generation.finish_reason, generation.stop, generation.seed, SAMPLING)
    by_key = {line["id"]: line for line in lines}
    assert by_key["gen-text"]["response"] == " jumps over the lazy dog" + tokenizer.eos_token
    assert not os.path.exists(str(out) + ".partial")


def test_export_jsonl_reads_headers_only_and_follows_keys(generated, tokenizer, tmp_path, monkeypatch):
    from corecap.store import Store
    from corecap.export.jsonl import export_jsonl

    store, samples = generated

    def no_states(*args):
        raise AssertionError("the jsonl export read a sample's states")

    monkeypatch.setattr(Store, "states", no_states)
    out = tmp_path / "two.jsonl"
    summary = export_jsonl(store, str(out), tokenizer, keys=["plain-mask", "gen-length"])
    assert summary.num_samples == 2 and summary.num_generated == 1
    assert summary.num_tokens == sum(len(samples[k][0]) for k in ("plain-mask", "gen-length"))
    assert [line["id"] for line in _read_jsonl(out)] == ["plain-mask", "gen-length"]
    assert summary.nbytes == os.path.getsize(out)


def test_export_jsonl_starts_an_interrupted_export_over_and_never_overwrites(generated, tmp_path):
    store, samples = generated
    out = tmp_path / "samples.jsonl"
    with open(str(out) + ".partial", "w") as f:
        f.write('{"id": "left from an interrupted export"}\n' * 50)
    r = _corecap("export", "--store", store, "--format", "jsonl", "--out", str(out))
    assert r.exit_code == 0, r.stderr
    assert "an interrupted export was left there: starting over" in r.stderr
    first = out.read_bytes()
    assert [line["id"] for line in _read_jsonl(out)] == sorted(samples) and not os.path.exists(str(out) + ".partial")
    r = _corecap("export", "--store", store, "--format", "jsonl", "--out", str(out))
    assert r.exit_code == 2 and "already exists" in r.stderr and out.read_bytes() == first


def test_export_jsonl_refuses_before_writing(generated, tiny_model, tokenizer, tmp_path):
    store, samples = generated
    out = tmp_path / "x.jsonl"
    keys = tmp_path / "keys.txt"
    keys.write_text("gen-text\nno-such-key\n")
    refusals = [
        (["--keys", str(keys)], f"--keys: {store} has no sample with key 'no-such-key'"),
        (["--aux-layers", "2"],
         "--aux-layers applies to the hidden states, and --format jsonl writes none (it is the text)"),
        (["--workers", "2"], "--workers applies to the hidden states"),
    ]
    for extra, message in refusals:
        r = _corecap("export", "--store", store, "--format", "jsonl", "--out", str(out), *extra)
        assert r.exit_code == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (extra, r.stderr)
    r = _corecap("export", "--store", store, "--format", "speculators", "--out", str(tmp_path / "d"),
                 "--tokenizer", tiny_model)
    assert r.exit_code == 2 and "--tokenizer applies to --format jsonl only" in r.stderr
    # A store whose model directory has no tokenizer here: one line, and --tokenizer gives one.
    bare = tmp_path / "bare-model"
    bare.mkdir()
    other = _write_store(str(tmp_path / "other"), str(bare), {k: samples[k] for k in ("gen-text", "plain-nomask")})
    r = _corecap("export", "--store", other, "--format", "jsonl", "--out", str(out))
    assert r.exit_code == 2 and r.stderr.strip() == (
        "corecap: error: --format jsonl decodes with the model's tokenizer, "
        f"and the store's model directory {bare} has no "
        "tokenizer files: pass --tokenizer DIR (the model's directory, or one with its tokenizer files)")
    assert not os.path.exists(out) and not os.path.exists(str(out) + ".partial")
    r = _corecap("export", "--store", other, "--format", "jsonl", "--out", str(out), "--tokenizer", tiny_model)
    assert r.exit_code == 0, r.stderr
    first = _read_jsonl(out)[0]
    ids, _, g, _ = samples["gen-text"]
    assert first["id"] == "gen-text" and first["response"] == tokenizer.decode(ids[g.num_prompt :].tolist())


def test_get_shows_the_response_and_writes_its_record(generated, tmp_path):
    from safetensors import safe_open

    store, samples = generated
    r = _corecap("get", "gen-length", "--store", store)
    assert r.exit_code == 0 and r.stdout.strip().endswith(
        f", prompt of {samples['gen-length'][2].num_prompt} tokens, response of 20 tokens (finished by length)"
    ), r.stdout
    assert "(finished by stop ' head')" in _corecap("get", "gen-stop", "--store", store).stdout
    assert "response" not in _corecap("get", "plain-nomask", "--store", store).stdout
    out = tmp_path / "g.safetensors"
    assert _corecap("get", "gen-stop", "--store", store, "--out", str(out)).exit_code == 0
    with safe_open(str(out), "pt") as f:
        record = json.loads(f.metadata()["generation"])
        assert f.get_tensor("input_ids").tolist() == samples["gen-stop"][0].tolist()
    g = samples["gen-stop"][2]
    assert record == {"num_prompt": g.num_prompt, "num_generated": g.num_generated, "finish_reason": "stop",
                      "stop": " head", "seed": g.seed, "sampling": SAMPLING}
    plain = tmp_path / "p.safetensors"
    assert _corecap("get", "plain-mask", "--store", store, "--out", str(plain)).exit_code == 0
    with safe_open(str(plain), "pt") as f:
        assert "generation" not in f.metadata()


def test_info_and_ls_count_the_responses(generated):
    store, samples = generated
    info = json.loads(_corecap("info", "--store", store).stdout)
    generations = [s[2] for s in samples.values() if s[2] is not None]
    assert info["num_samples"] == 7 and info["num_tokens"] == sum(len(s[0]) for s in samples.values())
    assert (info["num_generated_samples"] == 5
            and info["num_generated_tokens"] == sum(g.num_generated for g in generations))
    assert info["finish_reasons"] == {"eos": 1, "length": 3, "stop": 1}
    assert _corecap("ls", "--store", store).stdout.split() == sorted(samples)
    rows = [line.split("\t") for line in _corecap("ls", "-l", "--store", store).stdout.splitlines()]
    assert [row[0] for row in rows] == sorted(samples)
    for key, *columns in rows:
        ids, _, g, _ = samples[key]
        assert columns[0] == f"{len(ids)} tokens"
        expected = [] if g is None else [f"prompt of {g.num_prompt} tokens, response of {g.num_generated} tokens "
                                         f"(finished by {g.finish_reason}"
                                         + (f" {g.stop!r})" if g.stop else ")")]
        assert columns[1:] == expected


def test_dataset_items_carry_what_a_trainer_filters_on(generated):
    from corecap import StoreDataset

    store, samples = generated
    ds = StoreDataset(store)
    for item in (ds[i] for i in range(len(ds))):
        ids, mask, g, _ = samples[item["key"]]
        assert {"key", "input_ids", "loss_mask", "hidden_states"} <= set(item)
        assert (item["input_ids"].tolist() == ids.tolist()
                and item["hidden_states"].shape == (len(LAYERS), len(ids), HIDDEN))
        assert item["loss_mask"].tolist() == ([1] * len(ids) if mask is None else mask.tolist())
        if g is None:
            assert "num_prompt" not in item and "finish_reason" not in item
        else:
            assert (item["num_prompt"], item["finish_reason"]) == (g.num_prompt, g.finish_reason)
    kept = [ds[i]["key"] for i in range(len(ds)) if ds[i].get("finish_reason", "eos") != "length"]
    assert kept == ["gen-stop", "gen-text", "plain-mask", "plain-nomask"]


def test_a_sample_stored_with_nonfinite_states_keeps_its_text(tokenizer):
    from corecap.store import decode_header, encode_sample
    from corecap.export.jsonl import sample_line

    ids = np.array(tokenizer.encode("the lazy dog"), dtype=np.int32)
    states = torch.full((len(LAYERS), len(ids), HIDDEN), float("nan"))
    header = decode_header("nan", encode_sample("nan", ids, states, LAYERS, codec="raw", nonfinite=True).header)
    line = sample_line("nan", header, ids, tokenizer)
    assert line == {"id": "nan", "text": "the lazy dog", "nonfinite": True, "input_ids": ids.tolist(),
                    "loss_mask": None}
