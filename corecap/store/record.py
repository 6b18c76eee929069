"""A sample encoded for the store, ready to commit (corecap/store/format.py's `encode_sample`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Record:
    """One sample ready to commit: its header and its encoded states as buffers whose
    concatenation is the payload (the codec's parts: writing them one after another saves joining
    them, a copy of the whole payload that was a sizeable share of a bf16 encode; measured:
    `python -m tools.bench.sink --only parts`, docs/benchmarks.md, "Capture")."""

    key: str
    header: bytes
    parts: tuple  # buffers
    num_prefix: int = 0  # the header's: a record that refers to others commits after them
    spilled: object = None  # spill.Spilled: the payload is that file (a long sample's), `parts` empty

    @property
    def payload(self):
        """The parts joined (one part: itself)."""
        return self.parts[0] if len(self.parts) == 1 else b"".join(self.parts)

    @property
    def nbytes(self) -> int:
        stored = self.spilled.nbytes if self.spilled is not None else sum(memoryview(p).nbytes for p in self.parts)
        return len(self.header) + stored
