"""`corecap.ServerDataset`: a torch IterableDataset whose samples a `corecap serve` captures as
the trainer reads them (online training), for any PyTorch trainer.

    from corecap import ServerDataset
    ds = ServerDataset("data.jsonl", "http://127.0.0.1:8000", done=finished_keys)
    loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2)  # padded (training/collate.py)
    # each item: {"key": str, "input_ids": [T] int64, "loss_mask": [T] int64,
    #  "hidden_states": [L, T, H] (the server's file layers), and with max_tokens > 1:
    #  "num_prompt": int, "finish_reason": str}: StoreDataset's items, so its collate pads them

Rows are what `corecap run --data` takes (a JSONL, JSON or Parquet path, or a list of dicts):
`input_ids` (with an optional `loss_mask`), `text`, or `messages`; `id` is the key (default:
the row's line number, as `corecap run` keys it), sent as the request's `request_id`: a server
with `--store` stores the sample under it. The loss mask is the row's own, else all ones
(a conversation's too: the server answers token ids, not which are the assistant's); with
`max_tokens` > 1, 0 over the prompt and 1 over the response the model wrote, as `corecap run
--max-tokens` stores it.

Shares. Sample i (the i-th row) belongs to trainer rank i % world_size, and within that rank to
DataLoader worker (i // world_size) % num_workers: every sample goes to exactly one worker of
one rank, decided by its index alone. The rank and world size are torch.distributed's when it
is initialized, else the RANK and WORLD_SIZE environment variables (torchrun's), else 0 and 1.

Re-delivery. The server keeps nothing between requests (a client that fails has its request
aborted and its states freed), so asking again is the trainer's: a rank that fails and restarts
makes its dataset with `done`, the keys of the samples it had finished (each item's "key", kept
with its checkpoint), and is asked for exactly the samples of its share not among them, in the
same order. A key set rather than a position: a DataLoader with several workers and batches
does not hand the samples on in share order, so a count of those finished would not say which."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator

import torch
import torch.utils.data

from corecap.client import Client
from corecap.errors import CorecapError
from corecap.training.collate import Sample, pad_collate

_INPUTS = ("input_ids", "text", "messages", "conversations")


def trainer_rank() -> tuple[int, int]:
    """(rank, world size): torch.distributed's when initialized, else RANK/WORLD_SIZE, else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:
        raise CorecapError(f"RANK={os.environ.get('RANK')!r} WORLD_SIZE={os.environ.get('WORLD_SIZE')!r}: "
                           "expected integers") from None


def rows_of(data) -> Iterator[tuple[str, dict]]:
    """(key, row) of each row of a `corecap run --data` path, or of a list of dicts."""
    if isinstance(data, (str, os.PathLike)):
        from corecap.data.rows import open_rows

        with open_rows(os.fspath(data)) as (_, rows):
            for number, _, row in rows:
                if isinstance(row, Exception):
                    raise row
                yield _key(row, number), row
        return
    for number, row in enumerate(data, start=1):
        yield _key(row, number), row


def _key(row, number: int) -> str:
    if not isinstance(row, dict):
        raise CorecapError(f"row {number}: expected an object, got {type(row).__name__}")
    return str(row["id"]) if "id" in row else str(number)


class ServerDataset(torch.utils.data.IterableDataset):
    """The samples of `data` (a path or a list of rows), each captured by the server at `server`
    (a URL or a `Client`) when asked for; this rank's share only, less the keys in `done`."""

    def __init__(self, data, server: str | Client = "http://127.0.0.1:8000", *, max_tokens: int = 1,
                 done: Iterable[str] = (), rank: int | None = None, world_size: int | None = None, **fields):
        """`fields`: more of each request (`temperature`, `seed`, `chat_template_kwargs`, ...)."""
        self.data = os.fspath(data) if isinstance(data, (str, os.PathLike)) else list(data)
        self.client = server if isinstance(server, Client) else Client(server)
        self.max_tokens, self.fields, self.done = max_tokens, fields, frozenset(done)
        self.rank, self.world_size = rank, world_size
        if rank is None or world_size is None:
            found = trainer_rank()
            self.rank = found[0] if rank is None else rank
            self.world_size = found[1] if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise CorecapError(f"rank {self.rank} is outside a world of {self.world_size}")

    collate = staticmethod(pad_collate)  # a DataLoader's collate_fn: samples padded to the batch's longest

    def share(self) -> Iterator[tuple[int, str, dict]]:
        """(index, key, row) of this rank's samples still to do; in a DataLoader worker, its own."""
        info = torch.utils.data.get_worker_info()
        worker, num_workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i, (key, row) in enumerate(rows_of(self.data)):
            if i % self.world_size == self.rank and (i // self.world_size) % num_workers == worker:
                if key not in self.done:
                    yield i, key, row

    def __iter__(self) -> Iterator[Sample]:
        for _, key, row in self.share():
            yield self.item(key, row)

    def item(self, key: str, row: dict) -> Sample:
        """One row's sample, asked of the server."""
        present = [name for name in _INPUTS if name in row]
        if len(present) != 1:
            raise CorecapError(f"row {key!r}: expected exactly one of {', '.join(_INPUTS)}, got {present or 'none'}")
        name = present[0]
        fields = {"request_id": key, **self.fields}  # a server's --store keys the sample as `corecap run` would
        if name in ("messages", "conversations"):
            got = self.client.states(messages=row[name], max_tokens=self.max_tokens, **fields)
        else:
            got = self.client.states(row[name], max_tokens=self.max_tokens, **fields)
        num_tokens = len(got.token_ids)
        mask = torch.ones(num_tokens, dtype=torch.int64)
        if self.max_tokens > 1:
            mask[: got.num_prompt] = 0
        elif "loss_mask" in row:
            mask = torch.tensor(row["loss_mask"], dtype=torch.int64)
        item = Sample({"key": key, "input_ids": got.token_ids, "loss_mask": mask, "hidden_states": got.hidden_states})
        if self.max_tokens > 1:
            item["num_prompt"], item["finish_reason"] = got.num_prompt, got.finish_reason
        return item
