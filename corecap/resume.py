"""What a rerun skips: the samples already in the store, each checked against its input (a
stored key whose input changed is an error, not a silent mix of two datasets)."""

from __future__ import annotations

import os

from corecap.errors import CorecapError
from corecap.generation import turn_key
from corecap.store import Store, input_fingerprint
from corecap.store.media import with_images


def committed_fingerprints(store_path: str) -> dict[str, str]:
    """key → input fingerprint (a response's: its prompt's) of every sample already in the store
    (empty for a new store)."""
    if not os.path.exists(os.path.join(store_path, "data.mdb")):
        return {}
    with Store.open(store_path) as store:
        return store.fingerprints()


class ResumeCheck:
    """Counts the samples of the input and those still to do (a conversation whose every turn the
    model rewrites is a sample a turn, KEY/turn-K); a stored key whose input changed is an error.
    A rewritten conversation's later prompts hold the model's earlier answers: only its first is
    the input's, and checked."""

    def __init__(self, committed: dict[str, str]):
        self.committed = committed
        self.todo = self.total = 0
        self.longest = 0  # the longest sample still to do, in tokens (its prompt with --max-tokens)

    def __call__(self, sample) -> None:
        keys = [turn_key(sample.key, k) for k in range(len(sample.points))] if sample.points else [sample.key]
        self.total += len(keys)
        todo = sum(key not in self.committed for key in keys)
        self.todo += todo
        if todo:
            self.longest = max(self.longest, len(sample.token_ids))
        stored = self.committed.get(keys[0])
        now = with_images(input_fingerprint(sample.token_ids), getattr(sample, "media", None))
        if stored is not None and stored != now:
            raise CorecapError(
                f"{sample.where}: sample {keys[0]!r} is already stored with input "
                f"fingerprint {stored}, but its input now has {now}"
            )
