"""--buffer-gb as one bound on the sink's buffers for states (corecap/sink/budget.py,
corecap/sink/buffers.py): the driver admits a sample while the buffers held, its own included,
fit, and gets a buffer back only at its sample's commit; the pool keeps free buffers only within
what the taken ones leave of the bound. No engine: the run-level check, the sink's own high-water
mark against --buffer-gb, is in tests/test_generate.py."""

from __future__ import annotations

import torch

from corecap.sink.budget import Released, StatesBudget
from corecap.sink.buffers import BufferPool, size_class

MIB = 1 << 20
TOKEN_BYTES = 1024


def test_a_buffer_costs_its_size_class_and_a_long_sample_of_given_tokens_that_streams_none():
    budget = StatesBudget(MIB, TOKEN_BYTES, Released())
    for num_tokens in (1, 100, 300, 511):
        cost = budget.cost(num_tokens, final=True)
        assert cost == size_class(num_tokens * TOKEN_BYTES)
        assert num_tokens * TOKEN_BYTES <= cost <= max(4096, 1.25 * num_tokens * TOKEN_BYTES)
    assert budget.cost(600, final=True) == 0  # more than half of the bound: streams to disk (sink/stream.py)
    assert budget.cost(600, final=False) == size_class(600 * TOKEN_BYTES)  # a response never streams


def test_room_comes_back_only_when_the_sink_commits_the_sample():
    released = Released()
    budget = StatesBudget(MIB, TOKEN_BYTES, released)
    quarter = budget.cost(256, final=False)
    assert quarter == MIB // 4
    assert budget.fits(4 * MIB)  # nothing held: one always fits, however large
    for _ in range(4):
        assert budget.fits(quarter)
        budget.reserve(quarter)
    assert budget.held_bytes == MIB and budget.num_held == 4 and budget.most_held == 4
    assert not budget.fits(4096)  # the responses ended or not: held until committed
    released.add(quarter)  # the sink's commit thread, at one sample's commit
    assert budget.num_held == 3 and budget.fits(quarter) and not budget.fits(quarter + 4096)
    budget.reserve(0)  # a streamed sample: no buffer, but held until its commit too
    assert budget.num_held == 4 and budget.fits(quarter)
    assert budget.line(MIB) == ""  # nothing waited
    budget.num_waits += 1
    assert budget.line(MIB).startswith("samples in the sink: at most 4 at once (being written or awaiting their "
                                       "commit), 1.0 MiB of buffers at the most, held to --buffer-gb 0.000976562")
    assert "at once (being written or awaiting their commit), held to --buffer-gb" in budget.line()  # no peak known


def test_the_pool_keeps_lent_and_free_buffers_within_its_limit():
    pool = BufferPool(3 * MIB)
    a, b = (pool.take((MIB // 4,), torch.float32) for _ in range(2))  # 1 MiB each
    pointer = a.data_ptr()
    pool.give(a)
    assert pool.free_bytes == MIB and pool.lent_bytes == MIB
    c = pool.take((MIB // 4 - 16,), torch.float32)  # the same size class: the same memory again
    assert c.data_ptr() == pointer and pool.free_bytes == 0
    pool.give(c)
    d = pool.take((MIB // 2,), torch.float32)  # 2 MiB fresh: the free 1 MiB goes to make room
    assert pool.free_bytes == 0 and pool.lent_bytes == 3 * MIB and pool.peak_bytes == 3 * MIB
    pool.give(b)  # taken 2 + free 1: kept
    assert pool.free_bytes == MIB
    e = pool.take((MIB // 8,), torch.float32)  # 0.5 MiB fresh: 2 + 1 + 0.5 would not fit, the free one goes
    assert pool.free_bytes == 0 and pool.lent_bytes == 2.5 * MIB and pool.peak_bytes == 3 * MIB
    pool.give(d)
    pool.give(e)
    assert pool.lent_bytes == 0 and pool.free_bytes <= 3 * MIB and not pool.lent


def test_free_buffers_go_whichever_classes_were_reused_before():
    """A class emptied by reuse leaves nothing behind for `_let_go` to trip on."""
    pool = BufferPool(2 * MIB)
    small, large = pool.take((MIB // 16,), torch.float32), pool.take((MIB // 4,), torch.float32)
    pool.give(small)
    pool.give(large)  # free: 0.25 MiB and 1 MiB
    again = pool.take((MIB // 4,), torch.float32)  # the 1 MiB class, emptied
    fresh = pool.take((MIB // 4 + 1024,), torch.float32)  # 1.25 MiB: the free 0.25 MiB must go
    assert pool.free_bytes == 0 and pool.total_bytes == 2.25 * MIB
    pool.give(again)
    pool.give(fresh)
    assert pool.total_bytes <= 2 * MIB and not pool.lent
    assert size_class(32 * MIB) == 32 * MIB and size_class(32 * MIB + 1) == 40 * MIB


def test_an_encoded_copy_held_until_its_commit_counts_and_lets_free_buffers_go():
    """The writer gives a buffer back once a copying codec has encoded its sample, and holds the
    copy until the commit (corecap/sink/writer.py): the copy counts against the same bound."""
    pool = BufferPool(2 * MIB)
    a, b = (pool.take((MIB // 4,), torch.float32) for _ in range(2))  # 1 MiB each
    pool.give(a)  # encoded: its buffer goes back, kept free (1 taken + 1 free)
    pool.hold(MIB // 2)  # its copy: the free buffer goes to make room
    assert pool.free_bytes == 0 and pool.held_bytes == MIB // 2 and pool.total_bytes == 1.5 * MIB
    pool.drop(MIB // 2)  # committed
    pool.give(b)
    assert pool.total_bytes == pool.free_bytes == MIB and pool.peak_bytes == 2 * MIB
