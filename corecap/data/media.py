"""Images in conversations: a message's `content` as a list of parts (OpenAI's `text` and
`image_url` parts, or `{"type": "image", "image": ...}`), and ShareGPT/LLaVA's row-level `image`
(a reference or a list of them) with an `<image>` in the turns' text for each. docs/datasets.md
("Images") has the formats.

Images come from the local disk only: a path (relative ones under the image directory), a
`file://` URL, or a `data:` URL with base64 bytes. The image directory is the data file's own,
unless `--image-dir` names another; a path outside it, a URL of any other scheme, a file that
is missing or does not decode, and video or audio parts are refused in one line naming the row.
All of it is checked here, before vLLM is imported (corecap/data/samples.py's first pass)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import urllib.parse
from dataclasses import dataclass

import numpy as np

from corecap.data.rows import RowError
from corecap.errors import CorecapError
from corecap.store.media import Media, MediaItem

IMAGE_TAG = "<image>"  # ShareGPT/LLaVA: where an image goes in a turn's text
_MEDIA_KINDS = ("video", "video_url", "input_video", "audio", "audio_url", "input_audio")
_DATA_URL = re.compile(r"data:(image/[\w.+-]+)?(;[^,]*)?,", re.S)
MAX_IMAGE_PIXELS = 178_956_970  # PIL's own bound on a decoded image (its decompression-bomb check, x2)


@dataclass(frozen=True)
class ImageRef:
    """An image a row names: `ref` as written (a data: URL shortened), and its bytes' source."""

    ref: str
    path: str | None = None  # a local file
    data: bytes | None = None  # a data: URL's bytes

    @property
    def source(self):
        return self.data if self.data is not None else self.path

    def read(self) -> bytes:
        if self.data is not None:
            return self.data
        with open(self.path, "rb") as f:
            return f.read()


# The architectures whose image input corecap captures (exact against HF: tests/test_images.py).
IMAGE_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)


class Images:
    """Resolves and checks the images rows name; `directory`: where they may be (`--image-dir`).
    `refusal`: why the model takes none (a row with an image stops the run, in one line)."""

    def __init__(self, directory: str, refusal: str | None = None):
        self.directory = os.path.realpath(directory)
        self.refusal = refusal
        self._checked: dict[str, str] = {}  # path → sha256, for an image many rows share

    @classmethod
    def for_model(cls, architecture: str, directory: str) -> "Images":
        refusal = None
        if architecture not in IMAGE_ARCHITECTURES:
            refusal = (f"the row has images, and corecap captures image input for {', '.join(IMAGE_ARCHITECTURES)} "
                       f"only, not {architecture}")
        return cls(directory, refusal)

    def resolve(self, value, where: str, at: str) -> ImageRef:
        if self.refusal:
            raise CorecapError(f"{where}: {self.refusal}")
        if not isinstance(value, str) or not value:
            raise RowError(where, f"{at}: expected an image URL or path (a non-empty string), got {value!r}"[:300],
                           "bad image")
        if value.startswith("data:"):
            m = _DATA_URL.match(value)
            if m is None or not (m.group(2) or "").endswith(";base64"):
                raise RowError(where, f"{at}: a data: URL must be base64 (data:image/...;base64,...)", "bad image")
            try:
                data = base64.b64decode(value[m.end():], validate=True)
            except (binascii.Error, ValueError) as e:
                raise RowError(where, f"{at}: the data: URL's base64 does not decode ({e})", "bad image") from None
            return ImageRef(f"data:{m.group(1) or ''};base64,...", data=data)
        parsed = urllib.parse.urlsplit(value)
        if parsed.scheme == "file":
            if parsed.netloc not in ("", "localhost"):
                raise RowError(where, f"{at}: {value!r} is on another host (corecap reads images from local disk only)",
                               "image not local")
            path = urllib.parse.unquote(parsed.path)
        elif len(parsed.scheme) > 1:  # a URL; a one-letter scheme is a Windows drive
            raise RowError(where, f"{at}: {value[:200]!r} is not a local image (corecap reads images from local disk "
                           "only: a path, a file:// URL or a data: URL)", "image not local")
        else:
            path = value
        full = os.path.realpath(os.path.join(self.directory, path))
        if os.path.commonpath([full, self.directory]) != self.directory:
            raise RowError(where, f"{at}: {value!r} is outside the image directory {self.directory} "
                           "(--image-dir names another)", "image outside the image directory")
        return ImageRef(value, path=full)

    def check(self, image: ImageRef, where: str, at: str) -> str:
        """The image decodes whole, within the size bound: its bytes' SHA-256."""
        key = image.path
        if key is not None and key in self._checked:
            return self._checked[key]
        try:
            raw = image.read()
        except FileNotFoundError:
            raise RowError(where, f"{at}: image {image.ref!r} not found ({image.path})", "image not found") from None
        except OSError as e:
            raise RowError(where, f"{at}: image {image.ref!r} cannot be read ({e.strerror})",
                           "image not found") from None
        problem = decode_problem(raw)
        if problem:
            raise RowError(where, f"{at}: image {image.ref!r} {problem}", "image does not decode")
        digest = hashlib.sha256(raw).hexdigest()
        if key is not None:
            self._checked[key] = digest
        return digest


def decode_problem(raw: bytes) -> str | None:
    import io
    import warnings

    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                if image.width * image.height > MAX_IMAGE_PIXELS:
                    return f"is {image.width} x {image.height} pixels, more than {MAX_IMAGE_PIXELS:,}"
                image.load()
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        return f"is too large to decode ({e})"
    except Exception as e:  # PIL raises many types for a broken file
        return f"does not decode as an image ({type(e).__name__}: {str(e)[:200]})"
    return None


def message_content(content, where: str, at: str, images: Images | None, found: list) -> object:
    """A message's content: a string as it is; a list of parts checked, its images resolved and
    appended to `found` (ImageRefs) and replaced by `{"type": "image"}` (what chat templates
    render as the model's image placeholder); a list of text parts only is joined into a string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(where, f"{at} must be a string, got {type(content).__name__} (or a list of content parts)",
                       "non-string content")
    parts, has_image = [], False
    for j, part in enumerate(content):
        pat = f"{at}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise RowError(where, f"{pat}: a text part's 'text' must be a string", "bad content part")
            parts.append({"type": "text", "text": text})
        elif kind in ("image_url", "image"):
            value = part.get(kind)
            if kind == "image_url" and isinstance(value, dict):
                value = value.get("url")
            elif kind == "image" and value is None:
                value = part.get("url", part.get("path"))
            if images is None:
                raise CorecapError(f"{where}: {pat}: an image, which this command does not read (corecap run does)")
            found.append(images.resolve(value, where, pat))
            parts.append({"type": "image"})
            has_image = True
        elif kind in _MEDIA_KINDS:
            raise RowError(where, f"{pat}: a {kind} part (corecap takes images only: video and audio are not "
                           "supported)", "video or audio")
        else:
            raise RowError(where, f"{pat}: unknown content part {kind!r} (expected 'text', 'image_url' or 'image')",
                           "bad content part")
    if not has_image:
        return "".join(p["text"] for p in parts)
    return parts


def sharegpt_images(obj: dict, where: str) -> list | None:
    """A ShareGPT/LLaVA row's `image` (or `images`): its references, None when it has none."""
    names = [n for n in ("image", "images") if n in obj]
    if not names:
        return None
    if len(names) > 1:
        raise RowError(where, "fields 'image' and 'images' both given", "bad image")
    value = obj[names[0]]
    refs = [value] if isinstance(value, str) else value
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        raise RowError(where, f"field {names[0]!r} must be an image path or a non-empty list of them", "bad image")
    return refs


def split_image_tags(text: str) -> list:
    """A ShareGPT turn's text as parts, an image part at each `<image>`."""
    parts = []
    for k, piece in enumerate(text.split(IMAGE_TAG)):
        if k:
            parts.append({"type": "image"})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def has_image_parts(messages) -> bool:
    return any(isinstance(m["content"], list) for m in messages)


def text_of(content) -> str:
    """A content's text (image parts left out): for the checks on empty turns."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content)


def checked_images(found: list, images: Images, where: str) -> list:
    """(image, its bytes' SHA-256) for each image a conversation names, each one decoded."""
    return [(image, images.check(image, where, image.ref)) for image in found]


def too_long_with_images(key: str, num_tokens: int, max_len: int, overflow: str, where: str) -> tuple:
    """The outcome of a sample with images longer than --max-len: never truncated (a cut inside
    or before an image is not what the model saw)."""
    too_long = f"sample {key!r} has {num_tokens} tokens with its images, more than --max-len {max_len}"
    if overflow == "skip":
        return "skipped", RowError(where, too_long, "longer than --max-len")
    return "invalid", RowError(where, f"{too_long} (a sample with images is not truncated: --overflow skip leaves "
                               "it out)", "longer than --max-len")


def expanded(ids: np.ndarray | None, mask: np.ndarray | None, found, expand, where: str):
    """A rendered conversation with images, as the model's processor expands it: its token ids,
    its loss mask (0 on every image token), and the store's record of its images (None, the ids
    and mask as they are: no images, or nothing rendered)."""
    if not found or ids is None:
        return ids, mask, None
    if expand is None:
        raise CorecapError(f"{where}: a conversation with images needs the model's processor (vLLM's) to render")
    try:
        out = expand(ids, [image.source for image, _ in found])
    except RowError:
        raise
    except Exception as e:  # the processor's own refusal (a placeholder count that does not match, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RowError(where, f"the model's processor refused its images ({type(e).__name__}: {first[:300]})",
                       "images refused") from None
    spans = out.spans
    if len(spans) != len(found):
        raise RowError(where, f"the model's processor found {len(spans)} image placeholders for {len(found)} images",
                       "images refused")
    # Each placeholder token became its image's span: the other tokens are the rendered ones, in order.
    keep = np.ones(len(out.token_ids), bool)
    for offset, length in spans:
        keep[offset:offset + length] = False
    placeholders = np.asarray(_placeholder_positions(spans), np.int64)
    if len(placeholders) and (placeholders.min() < 0 or placeholders.max() >= len(ids)):
        raise RowError(where, "the model's processor put an image outside the prompt", "images refused")
    rest = np.delete(ids, placeholders)
    if not np.array_equal(out.token_ids[keep], rest):
        raise RowError(where, "the model's processor changed the prompt's tokens beyond replacing each image "
                       "placeholder with the image's tokens", "images refused")
    new_mask = None
    if mask is not None:
        new_mask = np.zeros(len(out.token_ids), np.uint8)
        new_mask[keep] = np.delete(mask, placeholders)
    items = tuple(MediaItem(modality="image", offset=o, length=n, sha256=digest, ref=image.ref)
                  for (o, n), (image, digest) in zip(spans, found))
    media = Media(items=items, prompt_ids=np.asarray(ids, "<i4").tobytes())
    return out.token_ids.astype(np.int32), new_mask, media


def _placeholder_positions(spans) -> list[int]:
    """Where each image's one placeholder token was in the rendered ids: span k starts at
    position p_k + (tokens the earlier spans added), p_k the placeholder's position."""
    out, added = [], 0
    for offset, length in spans:
        out.append(offset - added)
        added += length - 1
    return out
