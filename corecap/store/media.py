"""A sample's images (corecap run on conversations with images: docs/datasets.md, "Images"), as
its header stores them: per image the span of its tokens in the sample's (expanded) input_ids,
its modality, the SHA-256 of its file's bytes and the reference the row gave, and the prompt
as the chat template rendered it, one placeholder token per image, before the model's processor
expanded it (what a resume renders again and compares)."""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np


class MediaItem(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    modality: str  # "image"
    offset: int  # its first token in input_ids
    length: int  # its tokens (the loss mask is 0 on each)
    sha256: str  # of the file's bytes (a data: URL's decoded bytes)
    ref: str  # as the row gave it (a data: URL shortened to its media type)


class Media(msgspec.Struct, array_like=True, frozen=True, kw_only=True):
    items: tuple[MediaItem, ...]
    prompt_ids: bytes  # int32 little-endian: the rendered prompt, one placeholder token per image

    def problem(self, num_tokens: int) -> str | None:
        """What is wrong with it for a sample of `num_tokens` tokens (None: nothing)."""
        end = 0
        for item in self.items:
            if item.offset < end or item.length <= 0 or item.offset + item.length > num_tokens:
                return (f"image span ({item.offset}, {item.length}) overlaps another or lies outside its "
                        f"{num_tokens} tokens")
            end = item.offset + item.length
        return None

    def masked(self, mask: np.ndarray) -> np.ndarray:
        """A copy of `mask` (an entry a token) with 0 on every image token: what no trainer trains on."""
        out = np.array(mask, copy=True)
        for item in self.items:
            out[item.offset : item.offset + item.length] = 0
        return out

    @property
    def unexpanded(self) -> np.ndarray:
        return np.frombuffer(self.prompt_ids, "<i4").copy()

    def summary(self) -> str:
        """One line (`get`, `ls --long`): how many, each one's span and reference."""
        spans = "; ".join(f"{i.modality} at {i.offset}+{i.length} {i.ref} (sha256 {i.sha256[:12]})" for i in self.items)
        return f"{len(self.items)} image{'s' if len(self.items) != 1 else ''} ({spans})"

    def record(self) -> dict:
        """As JSON (`get --out`'s metadata, `export --format jsonl`)."""
        return media_record(self)


def media_record(media: Media) -> dict:
    """A sample's images as JSON (`corecap get --out`'s metadata, `export --format jsonl`)."""
    return {"images": [{"modality": i.modality, "offset": i.offset, "length": i.length, "sha256": i.sha256,
                        "ref": i.ref} for i in media.items],
            "prompt_ids": media.unexpanded.tolist()}


def with_images(fingerprint: str, media: Media | None) -> str:
    """An input fingerprint that also covers the images' bytes (a resume compares it): an image
    replaced by another of the same size gives the same ids, not the same sample."""
    if media is None:
        return fingerprint
    digest = hashlib.blake2b("".join(i.sha256 for i in media.items).encode(), digest_size=8).hexdigest()
    return f"{fingerprint}+images:{digest}"
