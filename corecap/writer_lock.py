"""A store's writer lock: STORE/writer.lock, an flock(2) held by the one process that writes it.

`corecap run` holds it for the whole run (`held`), from before it reads the data or imports vLLM,
so that a second run on the same store is refused in its first second, naming the first run's
pid and command line, which the lock file holds while it is locked. The sink process that
writes the states is a child of the run: it is told that its parent holds the lock
(`trust_parent`) and checks that the lock file names its parent instead of locking it again.
A store directory that `held` made for the lock is removed again when the run stored nothing.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shlex
import stat
import sys
import contextlib
from contextlib import contextmanager

from corecap.errors import CorecapError

LOCK_FILE = "writer.lock"
_MAX_HOLDER_BYTES = 4096  # the holder's pid and command line; a lock file may hold anything
_PARENT = -1
# realpath → the lock's fd this process holds for a whole run (`held`), or _PARENT: its parent does
_held: dict[str, int] = {}


def take(directory: str) -> int:
    """Lock the store at `directory` for writing; returns the fd that holds it (close it to release).
    Where this process (or, for the sink, its parent) already holds it for the run, returns a new fd
    on the same lock, whose close releases nothing."""
    path = os.path.join(directory, LOCK_FILE)
    held = _held.get(os.path.realpath(directory))
    if held is not None and held != _PARENT:
        return os.dup(held)
    for _ in range(3):  # a run that stored nothing removes its lock file: lock the one in place
        fd = _open(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            pid, command = _holder(fd)
            if held == _PARENT and e.errno in (errno.EWOULDBLOCK, errno.EACCES) and pid == str(os.getppid()):
                return fd  # the run that started this process holds it
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                running = f": {command}" if command else ""
                raise CorecapError(f"{directory}: another process (pid {pid}) is writing this store{running}") from None
            raise CorecapError(f"{path}: cannot lock ({e.strerror})") from None
        if _same_file(fd, path):
            break
        os.close(fd)
    else:
        raise CorecapError(f"{path}: the writer lock keeps being replaced; is another run starting on this store?")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n{_command_line()}\n".encode(errors="replace"), 0)
    return fd


def check_unlocked(directory: str) -> None:
    """Raise if another process is writing the store at `directory` (checked before a run)."""
    if os.path.exists(os.path.join(directory, LOCK_FILE)):
        os.close(take(directory))


def holds(directory: str) -> bool:
    """Whether this process holds the lock of the store at `directory` for a whole run."""
    return _held.get(os.path.realpath(directory), _PARENT) != _PARENT


def trust_parent(directory: str) -> None:
    """In a child of the run that holds the lock (the sink): take it as held."""
    _held.setdefault(os.path.realpath(directory), _PARENT)


@contextmanager
def held(directory: str):
    """Hold the lock of the store at `directory` for a whole run, making the directory if it is
    not there; re-entrant. A directory made here is removed at the end if the run stored nothing
    in it (no data.mdb): a refused or failed run leaves nothing behind."""
    directory = os.fspath(directory)
    real = os.path.realpath(directory)
    if real in _held:
        yield
        return
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise CorecapError(f"{directory}: not a corecap store (it is a file, expected a directory)")
    made = not os.path.exists(directory)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise CorecapError(f"--store {directory}: cannot make the store's directory ({e.strerror})") from None
    try:
        fd = take(directory)
    except BaseException:
        if made:
            _remove_empty(directory)
        raise
    _held[real] = fd
    try:
        yield
    finally:
        del _held[real]
        if not os.path.exists(os.path.join(directory, "data.mdb")):
            with contextlib.suppress(OSError):  # removed while still locked: the next run makes its own
                os.unlink(os.path.join(directory, LOCK_FILE))
        os.close(fd)
        if made:
            _remove_empty(directory)


def _open(path: str) -> int:
    try:  # O_NOFOLLOW: the lock file is truncated and written; never through a link
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise CorecapError(f"{path}: cannot open the writer lock ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorecapError(f"{path}: not a regular file, expected the writer lock")
    return fd


def _holder(fd: int) -> tuple[str, str]:
    """The pid ("unknown" if the file does not name one) and command line the lock file names."""
    text = os.pread(fd, _MAX_HOLDER_BYTES, 0).decode(errors="replace")
    pid, _, rest = text.partition("\n")
    pid = pid.strip()
    command = rest.strip().splitlines()[0] if rest.strip() else ""
    if not (pid.isascii() and pid.isdigit()):
        return "unknown", ""
    return pid, command if command.isprintable() else ""


def _command_line() -> str:
    """As the user typed it: `corecap run ...`, or `python3 -m corecap run ...`."""
    program = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    argv = sys.orig_argv if program in ("", "__main__.py", "-c") else [program, *sys.argv[1:]]
    return shlex.join(argv)[: _MAX_HOLDER_BYTES // 2].replace("\n", " ")


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _remove_empty(directory: str) -> None:
    with contextlib.suppress(OSError):  # something else was put there: leave it
        os.rmdir(directory)


