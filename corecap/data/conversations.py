"""A data file's conversations with images, by the key `corecap run` gave each sample, as
OpenAI-style messages: what `corecap export --format speculators --data FILE` writes in the
`messages` column speculators' prepare-data keeps beside `input_ids` and `loss_mask` for a model
that takes images (corecap/export/speculators.py writes the table).

speculators 0.9.0 stores, for a conversation with images, the conversation itself
(speculators/data_generation/preprocessing.py: `_adapt_conv_for_vllm`): each turn's `content` a
list of parts, `{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url":
"file:///..."}}`. Its trainer reads the column only to make a sample's hidden states again when its
hs file is missing (speculators/train/data.py: `build_client_item` sends the messages to vLLM's
Chat Completions, since token ids alone carry no images, and checks that vLLM's prompt ids are the
row's `input_ids`); a row whose messages hold no list content goes by its token ids.

The store keeps the tokens, not the row's messages, so they come from the data file the store was
captured from, joined on the sample's key as `corecap run` made it (the row's `id`, else its line
number). Each image of a row must be the stored sample's (its bytes' SHA-256), so the messages are
the sample's. `join` checks every sample to export against its row (parsed, each image read and
hashed) before the export writes anything, and reports every bad row in one error
(corecap/data/problems.py): a wrong file or image directory costs no partial export and one rerun.
Every turn's content is a list of parts, as speculators' own ShareGPT4V conversion
writes them, so that one Arrow column holds every row (a text turn's string would be another type).
"""

from __future__ import annotations

import base64
import os
import urllib.parse

from corecap.data.chat import parse_messages
from corecap.data.media import Images
from corecap.data.problems import Problems
from corecap.data.rows import RowError, open_rows
from corecap.data.samples import row_key
from corecap.errors import CorecapError


class Conversations:
    """The data file's conversations with images, by key, as OpenAI-style messages."""

    def __init__(self, path: str, image_dir: str | None = None):
        self.path = path
        self.images = Images(image_dir or os.path.dirname(os.path.abspath(path)))
        self._rows: dict[str, tuple[str, dict]] = {}  # key → (where, row) of each row that names an image
        self._messages: dict[str, list[dict]] = {}  # key → its messages, once `join` checked them
        with open_rows(path) as (_, rows):
            for n, where, obj in rows:
                if isinstance(obj, dict) and _names_images(obj):
                    try:
                        self._rows[row_key(obj, where, n)] = (where, obj)
                    except RowError:
                        continue  # a row `corecap run` refused stored no sample

    def join(self, samples) -> None:
        """Check the rows of `samples` ((key, header) of each sample to export) before anything
        is written: every sample with images has a row, which parses, and whose images' bytes have
        the stored SHA-256s. A sample the model answered is not joined: its answer is not in the
        data file. Every bad row is reported in one error; the good rows' messages are kept for
        `messages`, and the rows themselves let go."""
        problems = Problems(self.path, "samples with images do not match their rows (expected the data file and "
                                       "--image-dir the store was captured from)")
        for key, header in samples:
            if header.media is None or header.generation is not None:
                continue
            try:
                self._messages[key] = self._checked(key, header.media)
            except CorecapError as e:  # RowError: the row's own problem (its place in the file first)
                problems.add(str(e))
        self._rows.clear()
        problems.raise_if_any()

    def messages(self, key: str) -> list[dict]:
        """The joined sample's conversation with its images, every content a list of parts."""
        assert key in self._messages, key  # the export joins every sample with images first
        return self._messages[key]

    def _checked(self, key: str, media) -> list[dict]:
        if key not in self._rows:
            raise CorecapError(f"--data {self.path}: no row with images has key {key!r}, a sample with "
                               f"{len(media.items)} image(s) in the store (expected the file the store was captured "
                               "from)")
        where, obj = self._rows[key]
        found: list = []
        name = "messages" if "messages" in obj else "conversations"
        turns = parse_messages(obj, name, where, images=self.images, found=found)
        digests = [self.images.check(image, where, image.ref) for image in found]
        stored = [item.sha256 for item in media.items]
        if digests != stored:
            raise CorecapError(f"{where}: its {len(digests)} image(s) are not those of the stored sample {key!r} "
                               f"({len(stored)} image(s), SHA-256 {', '.join(s[:12] for s in stored)}): expected the "
                               "data file and --image-dir the store was captured from")
        sources = iter(found)
        return [{"role": t["role"], "content": _parts(t["content"], sources)} for t in turns]


def _names_images(obj: dict) -> bool:
    """Whether a row may hold an image (the full check is parse_messages's, on the rows exported)."""
    if "image" in obj or "images" in obj:
        return True
    turns = obj.get("messages", obj.get("conversations"))
    return isinstance(turns, list) and any(
        isinstance(t, dict) and isinstance(t.get("content", t.get("value")), list) for t in turns)


def _parts(content, sources) -> list[dict]:
    """A turn's content as speculators' parts: text parts, and each image as an `image_url` part
    with an absolute file:// URL (a data: URL's bytes as a data: URL again)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    out = []
    for part in content:
        if part["type"] == "text":
            out.append({"type": "text", "text": part["text"]})
            continue
        image = next(sources)
        if image.data is not None:
            kind = image.ref.removeprefix("data:").split(";", 1)[0] or "image/png"
            url = f"data:{kind};base64,{base64.b64encode(image.data).decode()}"
        else:
            url = "file://" + urllib.parse.quote(image.path)
        out.append({"type": "image_url", "image_url": {"url": url}})
    return out
