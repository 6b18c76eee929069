"""The samples a run still has to capture, as its validation pass made them (read, tokenized,
masked), kept in an unnamed temporary file until the step loop takes them: the input is read
and tokenized once per run, and memory stays flat whatever the file's size (the samples wait on
disk, a few bytes a token, not in RAM).

The file has no name (TMPDIR's O_TMPFILE): nothing is left behind, even by a run killed with
SIGKILL. It holds this process's own records only, written and read by it: pickle is safe here."""

from __future__ import annotations

import pickle
import tempfile
from collections.abc import Iterator


class TodoSamples:
    """Samples added in order by the validation pass, then read back once, in the same order."""

    def __init__(self):
        self.file = tempfile.TemporaryFile(prefix="corecap-samples-")
        self.num_samples = 0

    def add(self, sample) -> None:
        pickle.dump(sample, self.file, protocol=pickle.HIGHEST_PROTOCOL)
        self.num_samples += 1

    def __iter__(self) -> Iterator:
        self.file.flush()
        self.file.seek(0)
        for _ in range(self.num_samples):
            yield pickle.load(self.file)

    def close(self) -> None:
        self.file.close()
