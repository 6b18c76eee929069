"""`corecap serve --store DIR`: the server's end of its copy of every delivered sample to a
corecap store (the sink's end, which writes it: corecap/sink/store_copy.py; docs/serve.md, "Keeping
what is delivered"). The store's one-writer lock is taken by `serve` before anything else; here,
before the engine starts, the store is made or checked against this server's model, layers and
dtype, as `corecap run` checks the store it resumes; then, while serving, what the sink reports
of its commits goes to /metrics and the log.

A sample's key is the client's own name for it, where the request gives one (vLLM's
`request_id` on /v1/*; SpecForge's `{store_id}/{sample_id}/g{gen}`, the prefix of its objects),
else the server's own name for the request, `corecap-NNNNNNNNNNNN` (the answer's `id` ends with
it, and so does its file's name), numbered on past the largest such key the store holds, so that
a server started again on the same store never reuses one."""

from __future__ import annotations

import re

from corecap import __version__
from corecap.model import model_identity
from corecap.sink.messages import Kept
from corecap.store import FORMAT_VERSION, LAYER_MEANING, Store, StoreMeta
from corecap.store.store import lmdb_errors

_SERVER_KEY = re.compile(rb"corecap-(\d{12})")  # the server's names for requests (engine_loop.py)


def open_store(plan, log) -> int:
    """Make the store at --store, or check that it holds this model's layers and dtype (before any
    weight loads); the number of the last request name it holds (0: none)."""
    from corecap._vllm import Engine, vllm_version

    path, run = plan.cfg.store, plan.cfg.run
    identity = model_identity(plan.model_dir, run.engine.load_format)
    meta = StoreMeta(
        format_version=FORMAT_VERSION, model=identity, layers=plan.layers, layer_meaning=LAYER_MEANING,
        dtype=Engine.dtype_of(plan.vllm_config), hidden_size=identity.hidden_size, corecap_version=__version__,
        vllm_version=vllm_version(), codec=run.codec,
    )
    Store.create_or_open(path, meta).close()
    with Store.open(path) as store:
        num_samples, last = len(store), last_number(store)
    log(f"--store {path}: {num_samples} samples there already; each sample delivered is committed there too, "
        f"after its answer (codec {store.meta.codec})")
    return last


def last_number(store: Store) -> int:
    """The largest N of the keys `corecap-NNNNNNNNNNNN` in the store (0: none)."""
    last = 0
    with lmdb_errors(store.path, "the headers database"), store.env.begin() as txn:
        cursor = txn.cursor(db=store.headers_db)
        if cursor.set_range(b"corecap-"):
            for key in cursor.iternext(keys=True, values=False):
                if not key.startswith(b"corecap-"):
                    break
                found = _SERVER_KEY.fullmatch(key)
                if found:
                    last = max(last, int(found.group(1)))
    return last


class StoreReport:
    """What the sink says of its copy, to /metrics (each report) and the log (once each: a key
    stored earlier with another input, the copy's end on a failed write, and at the end its count)."""

    def __init__(self, path: str, metrics, log):
        self.path, self.metrics, self.log = path, metrics, log
        self.last = Kept(num_committed=0, num_tokens=0, nbytes=0)
        metrics.kept = self.last

    def update(self, kept: Kept | None) -> None:
        if kept is None or kept is self.last:
            return
        if kept.first_other and not self.last.first_other:
            self.log(f"--store {self.path}: key {kept.first_other!r} was stored already with another input: the "
                     "request was answered, its states not stored (each key is stored once; more in /metrics, "
                     "corecap_store_skipped_total)")
        if kept.failure and not self.last.failure:
            self.log(f"--store {self.path}: no more samples are stored ({self._why(kept)}); serving goes on, "
                     f"{kept.num_committed} samples committed there")
        self.last = self.metrics.kept = kept

    def line(self) -> str:
        """Said when the server stops."""
        kept = self.last
        skipped = kept.num_same + kept.num_other
        return (f"--store {self.path}: {kept.num_committed} samples committed ({kept.num_tokens} tokens, "
                f"{kept.nbytes / 2**20:,.1f} MiB)" + (f"; {skipped} not stored again, their keys stored already"
                                                      if skipped else "")
                + (f"; stopped storing: {self._why(kept)}" if kept.failure else ""))

    def _why(self, kept: Kept) -> str:
        return kept.failure.removeprefix(f"{self.path}: ")  # the writer's error names the store too
