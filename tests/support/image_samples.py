"""Samples with images without an engine, for the export tests: the `captured` fixture's
samples (HF's states of the tiny verifier), some of them given images as `corecap run` on image
rows stores them (each image's span in input_ids, the SHA-256 of its file, the row's reference,
the unexpanded prompt; loss mask 0 on every image token), the image files, and the data file of
the rows they came from, in each layout corecap reads (OpenAI parts, HF's image part, a data:
URL, ShareGPT/LLaVA's `image`). One sample has images and no stored loss mask, and one is a
response the model wrote (--max-tokens), with an image in its prompt."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os

import numpy as np
import torch

from support.verifier import write_captured_store

PAD = 7  # the image placeholder in the unexpanded prompt (any id: the export never reads it)


def _png(colour: tuple[int, int, int]) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4, 3), colour).save(out, format="PNG")
    return out.getvalue()


def _keys_by_length(captured) -> dict[int, str]:
    return {ids.size: key for key, (ids, _, _) in captured.items()}


def image_samples(captured, directory: str):
    """(captured with images, {key: [(offset, length), ...]}, {key: encode_sample fields},
    the data file, {key: the image URLs speculators' messages must hold}). `captured`'s samples of
    23, 40, 31, 26 and 19 tokens get images; 40's loss mask is None (stored without one); 19's is
    a response the model wrote after its first 12 tokens."""
    from corecap.store.format import Generation
    from corecap.store.media import Media, MediaItem

    os.makedirs(os.path.join(directory, "img"), exist_ok=True)
    png = {name: _png(colour) for name, colour in
           (("a", (255, 0, 0)), ("b", (0, 255, 0)), ("c", (0, 0, 255)), ("d", (9, 9, 9)), ("e", (1, 2, 3)))}
    for name, raw in png.items():
        with open(os.path.join(directory, "img", f"{name}.png"), "wb") as f:
            f.write(raw)
    url = {name: "file://" + os.path.join(os.path.realpath(directory), "img", f"{name}.png") for name in png}
    data_url = "data:image/png;base64," + base64.b64encode(png["c"]).decode()
    by_length = _keys_by_length(captured)
    a, b, c, d, e = (by_length[n] for n in (23, 40, 31, 26, 19))
    user = [{"type": "text", "text": "What is on the left?"}]
    rows = {
        a: {"messages": [{"role": "user", "content": [*user, {"type": "image_url", "image_url": {"url": "img/a.png"}}]},
                         {"role": "assistant", "content": "A red square."}]},
        b: {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/b.png"}, {"type": "text",
                                                                                                "text": "and"},
                                                      {"type": "image_url", "image_url": url["d"]}]},
                         {"role": "assistant", "content": "Two squares."}]},
        c: {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}}]},
                         {"role": "assistant", "content": "Blue."}]},
        d: {"image": "img/e.png", "conversations": [{"from": "human", "value": "<image>\nWhat colour?"},
                                                    {"from": "gpt", "value": "Grey."}]},
        e: {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "img/a.png"}}]}]},
    }
    images = {a: [("a", 3, 6)], b: [("b", 2, 5), ("d", 20, 8)], c: [("c", 10, 6)], d: [("e", 5, 7)], e: [("a", 4, 3)]}
    urls = {a: [url["a"]], b: [url["b"], url["d"]], c: [data_url], d: [url["e"]], e: []}
    out, spans, fields = dict(captured), {}, {}
    for key, placed in images.items():
        ids, mask, ref = captured[key]
        if key == b:
            mask = None  # stored without a loss mask: the export must still give its image tokens 0
        elif key == e:
            mask = (np.arange(ids.size) >= 12).astype(np.uint8)  # the response the model wrote
        else:
            mask = np.ones(ids.size, np.uint8) if mask is None else mask.copy()
            mask[0] = 0
            mask[ids.size - 1] = 1
        unexpanded = []
        at = 0
        for _, offset, length in placed:
            unexpanded += ids[at:offset].tolist() + [PAD]
            at = offset + length
            if mask is not None:
                mask[offset : offset + length] = 0
        unexpanded += ids[at:].tolist()
        items = tuple(MediaItem(modality="image", offset=offset, length=length,
                                sha256=hashlib.sha256(png[name]).hexdigest(), ref=f"img/{name}.png")
                      for name, offset, length in placed)
        fields[key] = {"media": Media(items=items, prompt_ids=np.asarray(unexpanded, "<i4").tobytes())}
        if key == e:
            fields[key]["generation"] = Generation(num_prompt=12, num_generated=ids.size - 12, finish_reason="length")
        out[key] = (ids, mask, ref)
        spans[key] = [(offset, length) for _, offset, length in placed]
    data = os.path.join(directory, "rows.jsonl")
    text = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with open(data, "w") as f:
        for key in captured:
            row = rows.get(key, text)
            f.write(json.dumps({"id": key, **row}) + "\n")
    return out, spans, fields, data, urls


def write_image_store(path: str, captured, verifier: str, directory: str, **options):
    """A store of `captured` with images (image_samples), and what the tests compare with."""
    samples, spans, fields, data, urls = image_samples(captured, directory)
    write_captured_store(path, samples, verifier, fields=fields, **options)
    return samples, spans, data, urls


def expected_mask(samples, spans, key) -> torch.Tensor:
    """What every format must export: the stored mask (all ones without one), 0 on each image token."""
    ids, mask, _ = samples[key]
    out = torch.ones(ids.size, dtype=torch.int64) if mask is None else torch.from_numpy(mask.astype(np.int64))
    for offset, length in spans.get(key, ()):
        out[offset : offset + length] = 0
    return out


def check_image_mask(got: torch.Tensor, samples, spans, key) -> None:
    """`got` is the mask the format must export for `key`: its image tokens are 0, and it is not
    all zeros where the sample trains on something."""
    want = expected_mask(samples, spans, key)
    assert torch.equal(got.to(torch.int64), want), (key, got, want)
    for offset, length in spans.get(key, ()):
        assert not got[offset : offset + length].any(), key
