"""corecap/shm.py: a SIGKILLed run's shared memory is recorded and removed by the next run, and
nothing else is touched. The runs here are small Python processes mapping files in a temporary
directory (standing in for /dev/shm); tests/test_faults.py checks the same with real runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from corecap.transport import shm

# A stand-in for a run: maps two files, starts a "worker" that maps a third, says ready, then `finish`.
RUN = r"""
import mmap, os, subprocess, sys, time
from corecap.transport import shm

def mapped_file(path, fill):
    with open(path, "wb") as f:
        f.write(fill * 4096)
    fd = os.open(path, os.O_RDWR)
    return mmap.mmap(fd, 4096)

directory = sys.argv[1]
record = shm.ShmRecord(directory, interval=0.02)
record.watch()
own = mapped_file(os.path.join(directory, "psm_driver"), b"x")
# as glibc makes a named semaphore: a temporary file, mapped, linked under its name, unlinked
semaphore = mapped_file(os.path.join(directory, "sem.XXXXXX"), b"s")
os.link(os.path.join(directory, "sem.XXXXXX"), os.path.join(directory, "sem.mp-lock"))
os.unlink(os.path.join(directory, "sem.XXXXXX"))
child = subprocess.Popen([sys.executable, "-c", WORKER, os.path.join(directory, "psm_worker")], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
"""  # noqa: E501 (the stand-in run's script above: a line of the literal)
WORKER = (
    "import mmap, os, sys, time; f = open(sys.argv[1], 'wb'); f.write(b'y' * 4096); f.close(); "
    "m = mmap.mmap(os.open(sys.argv[1], os.O_RDWR), 4096); print('ready', flush=True); time.sleep(600)"
)
LEFT = {"psm_driver", "psm_worker", "sem.mp-lock"}  # what a SIGKILLed stand-in leaves


def _start_run(directory: str, finish: str) -> subprocess.Popen:
    script = f"WORKER = {WORKER!r}\n" + RUN + finish
    return subprocess.Popen([sys.executable, "-c", script, directory], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def _records(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith(shm.PREFIX))


def _killed_run(directory) -> None:
    """A run whose watcher recorded its driver's and its worker's files, SIGKILLed with its group."""
    run = _start_run(str(directory), "print('ready', flush=True)\ntime.sleep(600)\n")
    try:
        assert run.stdout.readline().strip() == "ready"

        def recorded() -> bool:
            names = _records(directory)
            return bool(names) and LEFT <= set(_read_record(directory / names[0]))

        _wait_for(recorded, f"the watcher to record {sorted(LEFT)}")
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()


def _read_record(path) -> dict:
    try:
        with open(path) as f:
            return json.load(f)["files"]
    except (OSError, ValueError):
        return {}


def test_a_killed_runs_files_are_removed_by_the_next_run_and_nothing_else(tmp_path):
    (tmp_path / "psm_someone_else").write_bytes(b"z" * 10)
    _killed_run(tmp_path)
    assert LEFT <= set(os.listdir(tmp_path)), "SIGKILL leaves them: nothing to test otherwise"
    removed = shm.remove_left_behind(str(tmp_path))
    assert removed.num_files == 3 and removed.num_bytes == 3 * 4096
    assert "removed 3 shared-memory files" in removed.line() and "a killed run" in removed.line()
    assert sorted(os.listdir(tmp_path)) == ["psm_someone_else"]  # the record went too


def test_a_recorded_name_that_now_names_another_file_is_left_alone(tmp_path):
    _killed_run(tmp_path)
    # another program's file under the same name. Made before the old one goes, so it cannot get
    # the old inode's number: unlink-then-create let tmpfs hand the freed number straight back
    # (seen on CI), and a file by that name with the recorded inode is, to corecap, the same file
    (tmp_path / "new").write_bytes(b"new")
    os.replace(tmp_path / "new", tmp_path / "psm_worker")
    removed = shm.remove_left_behind(str(tmp_path))
    assert removed.num_files == len(LEFT) - 1
    assert (tmp_path / "psm_worker").read_bytes() == b"new"


def test_a_live_runs_record_and_other_namespaces_records_are_left_alone(tmp_path):
    (tmp_path / "psm_live").write_bytes(b"a")
    record = shm.ShmRecord(str(tmp_path))
    record.files = {"psm_live": os.stat(tmp_path / "psm_live").st_ino}
    record._write()  # this process is alive: its record stands
    (tmp_path / "psm_elsewhere").write_bytes(b"b")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    other = tmp_path / f"{shm.PREFIX}1-{int(dead.stdout)}-1{shm.SUFFIX}"  # pid namespace 1 is not ours
    other.write_text('{"pid": 1, "files": {"psm_elsewhere": %d}}' % os.stat(tmp_path / "psm_elsewhere").st_ino)
    assert shm.remove_left_behind(str(tmp_path)).num_files == 0
    assert {"psm_live", "psm_elsewhere", other.name, os.path.basename(record.path)} <= set(os.listdir(tmp_path))
    record.close()  # its file is still there: the record stays for the next run
    assert os.path.exists(record.path)
    os.unlink(tmp_path / "psm_live")
    record.close()
    assert not os.path.exists(record.path)


def test_a_run_that_ends_normally_leaves_no_record(tmp_path):
    finish = ("print('ready', flush=True)\nchild.kill(); child.wait(); own.close(); semaphore.close()\n"
              "for n in ('psm_driver', 'psm_worker', 'sem.mp-lock'): os.unlink(os.path.join(directory, n))\n"
              "record.close()\n")
    run = _start_run(str(tmp_path), finish)
    assert run.stdout.readline().strip() == "ready"
    assert run.wait(60) == 0
    assert os.listdir(tmp_path) == []


def test_damaged_and_half_written_records_of_dead_runs_go(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    namespace = shm._pid_namespace()
    stem = f"{shm.PREFIX}{namespace}-{int(dead.stdout)}-1"
    (tmp_path / f"{stem}{shm.SUFFIX}.tmp").write_text('{"pid": ')
    (tmp_path / f"{stem}{shm.SUFFIX}").write_text('{"pid": 1, "files": {"../escape": 1, "psm_x": "not an inode"}}')
    assert shm.remove_left_behind(str(tmp_path)).num_files == 0
    assert os.listdir(tmp_path) == []
