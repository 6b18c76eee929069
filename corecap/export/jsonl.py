"""`corecap export --format jsonl`: a store's samples as text, one JSON object per line, so that
regenerated data (`corecap run --max-tokens`) can be read, filtered and shared. No hidden states:
the trainers' layouts (corecap/export/driver.py) carry those.

    corecap export --store out.lmdb --format jsonl --out samples.jsonl [--keys FILE] [--tokenizer DIR]

A sample the model answered (its header has a generation record) gives
    {"id", "prompt", "response", "finish_reason", "stop", "seed", "sampling",
     "prompt_ids", "response_ids", "loss_mask"}
and any other sample
    {"id", "text", "input_ids", "loss_mask"}
with, for a sample with images, "images" (each one's modality, offset, length, sha256, ref) and
"prompt_ids" (its prompt before the processor expanded each image's placeholder; for a sample
the model answered, "unexpanded_prompt_ids", its "prompt_ids" being the expanded prompt)
(docs/export.md has literal lines). Text is the token ids decoded with the model's tokenizer,
special tokens kept: a chat prompt reads as its template rendered it, since the store keeps the
tokens, not the row's messages (join on `id` with the input file for those). The ids are the
truth; the text is their reading.

Only headers are read (they hold the ids, the mask and the generation record), in one read
transaction, in the store's key order or `keys`' order, and each line is written as it is made:
memory stays at one sample whatever the store's size. The lines go to OUT.partial beside OUT
(locked: a second export into it is refused), fsync'd and renamed to OUT when complete; OUT is
never overwritten. An interrupted export leaves OUT.partial, and a rerun starts it over: reading
headers only, the whole export costs about what checking which lines are there would.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import lmdb
import numpy as np

from corecap.errors import CorecapError
from corecap.export.driver import select_keys
from corecap.export.files import fsync_dir
from corecap.progress import Progress
from corecap.store import Store
from corecap.store.checks import checked_header
from corecap.store.media import media_record
from corecap.store.format import SampleHeader
from corecap.store.store import key_text, prefixed


@dataclass(frozen=True, kw_only=True)
class JsonlSummary:
    out: str
    num_samples: int
    num_tokens: int
    num_generated: int  # samples whose response the model wrote
    num_unknown: int  # samples holding ids the tokenizer has no token for (left out of their text)
    nbytes: int
    seconds: float

    def line(self) -> str:
        generated = f", {self.num_generated} with the model's response" if self.num_generated else ""
        return (f"{self.out}: {self.num_samples} samples ({self.num_tokens} tokens{generated}) as JSONL text, "
                f"no hidden states; wrote {self.nbytes / 1e6:.1f} MB in {self.seconds:.1f}s")

    def notes(self, warnings: bool = True) -> list[str]:  # as ExportSummary's (a text export warns of nothing)
        if not self.num_unknown:
            return []
        return [f"{self.num_unknown} of {self.num_samples} samples hold token ids the tokenizer has no token for "
                "(ids past its vocabulary, e.g. the model's padding rows): their text leaves them out, "
                "their ids keep them"]


def export_jsonl(
    store_path: str, out: str, tokenizer, *, keys: list[str] | None = None, progress: bool | None = False,
    log=lambda line: None,
) -> JsonlSummary:
    """Write the store at `store_path` to the file `out` as JSONL (see the module docstring),
    decoding with `tokenizer` (a HF tokenizer: `decode(ids)` and `len()`)."""
    shown, out = out, os.path.abspath(out)  # messages name OUT as given
    partial = out + ".partial"
    with Store.open(store_path) as store:
        if os.path.lexists(out):
            raise CorecapError(f"{shown}: already exists (a finished export?); remove it or choose another --out")
        try:
            with store.env.begin(buffers=True) as txn:
                num_rows, _ = select_keys(txn, store, keys)
                f = _open_partial(partial, log)
                try:
                    log(f"exporting {num_rows} samples of {store.path} to {shown} "
                        "(jsonl: text and token ids, no hidden states)")
                    summary = _write(txn, store, f, shown, keys, num_rows, tokenizer, Progress(num_rows, progress))
                    if os.path.lexists(out):
                        raise CorecapError(f"{shown}: appeared while exporting; the export is complete in {partial}")
                    os.rename(partial, out)
                    fsync_dir(os.path.dirname(out))
                finally:
                    f.close()  # after the rename: the lock holds until OUT is in place
        except lmdb.Error as e:
            raise CorecapError(f"{store.path}: the LMDB itself is damaged ({e})") from None
    return summary


def _open_partial(partial: str, log):
    """OUT.partial, locked for this export and emptied (an interrupted export starts over)."""
    import fcntl

    if os.path.lexists(partial) and not os.path.isfile(partial):
        raise CorecapError(f"{partial}: exists and is not a file "
                           "(corecap export --format jsonl writes OUT there first); remove it")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise CorecapError(f"{partial}: another corecap export is writing there") from None
    if os.fstat(fd).st_size:
        log(f"corecap: note: {partial}: an interrupted export was left there: starting over")
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "w", encoding="utf-8")


def _write(txn, store: Store, f, out: str, keys, num_rows: int, tokenizer, progress: Progress) -> JsonlSummary:
    start = time.monotonic()
    num_tokens = num_generated = num_unknown = 0
    vocab = len(tokenizer)
    walk = ((key_text(store.path, bytes(k)) for k in txn.cursor(db=store.headers_db).iternext(keys=True, values=False))
            if keys is None else iter(keys))
    try:
        for key in walk:
            header_value = txn.get(key.encode(), db=store.headers_db)
            if header_value is None or txn.get(key.encode(), db=store.samples_db) is None:
                raise CorecapError(f"{store.path}: sample {key!r} has "
                                   f"{'no header' if header_value is None else 'no states'} "
                                   "(a damaged store: corecap verify)")
            header = prefixed(store.path, checked_header, key, header_value, store.meta)
            ids = np.frombuffer(header.input_ids, dtype="<i4")
            if len(ids) and int(ids.max()) >= vocab:
                num_unknown += 1
            num_generated += header.generation is not None
            line = json.dumps(sample_line(key, header, ids, tokenizer), ensure_ascii=False) + "\n"
            f.write(line)
            num_tokens += header.num_tokens
            progress.update(1, header.num_tokens)
        f.flush()
        os.fsync(f.fileno())
    finally:
        progress.close()
    return JsonlSummary(
        out=out, num_samples=num_rows, num_tokens=num_tokens, num_generated=num_generated, num_unknown=num_unknown,
        nbytes=os.fstat(f.fileno()).st_size, seconds=time.monotonic() - start,
    )


def sample_line(key: str, header: SampleHeader, ids: np.ndarray, tokenizer) -> dict:
    """One sample's JSONL object (the module docstring)."""
    mask = None if header.loss_mask is None else np.frombuffer(header.loss_mask, dtype=np.uint8).tolist()
    if header.media is not None and mask is None:  # 0 on every image token, as the trainers' layouts write it
        mask = header.media.masked(np.ones(header.num_tokens, np.uint8)).tolist()
    # its states hold NaN/Inf (--nonfinite store); its text is fine
    flags = {"nonfinite": True} if header.nonfinite else {}
    g = header.generation
    media = {} if header.media is None else media_record(header.media)  # its images' spans, hashes, refs
    if g is None:
        return {"id": key, "text": tokenizer.decode(ids.tolist()), **flags, "input_ids": ids.tolist(),
                "loss_mask": mask, **media}
    prompt, response = ids[: g.num_prompt].tolist(), ids[g.num_prompt :].tolist()
    if media:  # "prompt_ids" are the prompt's expanded ids here: the rendered ones are "unexpanded_prompt_ids"
        media = {"images": media["images"], "unexpanded_prompt_ids": media["prompt_ids"]}
    return {
        "id": key, "prompt": tokenizer.decode(prompt), "response": tokenizer.decode(response),
        "finish_reason": g.finish_reason, "stop": g.stop, "seed": g.seed, "sampling": g.sampling, **flags,
        "prompt_ids": prompt, "response_ids": response, "loss_mask": mask, **media,
    }
