"""Each sample straight to a file that a trainer reads while it trains, instead of the store:
the sink of `corecap serve` (corecap/serve/).

The file is speculators' online layout, which hs_connectors' `FileTransfer` and `FP8Transfer`
load: `hidden_states` [T, L, H] (the aux layers ascending, then the last decoder layer's output
before the final norm, which speculators applies itself) and `token_ids` [T] int64; with fp8,
float8_e4m3fn codes and `hidden_states_scales` [T, 1, 1], one scale per token, as
hs_connectors' fp8 connector writes them (corecap/export/fp8_per_token.py).

The lock protocol is the readers' own: `PATH.lock` exists and is flock-ed while PATH is written;
a reader that finds it waits for the lock, removes it, then loads PATH. PATH is written under a
temporary name and renamed, so that no reader ever sees half a file, even one that ignores the
lock or a server killed mid-write.

Files are written on threads of their own (`Deliveries`): writing a sample's file (a copy into
the file's layer order, then the file) takes long next to reassembling chunks, and a sink that
wrote each file before reading the next chunk held the workers' rings full and the engine
waiting."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from corecap.export.fp8_per_token import SCALES_KEY, quantize_per_token
from corecap.sink.mooncake import MooncakeOptions, MooncakeWriter, SpecCapture, StoreFull

PARTIAL = ".partial"  # a file being written; never a name the server hands out
SUFFIX = ".safetensors"


@dataclass(frozen=True)
class DeliverSpec:
    """Where and how the sink writes each sample: `directory`/KEY.safetensors, the stored layers at
    `positions` (in the file's order), fp8 or the stored dtype; or into a Mooncake store."""

    directory: str
    positions: tuple[int, ...]
    fp8: bool = False
    mooncake: MooncakeOptions | None = None
    # SpecForge's layout: the stored positions of its aux layers and of the post-norm state N (None:
    # N is not captured, and /generate refuses spec_capture)
    spec_positions: tuple[tuple[int, ...], int] | None = None


class Deliverer:
    """The sink's end of `corecap serve`: each sample to a file, or to the Mooncake store (whose
    client this keeps for as long as the server runs: its objects live in its segment)."""

    def __init__(self, spec: DeliverSpec):
        self.spec = spec
        self.mooncake = MooncakeWriter(spec.mooncake) if spec.mooncake is not None else None

    def deliver(self, name: str, token_ids: np.ndarray, states: torch.Tensor,
                spec_capture: SpecCapture | None = None, lossless: bool = False) -> tuple[int, str, bool]:
        """One sample (`states`: the stored layers [L_stored, T, H]) in speculators' layout, or
        SpecForge's where `spec_capture` says so, or to a file in the stored dtype with `lossless`
        (whatever the backend: the server copies it to NIXL's memory); (bytes written, "", False)
        or, for a write that fails (a full disk, a full store), (0, why, whether it was the Mooncake
        store without room for now): it fails that request, not the sink."""
        try:
            if lossless:
                lossless_spec = dataclasses.replace(self.spec, fp8=False)
                return write_sample(lossless_spec, name + SUFFIX, token_ids, states), "", False
            if spec_capture is not None:
                aux, target = self.spec.spec_positions
                features = {}
                if spec_capture.aux is not None:  # the aux layers side by side: [1, T, A*H]
                    features[spec_capture.aux] = torch.cat([states[p] for p in aux], dim=-1).unsqueeze(0)
                if spec_capture.target is not None:
                    features[spec_capture.target] = states[target].unsqueeze(0)
                return self.mooncake.put_tensors(spec_capture, features), "", False
            if self.mooncake is not None:
                states = torch.stack([states[p] for p in self.spec.positions], 1)
                return self.mooncake.put(name, token_ids, states), "", False
            return write_sample(self.spec, name + SUFFIX, token_ids, states), "", False
        except StoreFull as e:
            return 0, str(e), True
        except OSError as e:
            where = "the Mooncake store" if self.mooncake is not None else os.path.join(self.spec.directory, name)
            return 0, f"{where}: {e.strerror or e}", False

    def discard(self, keys: list[str]) -> tuple[int, str, bool]:
        """Remove what was written under `keys` (Mooncake objects) for a client that went away."""
        if self.mooncake is not None:
            self.mooncake.discard(keys)
        return 0, "", False


class Deliveries:
    """The writes in flight, each on a thread of the pool: `submit` one with what to do once it is
    written, and `finished()`, called on the sink's own thread, runs those for the writes done since
    (so the driver hears of each there, in the sink's thread, as before). A write that raised
    anything but the OSError `Deliverer.deliver` reports is raised again there.

    Each write done also makes `fileno()` readable (a byte down a pipe), so the sink's poller,
    which watches it beside its sockets, wakes for it at once rather than at its next timeout."""

    def __init__(self, num_threads: int):
        self.pool = ThreadPoolExecutor(num_threads, thread_name_prefix="corecap-deliver")
        self.done: queue.SimpleQueue = queue.SimpleQueue()
        self.num_running = 0
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def fileno(self) -> int:
        """Readable once a write is done and until `finished()` has run."""
        return self.wake_r

    def submit(self, write: Callable[[], tuple[int, str, bool]], then: Callable[[int, str, bool], None]) -> None:
        def run() -> None:
            try:
                self.done.put((then, write(), None))
            except BaseException as e:
                self.done.put((then, None, e))
            try:  # after the put: the sink, woken, finds it
                os.write(self.wake_w, b"\0")
            except BlockingIOError:  # a full pipe is readable already
                pass

        self.num_running += 1
        self.pool.submit(run)

    def finished(self) -> None:
        # The pipe first, then the queue: a write done in between leaves its byte, and the next
        # poll wakes for it, never an outcome queued with no byte to wake the sink.
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        while True:
            try:
                then, outcome, error = self.done.get_nowait()
            except queue.Empty:
                return
            self.num_running -= 1
            if error is not None:
                raise error
            then(*outcome)

    def close(self) -> None:
        """Wait for the writes in flight (none is left half-written), then report them."""
        self.pool.shutdown(wait=True)
        try:
            self.finished()
        finally:
            os.close(self.wake_r)
            os.close(self.wake_w)


def write_sample(spec: DeliverSpec, name: str, token_ids: np.ndarray, states: torch.Tensor) -> int:
    """Write one sample's file (`states`: the stored layers [L_stored, T, H]); its size in bytes."""
    from safetensors.torch import save_file

    path = os.path.join(spec.directory, name)
    ids = torch.from_numpy(np.asarray(token_ids, np.int64))
    fd = os.open(path + ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if spec.fp8:
            codes, scales = quantize_per_token(states, spec.positions)
            tensors = {"hidden_states": codes, SCALES_KEY: scales, "token_ids": ids}
        else:
            tensors = {"hidden_states": torch.stack([states[p] for p in spec.positions], dim=1), "token_ids": ids}
        save_file(tensors, path + PARTIAL)
        os.replace(path + PARTIAL, path)
        return os.path.getsize(path)
    finally:
        os.close(fd)  # the flock goes with it: a waiting reader goes on
