"""`corecap export` of samples with images: every format's loss mask, as each trainer's own
loader reads it, is 0 on every image token (a sample stored without a mask included), and
speculators' rows of those samples carry their conversation (`messages`, from --data) as its
own prepare-data keeps it for a model that takes images, read back through its own dataset and
`build_client_item`. The stores are built without an engine (tests/support/image_samples.py)."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import torch

from support.exports import exported, manifest, refused
from support.image_samples import check_image_mask, expected_mask, write_image_store
from support.speculators_reader import backend_transfer, speculators
from support.trainers import require_trainer
from support.verifier import VERIFIER_HIDDEN

AUX = (1, 2, 3)


def _store(tmp_path, captured, verifier):
    samples, spans, data, urls = write_image_store(str(tmp_path / "s"), captured, verifier, str(tmp_path / "rows"))
    return str(tmp_path / "s"), samples, spans, data, urls


def _image_urls(messages) -> list[str]:
    return [p["image_url"]["url"] for m in messages for p in m["content"] if p["type"] == "image_url"]


def test_speculators_rows_of_image_samples_carry_their_messages(tmp_path, captured, verifier):
    require_trainer("speculators")
    from speculators.train.data import build_client_item

    store, samples, spans, data, urls = _store(tmp_path, captured, verifier)
    out = tmp_path / "spec"
    result = exported(store, out, "speculators", "--data", data)
    assert "5 samples with images: loss mask 0 on their 35 image tokens" in result.output
    assert "not for the 1 the model answered" in result.output
    ArrowDataset, CollateFn, shift_batch, _, _ = speculators()
    dataset = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise")
    rows = manifest(out)
    for row in rows:
        key = row["key"]
        item = dataset[row["row"]]
        check_image_mask(item["loss_mask"], samples, spans, key)
        sent = build_client_item(dataset.data[row["row"]])  # what speculators sends vLLM for a missing hs file
        assert sent["input_ids"] == samples[key][0].tolist()
        if urls.get(key):
            assert _image_urls(sent["messages"]) == urls[key]  # Chat Completions, with the images
            for turn in sent["messages"]:
                assert turn["role"] in ("system", "user", "assistant") and isinstance(turn["content"], list)
        else:
            assert "messages" not in sent  # Completions, by the token ids
    first = next(r for r in rows if urls.get(r["key"]) and len(urls[r["key"]]) == 1 and "data:" not in urls[r["key"]][0]
                 and samples[r["key"]][0].size == 23)
    turns = build_client_item(dataset.data[first["row"]])["messages"]
    assert [t["role"] for t in turns] == ["user", "assistant"]
    assert [p["text"] for p in turns[0]["content"]] == ["What is on the left?", None]  # a part's unused fields: null
    assert turns[1]["content"][0]["text"] == "A red square."
    # shift_batch trains position t on token t + 1: an image token's mask stays 0 after the shift.
    batch = CollateFn(max_len=512, hidden_size=VERIFIER_HIDDEN, num_target_layers=len(AUX), dtype=torch.float32,
                      preprocess=shift_batch)([dataset[i] for i in range(len(dataset))])
    at = 0
    for row in rows:
        n = samples[row["key"]][0].size - 1
        assert torch.equal(batch["loss_mask"][0, at : at + n], expected_mask(samples, spans, row["key"])[1:])
        at += n
    # token_freq.pt (its draft vocabulary) counts trained-on tokens only: no image token's id.
    counts: dict[int, int] = {}
    for key, (ids, _, _) in samples.items():
        for t in ids[expected_mask(samples, spans, key).numpy().astype(bool)].tolist():
            counts[t] = counts.get(t, 0) + 1
    assert torch.load(out / "token_freq.pt") == counts


def test_speculators_without_data_and_its_fp8_files(tmp_path, captured, verifier):
    """Without --data the table is the text layout (no `messages`) and the note says what that
    means; the fp8 files' rows carry the same masks."""
    require_trainer("speculators")
    store, samples, spans, _, _ = _store(tmp_path, captured, verifier)
    out = tmp_path / "fp8"
    result = exported(store, out, "speculators", "--dtype", "fp8")
    assert "their rows carry no `messages`" in result.output and "--data FILE writes them" in result.output
    ArrowDataset, *_ = speculators()
    dataset = ArrowDataset(max_len=512, datapath=str(out), on_missing="raise", transfer=backend_transfer("fp8", out))
    assert "messages" not in dataset.data.column_names
    for row in manifest(out):
        check_image_mask(dataset[row["row"]]["loss_mask"], samples, spans, row["key"])


def test_specforge_eagle3_dflash_and_dspark_masks(tmp_path, captured, verifier):
    require_trainer("specforge")
    from specforge.algorithms.dflash.providers import create_registration as dflash
    from specforge.algorithms.dspark.providers import create_registration as dspark
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    store, samples, spans, _, _ = _store(tmp_path, captured, verifier)
    out = tmp_path / "sf"
    exported(store, out, "specforge")
    for row in manifest(out):
        raw = load_feature_file(str(out / row["file"]))
        check_image_mask(raw["loss_mask"], samples, spans, row["key"])
        norm = normalize_offline_sample(raw, max_len=512)
        want = expected_mask(samples, spans, row["key"])
        want[-1] = 0  # its normalizer never trains on the last position
        assert torch.equal(norm["loss_mask"][0], want)
    for fmt, registration in (("specforge-dflash", dflash), ("specforge-dspark", dspark)):
        out = tmp_path / fmt
        exported(store, out, fmt)
        normalize = registration().providers.offline_for("text").build_normalizer(512)
        rows = manifest(out)
        assert {r["key"] for r in rows} >= set(spans)  # every sample with images has consecutive trained tokens
        for row in rows:
            check_image_mask(normalize(load_feature_file(str(out / row["file"])))["loss_mask"][0], samples, spans,
                             row["key"])


def test_modelopt_masks_and_its_note(tmp_path, captured, verifier):
    require_trainer("modelopt")
    from modelopt.torch.speculative.eagle.utils import EagleOfflineDataCollator, OfflineSupervisedDataset

    store, samples, spans, _, _ = _store(tmp_path, captured, verifier)
    out = tmp_path / "mo"
    result = exported(store, out, "modelopt")
    assert "training.answer_only_loss=true" in result.output and "image tokens included" in result.output
    by_file = {str(out / r["file"]): r["key"] for r in manifest(out)}
    files = [str(p) for p in pathlib.Path(out).rglob("*.pt")]  # as its trainer lists them
    dataset = OfflineSupervisedDataset(files, answer_only_loss=True)
    items = [dataset[i] for i in range(len(dataset))]
    for path, item in zip(files, items):
        check_image_mask(item["loss_mask"], samples, spans, by_file[path])
    batch = EagleOfflineDataCollator(train_len=64)(items)
    for j, path in enumerate(files):
        key = by_file[path]
        n = samples[key][0].size
        assert torch.equal(batch["loss_mask"][j, :n], expected_mask(samples, spans, key))


def test_deepspec_masks(tmp_path, captured, verifier):
    from support.deepspec_reader import TargetCache

    store, samples, spans, _, _ = _store(tmp_path, captured, verifier)
    out = tmp_path / "ds"
    exported(store, out, "deepspec")
    cache = TargetCache(str(out))
    for row in manifest(out):
        check_image_mask(cache[row["row"]]["loss_mask"], samples, spans, row["key"])


def test_jsonl_lines_of_image_samples(tmp_path, captured, verifier, tiny_model):
    store, samples, spans, _, _ = _store(tmp_path, captured, verifier)
    out = tmp_path / "x.jsonl"
    exported(store, out, "jsonl", "--tokenizer", tiny_model)
    lines = {line["id"]: line for line in map(json.loads, open(out))}
    for key, placed in spans.items():
        line = lines[key]
        check_image_mask(torch.tensor(line["loss_mask"]), samples, spans, key)
        assert [(i["offset"], i["length"]) for i in line["images"]] == placed


def test_the_no_mask_note_counts_the_image_tokens_it_zeroed(tmp_path, captured, verifier):
    """A sample stored without a loss mask is exported with ones but on its image tokens, and the
    note says so: for the whole store (samples without a mask, with images and without), and for
    --keys naming only the one with images."""
    store, samples, spans, _, _ = _store(tmp_path, captured, verifier)
    no_mask = [k for k, (_, mask, _) in samples.items() if mask is None]
    with_images = [k for k in no_mask if k in spans]
    assert len(with_images) == 1 and len(no_mask) > 1  # image_samples' 40-token sample, and text ones
    tokens = sum(length for _, length in spans[with_images[0]])
    result = exported(store, tmp_path / "all", "deepspec")
    assert (f"{len(no_mask)} of {len(samples)} samples had no loss mask: exported with all ones (every token trained "
            f"on) except the {tokens} image tokens of the 1 with images") in result.output.splitlines()
    keys = tmp_path / "keys.txt"
    keys.write_text(with_images[0] + "\n")
    result = exported(store, tmp_path / "one", "deepspec", "--keys", str(keys))
    assert (f"1 of 1 samples had no loss mask: exported with all ones except their {tokens} image tokens"
            in result.output.splitlines())
    assert (f"1 of 1 samples had no loss mask: exported with all ones except their {tokens} image tokens"
            in json.load(open(tmp_path / "one" / "corecap_export.json"))["notes"])


def test_data_must_be_the_rows_the_store_was_captured_from(tmp_path, captured, verifier):
    store, samples, spans, data, _ = _store(tmp_path, captured, verifier)
    assert refused(tmp_path, store, "specforge", "--data", data) == (
        "corecap: error: --data applies to --format speculators only (its rows of samples with images carry the "
        "conversation); --format specforge writes token ids and loss masks")
    assert refused(tmp_path, store, "speculators", "--image-dir", str(tmp_path)) == (
        "corecap: error: --image-dir applies with --data (where the data file's images are)")
    # An image replaced by another: the row is not the stored sample's, refused before OUT.partial is made.
    stored = _replace_image(data, "e.png", "a.png")
    result = refused(tmp_path, store, "speculators", "--data", data)
    line_no = next(i for i, line in enumerate(open(data), 1) if '"image": "img/e.png"' in line)
    key = next(k for k in spans if samples[k][0].size == 26)
    assert result == (f"corecap: error: {data}:{line_no}: its 1 image(s) are not those of the stored sample {key!r} "
                      f"(1 image(s), SHA-256 {stored}): expected the data file and "
                      "--image-dir the store was captured from")
    # A sample with images whose key no row has.
    kept = [line for line in open(data) if '"image": "img/e.png"' not in line]
    other = tmp_path / "other.jsonl"
    other.write_text("".join(kept))
    os.symlink(os.path.join(os.path.dirname(data), "img"), tmp_path / "img")
    assert refused(tmp_path, store, "speculators", "--data", str(other)) == (
        f"corecap: error: --data {other}: no row with images has key {key!r}, a sample with 1 image(s) in the store "
        "(expected the file the store was captured from)")


def test_every_bad_data_row_is_refused_at_once_before_anything_is_written(tmp_path, captured, verifier, monkeypatch):
    """A row whose image is missing, a sample whose row is gone and a row whose image differs are
    reported together, and neither a fresh OUT.partial, an interrupted one nor an existing OUT is
    touched."""
    require_trainer("speculators")
    from corecap.data.conversations import Conversations
    from support.exports import export, interrupt

    store, samples, spans, data, _ = _store(tmp_path, captured, verifier)
    exports = tmp_path / "exports"
    exports.mkdir()
    interrupt(store, exports / "resumable", "speculators", monkeypatch, after=2, conversations=Conversations(data))
    before = _tree(exports)
    assert len(before) > 2  # its corecap_export.json and sample files
    (exports / "done").mkdir()
    (exports / "done" / "kept.txt").write_text("a finished export")
    by_length = {samples[k][0].size: k for k in spans}
    missing, gone, differs = by_length[23], by_length[40], by_length[26]
    stored = _replace_image(data, "e.png", "a.png")
    bad = os.path.join(os.path.dirname(data), "bad.jsonl")  # beside img/
    rows = [json.loads(line) for line in open(data)]
    with open(bad, "w") as f:
        for row in rows:
            if row["id"] == gone:
                continue
            if row["id"] == missing:
                row["messages"][0]["content"][1]["image_url"]["url"] = "img/nowhere.png"
            f.write(json.dumps(row) + "\n")
    line_of = {json.loads(line)["id"]: i for i, line in enumerate(open(bad), 1)}
    expected = sorted([
        f"  {bad}:{line_of[missing]}: img/nowhere.png: image 'img/nowhere.png' not found "
        f"({os.path.join(os.path.dirname(data), 'img', 'nowhere.png')})",
        f"  --data {bad}: no row with images has key {gone!r}, a sample with 2 image(s) in the store (expected the "
        "file the store was captured from)",
        f"  {bad}:{line_of[differs]}: its 1 image(s) are not those of the stored sample {differs!r} (1 image(s), "
        f"SHA-256 {stored}): expected the data file and --image-dir the store was captured "
        "from",
    ])
    for out in ("fresh", "resumable", "done"):
        result = export(store, exports / out, "speculators", "--data", bad)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        if out == "done":
            assert lines == [f"corecap: error: {exports / out}: already exists (a finished export?); remove it or "
                             "choose another --out"]
        else:
            assert lines[0] == (f"corecap: error: --data {bad}: 3 samples with images do not match their rows "
                                "(expected the data file and --image-dir the store was captured from):")
            assert sorted(lines[1:]) == expected
        assert _tree(exports) == {**before, "done/kept.txt": b"a finished export"}, out


def _replace_image(data: str, name: str, by: str) -> str:
    """The data file's image `name` overwritten with the bytes of `by`; returns the first 12 hex
    digits of the SHA-256 of the bytes it had (those the store was captured from)."""
    img = os.path.join(os.path.dirname(data), "img")
    with open(os.path.join(img, name), "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    with open(os.path.join(img, name), "wb") as f:
        f.write(open(os.path.join(img, by), "rb").read())
    return digest


def _tree(root) -> dict[str, bytes]:
    """Every file under `root` by its relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in pathlib.Path(root).rglob("*") if p.is_file()}


def test_every_format_without_images_is_unchanged(tmp_path, captured, verifier):
    """A store without images gives no images note, and the masks as stored."""
    from support.verifier import write_captured_store

    store = write_captured_store(str(tmp_path / "s"), captured, verifier)
    result = exported(store, tmp_path / "mo", "modelopt")
    assert "with images" not in result.output
    assert (f"{sum(m is None for _, m, _ in captured.values())} of {len(captured)} samples had no loss mask: exported "
            "with all ones (every token trained on)") in result.output.splitlines()
    for row in manifest(tmp_path / "mo"):
        ids, mask, _ = captured[row["key"]]
        got = torch.load(tmp_path / "mo" / row["file"])["loss_mask"]
        assert torch.equal(got, torch.ones(ids.size, dtype=torch.int64) if mask is None
                           else torch.from_numpy(mask.astype(np.int64)))
