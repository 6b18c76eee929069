"""The model answers conversations with images (`--max-tokens` on image rows): a tiny Kimi-K2.5
with a working vision tower (tests/support/kimi_k25_vision.py) answers greedily, its answers
equal HF transformers' greedy decoding given the same pixel values, and every stored token's
states, prompt (image tokens included) and response, equal HF's (float32, every layer and
`prenorm`). One engine for the module, `--enforce-eager`."""

from __future__ import annotations

import os

import numpy as np
import pytest

from support import kimi_k25_vision, tiny_models
from support.reference import record_error, relative_errors, write_jsonl
from corecap.config import PRENORM

N = tiny_models.NUM_LAYERS
LAYERS = (*range(N + 1), PRENORM)
TOLERANCE = 1e-4
MAX_TOKENS = 6


def _user(*parts):
    return {"role": "user", "content": list(parts)}


def _image(url):
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.engine
@pytest.mark.full
def test_answers_to_image_conversations_match_hf_greedy(tmp_path_factory):
    from corecap.config import build
    from corecap.run import run
    from corecap.store import Store

    checkpoint = kimi_k25_vision.build(str(tmp_path_factory.mktemp("kimi-k25-vision") / "model"))
    directory = str(tmp_path_factory.mktemp("images-generate"))
    a, b, c = kimi_k25_vision.images(directory, [(12, 8), (16, 20), (8, 8)])
    rows = [
        {"id": "one", "messages": [_user({"type": "text", "text": "describe the image"},
                                         _image(os.path.basename(a)))]},
        {"id": "two", "messages": [_user(_image(os.path.basename(b)), {"type": "text", "text": "and"},
                                         _image(os.path.basename(c)))]},
        {"id": "answered", "messages": [_user(_image(os.path.basename(c))),
                                        {"role": "assistant", "content": "replaced by the model's"}]},
        {"id": "text", "messages": [{"role": "user", "content": "what is in this picture"}]},
    ]
    images = {"one": [a], "two": [b, c], "answered": [c], "text": []}
    data = write_jsonl(os.path.join(directory, "prompts.jsonl"), rows)
    store = str(tmp_path_factory.mktemp("images-generate-store") / "store")
    cfg = build(model=checkpoint, data=data, store=store, layers=LAYERS, batch=4, max_batched_tokens=16,
                dtype="float32", enforce_eager=True, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    summary = run(cfg, log=[].append)
    assert summary.num_committed == len(rows)
    with Store.open(cfg.store) as s:
        got = {row["id"]: s.get(row["id"]) for row in rows}
    refs = kimi_k25_vision.reference_in_a_process(
        checkpoint, [{"id": k, "input_ids": x.input_ids.tolist(), "images": images[k],
                      "prompt": x.header.generation.num_prompt, "greedy": MAX_TOKENS} for k, x in got.items()],
        str(tmp_path_factory.mktemp("images-generate-hf")))
    for key, sample in got.items():
        gen, media = sample.header.generation, sample.header.media
        assert gen.num_generated == MAX_TOKENS and gen.finish_reason == "length", gen
        prompt, response = sample.input_ids[:gen.num_prompt], sample.input_ids[gen.num_prompt:]
        assert response.tolist() == refs[key]["greedy"], key  # the model's answer is HF's greedy one
        mask = sample.loss_mask
        assert not mask[:gen.num_prompt].any() and mask[gen.num_prompt:].all()
        if images[key]:
            assert len(media.items) == len(images[key])
            assert all(i.offset + i.length <= gen.num_prompt for i in media.items)
            assert len(media.unexpanded) == len(prompt) - sum(i.length - 1 for i in media.items)
        else:
            assert media is None
        per_sample, per_token = relative_errors(sample.hidden_states, tiny_models.stacked(refs[key], LAYERS))
        record_error("kimi_k25 images, generated, float32 eager", per_sample, per_token)
        assert float(per_token.max()) <= TOLERANCE, (key, dict(zip(map(str, LAYERS), per_token.tolist())))
    from corecap.export.jsonl import sample_line
    from corecap.model import load_tokenizer

    line = sample_line("two", got["two"].header, got["two"].input_ids, load_tokenizer(checkpoint))
    assert [(i["offset"], i["length"]) for i in line["images"]] == [(i.offset, i.length)
                                                                     for i in got["two"].header.media.items]
    assert line["unexpanded_prompt_ids"] == got["two"].header.media.unexpanded.tolist()
    assert line["prompt_ids"] == got["two"].input_ids[:got["two"].header.generation.num_prompt].tolist()
    assert np.array_equal(got["answered"].input_ids[:got["answered"].header.generation.num_prompt][-1:],
                          got["text"].input_ids[got["text"].header.generation.num_prompt - 1:][:1])  # <|assistant|>
