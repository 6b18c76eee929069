"""Kill anywhere: SIGKILL a real `corecap run` at random moments, rerun it each time, and check
that the store ends up exactly as an uninterrupted run makes it.

    python tests/support/kill_loop.py                          # 20 kills, the tiny demo-size Llama, CPU
    python tests/support/kill_loop.py --kills 40 --seed 7 --out kill_loop.json --enforce-eager

It builds a tiny Llama (corecap.demo.build_tiny_llama, float32) and a random dataset in --work,
makes an uninterrupted reference store (timing it: the load until the first commit, then the
capture until the last), then runs the same command against a second store again and again,
each time killing its whole process group (driver, sink, workers) with SIGKILL at a seeded
random moment in one of three phases, cycled so each gets its share:
  load    uniform over the reference's time to its first commit (startup, model load, warm-up);
  step    a uniform delay after this run's first new commit: mid-capture, usually mid-step;
  commit  as `step`, then at the next write to the store's files (a states-*.bin file or
          data.mdb): while a batch of states is written, or during an LMDB commit.
Capture-phase delays are drawn from [0, 2 * capture / number of capture kills], so that the
kills walk through the whole dataset instead of finishing it in the first few; a run that still
completes the store before its kill ends a round (compared with the reference, then the store
starts afresh), and the loop goes on until the wanted number of runs were really killed. After
every kill the store must open and pass `corecap verify` (no partial sample), and no process of
the run may survive. A final run completes the store, which is then compared with the reference:
the same keys, input ids, headers and metadata exactly; hidden states bit-identical where the
engine is batch-invariant, otherwise within 1e-6 relative (L2 per sample and layer); the
measured difference is printed.

tests/test_faults.py runs the same loop with a few kills (CORECAP_KILL_LOOPS); this script is
the full run. Each run gets its own session, its own short TMPDIR in /tmp (mode 1777, like
/tmp, so IPC files that land directly in it are visible) and, here, its own VLLM_CACHE_ROOT
under --work: a kill in the middle of torch.compile then hits this cache, not the user's. A
SIGKILLed run leaves the shared memory it mapped in /dev/shm (vLLM's message queues, ~400 MB per
run on the tiny model); the next run must remove it (corecap/transport/shm.py): every run that gets under
way (commits something, or exits by itself) fails the loop if a file an earlier run left is
still there after it. What is left at the end is removed by the harness.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace

import lmdb
import numpy as np
import psutil
import torch

from corecap.errors import CorecapError
from corecap.store import Store
from corecap.store.verify import verify_store

PHASES = ("load", "step", "commit")
TOLERANCE = 1e-6  # relative L2 per sample and layer: float32's band after reordered reductions
# The header fields that follow the states' bytes: `checksum` is theirs, and `header_crc` covers
# it with every other field, each of which is compared itself. States within TOLERANCE but not
# bit-identical (an engine that is not batch-invariant: 27 of 200 samples on the AMX CPU's four
# cores, 2026-12-06) differ in both, and are the states comparison's to judge.
STATES_CHECKSUMS = ("checksum", "header_crc")
_POLL = 0.05
# A run records its shared memory within tens of milliseconds of its creation (corecap/transport/shm.py);
# what a kill catches younger than this is not expected to be recorded, and this harness removes it.
RECORD_WINDOW = 0.25


@dataclass(frozen=True)
class RunCommand:
    """How to start one `corecap run`: the command line, its store, and where its files go."""

    argv: tuple[str, ...]
    store: str
    workdir: str
    env: dict = field(default_factory=dict)

    @property
    def corecap_args(self) -> tuple[str, ...]:
        """The command line after `PYTHON -m corecap.cli` (`run` and its options), for a script
        that starts the CLI itself (`paused_run`); refuses a command line of another shape."""
        if tuple(self.argv[1:3]) != ("-m", "corecap.cli"):
            raise ValueError(f"not a `PYTHON -m corecap.cli ...` command line: {' '.join(self.argv[:4])}")
        return tuple(self.argv[3:])


class Run:
    """One started `corecap run` in its own session (process group), with its own TMPDIR and log files."""

    started: list["Run"] = []  # every run of this process, ended at exit (own sessions outlive us)
    left_behind: set[str] = set()  # /dev/shm files that ended runs left, for a later run to remove
    unrecorded: set[str] = set()  # files made too shortly before a kill to be recorded: ours to remove

    def __init__(self, cmd: RunCommand, name: str):
        self.cmd, self.name = cmd, name
        # Short, in /tmp: corecap puts its IPC directories in TMPDIR only where socket paths fit
        # (corecap/transport/wire.py private_ipc_dir), else in /tmp, out of sight of the checks on this one.
        self.tmpdir = tempfile.mkdtemp(prefix="cc-run-", dir="/tmp")
        os.chmod(self.tmpdir, 0o1777)  # shared like /tmp: anything the run leaves directly here is exposed
        self.stdout_path = os.path.join(cmd.workdir, f"{name}.stdout")
        self.stderr_path = os.path.join(cmd.workdir, f"{name}.stderr")
        env = {**os.environ, **cmd.env, "TMPDIR": self.tmpdir}
        # files, not pipes: a pipe nobody reads fills up and stalls the run
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                cmd.argv, cwd=cmd.workdir, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.start = time.monotonic()
        self.pgid = self.proc.pid
        self.shm: set[str] = set()  # /dev/shm files its processes mapped (seen by `watch`)
        self.shm_before = set(os.listdir("/dev/shm"))
        self.killed_at: float | None = None  # time.time() of the SIGKILL
        self.shm_seen: dict[str, float] = {}  # /dev/shm path → time.time() `watch` first saw it
        Run.started.append(self)

    def watch(self) -> None:
        """Note the shared memory the run's processes map (a SIGKILL leaves it behind), and when
        each name in /dev/shm was first seen."""
        now = time.time()
        for name in os.listdir("/dev/shm"):
            self.shm_seen.setdefault(os.path.join("/dev/shm", name), now)
        for p in self.processes():
            try:
                with open(f"/proc/{p.pid}/maps") as f:
                    for line in f:
                        if "/dev/shm/" in line:
                            self.shm.add(line.split(None, 5)[-1].strip().removesuffix(" (deleted)"))
            except OSError:
                continue

    def leaked_shm(self) -> list[tuple[str, int]]:
        """(path, bytes) of shared memory it left: files it mapped, or that appeared in /dev/shm
        while it ran, which no process maps any more (call after it ended; when other programs
        use /dev/shm at the same time, what they leak meanwhile is counted too)."""
        appeared = {os.path.join("/dev/shm", n) for n in set(os.listdir("/dev/shm")) - self.shm_before}
        out = []
        for path in sorted(self.shm | appeared):
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                continue
            if not _mapped_by_anyone(path):
                out.append((path, size))
        return out

    def remove_leaked_shm(self) -> None:
        """vLLM's ring buffers are hundreds of MB of RAM each: repeated kills would use it all up."""
        for path, _ in self.leaked_shm():
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def running(self) -> bool:
        return self.proc.poll() is None

    def signal_group(self, sig: int = signal.SIGKILL) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None if it is still running after `timeout` seconds."""
        try:
            return self.proc.wait(timeout=max(timeout, 0))
        except subprocess.TimeoutExpired:
            return None

    def processes(self) -> list[psutil.Process]:
        """The driver and every descendant still alive."""
        try:
            main = psutil.Process(self.proc.pid)
            return [main] + main.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def group_processes(self) -> list[psutil.Process]:
        """Live (non-zombie) processes in the run's process group."""
        out = []
        for p in psutil.process_iter(["status"]):
            try:
                if os.getpgid(p.pid) == self.pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (ProcessLookupError, psutil.Error):
                continue
        return out

    def wait_group_gone(self, timeout: float) -> list[str]:
        """Wait for every process of the group to end; describe those that do not."""
        deadline = time.monotonic() + timeout
        while True:
            left = self.group_processes()
            if not left or time.monotonic() > deadline:
                return [_describe(p) for p in left]
            time.sleep(_POLL)

    def stdout(self) -> str:
        with open(self.stdout_path, errors="replace") as f:
            return f.read()

    def stderr(self) -> str:
        with open(self.stderr_path, errors="replace") as f:
            return f.read()

    def last_stderr_line(self) -> str:
        lines = [line for line in self.stderr().splitlines() if line.strip()]
        return lines[-1] if lines else ""


def _mapped_by_anyone(path: str) -> bool:
    for maps in os.scandir("/proc"):
        if maps.name.isdigit():
            try:
                with open(f"/proc/{maps.name}/maps") as f:
                    if any(line.rstrip("\n").removesuffix(" (deleted)").endswith(" " + path) for line in f):
                        return True
            except OSError:
                continue
    return False


@atexit.register
def _kill_started_runs() -> None:
    for run in Run.started:
        if run.running():
            run.signal_group(signal.SIGKILL)
            run.wait(30)
            run.wait_group_gone(10)
        run.remove_leaked_shm()
        shutil.rmtree(run.tmpdir, ignore_errors=True)
    for path in Run.left_behind | Run.unrecorded:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline())[:120] or p.name()}"
    except psutil.Error:
        return f"pid {p.pid}"


_PAUSED_RUN = """
import dataclasses, sys
from corecap import cli
from corecap.config import TestHooks

capture = cli.capture


def paused(cfg, log, **kwargs):
    return capture(dataclasses.replace(cfg, test_hooks=TestHooks(int(sys.argv[1]), sys.argv[2])), log, **kwargs)


if __name__ == "__main__":  # vLLM's workers start by spawn, and import this module
    cli.capture = paused
    cli.main(sys.argv[3:], prog_name="corecap")
"""


def paused_run(cmd: RunCommand, pause_at_step: int, pause_file: str) -> RunCommand:
    """`cmd` (a `corecap run`) with its workers pausing at step `pause_at_step` and touching
    `pause_file` (config.TestHooks, which no user can set): a script in its workdir hands the
    hook to the CLI."""
    script = os.path.join(cmd.workdir, "paused_run.py")
    with open(script, "w") as f:
        f.write(_PAUSED_RUN)
    return replace(cmd, argv=(sys.executable, script, str(pause_at_step), pause_file, *cmd.corecap_args))


@contextlib.contextmanager
def paused_until(cmd: RunCommand, name: str, pause_at_step: int, ready, waiting_for: str, timeout: float):
    """Start `cmd` (a `corecap run`) with its workers waiting at step `pause_at_step`
    (`paused_run`) and yield the Run once they wait there and `ready()` holds (`waiting_for`
    says what it waits for, in the error of a run that never gets there); on leaving,
    SIGKILL its whole group and remove the shared memory it left. A kill mid-run however fast
    the machine: polled for commits alone, a run can finish before the kill lands. `timeout`:
    seconds before a run that never gets there fails (liveness, not a benchmark)."""
    pause_file = os.path.join(cmd.workdir, f"{name}.paused")
    run = Run(paused_run(cmd, pause_at_step, pause_file), name)
    try:
        deadline = time.monotonic() + timeout
        while not (os.path.exists(pause_file) and ready()):
            if not run.running():
                raise RuntimeError(f"{name}: the run exited (rc {run.proc.returncode}) before its kill: "
                                   f"{run.stderr()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: no pause at step {pause_at_step} with {waiting_for} in {timeout:.0f} s")
            run.watch()
            time.sleep(_POLL)
        yield run
    finally:
        run.signal_group(signal.SIGKILL)
        run.wait(60)
        run.remove_leaked_shm()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(pause_file)


def kill_at_pause(cmd: RunCommand, name: str, pause_at_step: int, committed: int, timeout: float) -> int:
    """`paused_until` the store holds `committed` samples, then the kill. Returns the samples
    committed at the kill."""
    with paused_until(cmd, name, pause_at_step, lambda: num_committed(cmd.store) >= committed,
                      f"{committed} samples committed", timeout):
        pass
    return num_committed(cmd.store)


def num_committed(store: str) -> int:
    """Samples committed to `store` so far (0 while it does not exist or is being created)."""
    try:
        with Store.open(store) as s:
            return len(s)
    except (CorecapError, lmdb.Error):
        return 0


def _data_file_state(store: str):
    """(name, mtime, size) of the store's data files: a change means a write is under way."""
    try:
        names = sorted(n for n in os.listdir(store) if n == "data.mdb" or n.startswith("states-"))
    except FileNotFoundError:
        return None
    state = []
    for name in names:
        try:
            st = os.stat(os.path.join(store, name))
        except FileNotFoundError:
            continue
        state.append((name, st.st_mtime_ns, st.st_size))
    return tuple(state) or None


@dataclass
class Timing:
    load: float  # start → first commit
    capture: float  # first commit → last commit
    total: float  # start → exit


@dataclass(kw_only=True)
class Outcome:
    name: str
    phase: str | None  # None: a run left to finish
    killed: bool  # False: it exited before the kill came
    at: float  # seconds after start when it was killed, or when it exited
    returncode: int
    committed_before: int
    committed_after: int
    verify_problems: int  # samples `corecap verify` finds wrong after this run
    leftover_processes: list[str]
    stderr_tail: str = ""
    store_error: str = ""  # the store could not be opened at all (e.g. killed while creating it)
    leaked_shm: int = 0  # /dev/shm files it left (for the next run to remove)
    leaked_shm_bytes: int = 0
    # files earlier runs left, still there after this one got under way
    stale_shm: list[str] = field(default_factory=list)
    unrecorded_shm: int = 0  # of leaked_shm, made within RECORD_WINDOW before the kill: not yet recorded
    landed: str = ""  # where the kill landed: "load" (nothing committed yet) or "capture"

    @property
    def failed(self) -> bool:
        """A run that failed on its own, a store with a bad sample, a process that survived, or
        shared memory of earlier runs left in place."""
        return (
            (not self.killed and self.returncode != 0) or self.verify_problems > 0 or bool(self.leftover_processes)
            or bool(self.stale_shm)
        )

    def line(self) -> str:
        what = (f"killed in {self.phase} at {self.at:5.1f}s" if self.killed
                else f"exited {self.returncode} at {self.at:5.1f}s")
        if (self.killed and self.landed
                and self.landed != {"step": "capture", "commit": "capture"}.get(self.phase, self.phase)):
            what += f" (landed in {self.landed})"
        if self.phase and not self.killed:
            what += f" (before its {self.phase} kill)"
        return (
            f"{self.name}: {what}; committed {self.committed_before} -> {self.committed_after}; "
            f"verify problems {self.verify_problems}; leftover processes {len(self.leftover_processes)}"
            + (f"; left {self.leaked_shm} shm files ({self.leaked_shm_bytes / 2**20:.0f} MiB)"
               if self.leaked_shm else "")
            + (f" ({self.unrecorded_shm} made within {RECORD_WINDOW}s of the kill, too late to be recorded)"
               if self.unrecorded_shm else "")
            + (f"; did not remove what earlier runs left: {self.stale_shm}" if self.stale_shm else "")
            + (f"; store unreadable: {self.store_error}" if self.store_error else "")
        )


def timed_run(cmd: RunCommand, name: str, timeout: float) -> tuple[Outcome, Timing]:
    """Run to the end, timing the first and the last commit (polled)."""
    before = num_committed(cmd.store)
    run = Run(cmd, name)
    first = last = None
    count = before
    while run.running() and run.elapsed() < timeout:
        run.watch()
        n = num_committed(cmd.store)
        if n != count:
            count, last = n, run.elapsed()
            first = first if first is not None else last
        time.sleep(_POLL)
    outcome = _finish(run, None, killed=False, before=before)
    total = outcome.at
    first = first if first is not None else total
    last = last if last is not None else total
    return outcome, Timing(load=first, capture=max(last - first, 0.0), total=total)


def kill_once(cmd: RunCommand, name: str, phase: str, rng: random.Random, timing: Timing, window: float,
              timeout: float) -> Outcome:
    """Start a run and SIGKILL its whole process group at a random moment in `phase`."""
    before = num_committed(cmd.store)
    run = Run(cmd, name)
    if phase == "load":
        _sleep_while_running(run, rng.uniform(0, timing.load))
    else:
        while run.running() and num_committed(cmd.store) == before and run.elapsed() < timeout:
            run.watch()
            time.sleep(_POLL)
        _sleep_while_running(run, rng.uniform(0, window))
        if phase == "commit":
            state = _data_file_state(cmd.store)
            deadline = time.monotonic() + 30
            while run.running() and _data_file_state(cmd.store) == state and time.monotonic() < deadline:
                time.sleep(0.0005)
    at_kill = num_committed(cmd.store) if phase == "load" else None  # a load kill may land late
    killed = run.running()
    if killed:
        run.killed_at = time.time()
        run.signal_group(signal.SIGKILL)
    outcome = _finish(run, phase, killed=killed, before=before)
    if killed:
        outcome.landed = "load" if phase == "load" and at_kill == before else "capture"
    return outcome


def _sleep_while_running(run: Run, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while run.running() and time.monotonic() < deadline:
        run.watch()
        time.sleep(min(_POLL, max(deadline - time.monotonic(), 0)))


def _finish(run: Run, phase: str | None, killed: bool, before: int) -> Outcome:
    at = run.elapsed()
    rc = run.wait(600)
    if rc is None:  # a hang: end it, and say so through the return code
        run.signal_group(signal.SIGKILL)
        rc = run.wait(60)
    leftovers = run.wait_group_gone(30)
    run.signal_group(signal.SIGKILL)  # never leave a process behind for the next run
    problems, store_error = 0, ""
    if os.path.exists(os.path.join(run.cmd.store, "data.mdb")):
        try:
            problems = len(verify_store(run.cmd.store).problems)
        except CorecapError as e:  # not a failure by itself: the next run must cope with it
            store_error = str(e)
    tail = "" if killed or rc == 0 else "\n".join(run.stderr().splitlines()[-20:])
    after = num_committed(run.cmd.store)
    stale = sorted(p for p in Run.left_behind if os.path.exists(p))
    under_way = not killed or after > before  # past the start of `corecap run`, where it removes them
    leaked = run.leaked_shm()
    young = {  # not seen, or first seen, within RECORD_WINDOW before the kill
        path for path, _ in leaked
        if run.killed_at is not None and run.shm_seen.get(path, run.killed_at) > run.killed_at - RECORD_WINDOW
    }
    Run.unrecorded |= young
    Run.left_behind = set(stale) | {path for path, _ in leaked} - young
    return Outcome(name=run.name, phase=phase, killed=killed, at=round(at, 2), returncode=rc, committed_before=before,
                   committed_after=after, verify_problems=problems, leftover_processes=leftovers, stderr_tail=tail,
                   store_error=store_error, leaked_shm=len(leaked), leaked_shm_bytes=sum(size for _, size in leaked),
                   stale_shm=stale if under_way else [], unrecorded_shm=len(young))


@dataclass
class LoopResult:
    outcomes: list[Outcome]
    rounds: list["Comparison"]  # a store the loop completed, compared with the reference, then restarted

    @property
    def num_killed(self) -> int:
        return sum(o.killed for o in self.outcomes)

    @property
    def failed(self) -> bool:
        return any(o.failed for o in self.outcomes) or not all(c.ok for c in self.rounds)


def kill_loop(cmd: RunCommand, num_kills: int, seed: int, timing: Timing, reference: str | None = None,
              timeout: float = 900, log=print) -> LoopResult:
    """Run until `num_kills` runs were SIGKILLed at random moments; phases come in a seeded order.

    A run that finishes before its kill completed the store: it is compared with `reference`,
    then removed, and the next kill starts a new round on an empty store, so that every kill
    lands on a run with work left. Stops at the first run that fails on its own."""
    rng = random.Random(seed)
    phases = [PHASES[i % len(PHASES)] for i in range(num_kills)]
    rng.shuffle(phases)
    num_capture_kills = sum(p != "load" for p in phases)
    window = max(0.2, 2 * timing.capture / max(num_capture_kills, 1))
    result = LoopResult([], [])
    while result.num_killed < num_kills and len(result.outcomes) < 3 * num_kills:
        phase = phases[result.num_killed]
        outcome = kill_once(cmd, f"run-{len(result.outcomes):02d}", phase, rng, timing, window, timeout)
        result.outcomes.append(outcome)
        log(outcome.line())
        if outcome.stderr_tail:
            log(outcome.stderr_tail)
        if outcome.failed:
            break
        if not outcome.killed:  # it completed the store: check this round, start the next
            if reference is not None:
                result.rounds.append(compare_stores(reference, cmd.store))
                log(f"round {len(result.rounds)} complete: {result.rounds[-1].line()}")
            shutil.rmtree(cmd.store)
    return result


@dataclass(kw_only=True)
class Comparison:
    num_reference: int
    num_compared: int
    missing: list[str]
    extra: list[str]
    meta_equal: bool
    header_mismatches: list[str]  # "key: field" where headers differ (the states' checksums aside)
    num_bit_identical: int
    max_rel: float  # max over samples and layers of ||got - ref|| / ||ref||
    max_abs: float
    worst_key: str | None

    @property
    def ok(self) -> bool:
        return (
            not self.missing and not self.extra and self.meta_equal and not self.header_mismatches
            and self.num_compared == self.num_reference and self.max_rel <= TOLERANCE
        )

    def line(self) -> str:
        return (
            f"{self.num_compared} of {self.num_reference} samples compared: {len(self.missing)} missing, "
            f"{len(self.extra)} extra, metadata {'equal' if self.meta_equal else 'DIFFERENT'}, "
            f"{len(self.header_mismatches)} header mismatches; states bit-identical in {self.num_bit_identical}, "
            f"max relative difference {self.max_rel:.3e} (L2 per sample and layer; tolerance {TOLERANCE:g}), "
            f"max absolute {self.max_abs:.3e}" + (f" at {self.worst_key!r}" if self.worst_key else "")
        )


def compare_stores(reference: str, got: str) -> Comparison:
    """`got` against `reference`, one sample at a time."""
    import msgspec

    with Store.open(reference) as ref_store:
        ref_keys, ref_meta = list(ref_store.keys()), ref_store.meta
    with Store.open(got) as got_store:
        got_keys, got_meta = list(got_store.keys()), got_store.meta
    common = sorted(set(ref_keys) & set(got_keys))
    header_mismatches: list[str] = []
    num_identical, max_rel, max_abs, worst = 0, 0.0, 0.0, None
    with Store.open(reference) as ref_store, Store.open(got) as got_store:
        for key in common:
            a, b = ref_store.get(key), got_store.get(key)
            ha, hb = msgspec.structs.asdict(a.header), msgspec.structs.asdict(b.header)
            for name in ha:
                if name not in STATES_CHECKSUMS and ha[name] != hb.get(name):
                    header_mismatches.append(f"{key}: {name}")
            if not np.array_equal(a.input_ids, b.input_ids):
                header_mismatches.append(f"{key}: input_ids")
            if a.hidden_states.shape != b.hidden_states.shape:
                header_mismatches.append(f"{key}: shape")
                continue
            if torch.equal(a.hidden_states, b.hidden_states):
                num_identical += 1
                continue
            ref, new = a.hidden_states.double(), b.hidden_states.double()
            rel = float(((new - ref).flatten(1).norm(dim=1) / ref.flatten(1).norm(dim=1).clamp_min(1e-300)).max())
            if rel > max_rel:
                max_rel, worst = rel, key
            max_abs = max(max_abs, float((new - ref).abs().max()))
    return Comparison(
        num_reference=len(ref_keys), num_compared=len(common),
        missing=sorted(set(ref_keys) - set(got_keys)), extra=sorted(set(got_keys) - set(ref_keys)),
        meta_equal=ref_meta == got_meta, header_mismatches=header_mismatches,
        num_bit_identical=num_identical, max_rel=max_rel, max_abs=max_abs, worst_key=worst,
    )


def make_inputs(workdir: str, num_samples: int, max_tokens: int, seed: int = 0) -> tuple[str, str]:
    """A tiny float32 Llama (no tokenizer: the data is token ids) and a random dataset."""
    from corecap.demo import build_tiny_llama

    model = os.path.join(workdir, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        build_tiny_llama(model, seed=seed, num_layers=8, vocab_size=512)
    rng = np.random.default_rng(seed)
    data = os.path.join(workdir, "data.jsonl")
    with open(data, "w") as f:
        for i in range(num_samples):
            n = int(rng.integers(8, max_tokens + 1))
            f.write(json.dumps({"id": f"sample-{i:04d}", "input_ids": rng.integers(3, 512, size=n).tolist()}) + "\n")
    return model, data


def run_command(workdir: str, model: str, data: str, store: str, *, layers: str, max_batched_tokens: int,
                max_len: int, enforce_eager: bool, env: dict | None = None) -> RunCommand:
    argv = [
        sys.executable, "-m", "corecap.cli", "run", "--model", model, "--data", data, "--store", store,
        "--layers", layers, "--dtype", "float32", "--max-batched-tokens", str(max_batched_tokens),
        "--max-len", str(max_len), "--max-num-seqs", "4",
    ]
    if enforce_eager:
        argv.append("--enforce-eager")
    return RunCommand(tuple(argv), store, workdir, env or {})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", default=None,
                    help="working directory (default: a new temporary one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the working directory (stores, logs)")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--layers", default="0,2,4,8")
    ap.add_argument("--max-batched-tokens", type=int, default=32)
    ap.add_argument("--enforce-eager", action="store_true",
                    help="no torch.compile (faster starts; the default runs compile)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    workdir = args.work or tempfile.mkdtemp(prefix="kill-loop-")
    os.makedirs(workdir, exist_ok=True)
    model, data = make_inputs(workdir, args.samples, args.max_tokens, args.seed)
    make = lambda store: run_command(  # noqa: E731
        workdir, model, data, os.path.join(workdir, store), layers=args.layers,
        max_batched_tokens=args.max_batched_tokens, max_len=args.max_tokens + 16, enforce_eager=args.enforce_eager,
        env={"VLLM_CACHE_ROOT": os.path.join(workdir, "vllm-cache")},
    )
    reference_cmd, cmd = make("reference"), make("killed")
    for store in (reference_cmd.store, cmd.store):
        shutil.rmtree(store, ignore_errors=True)
    print(f"work directory {workdir}; {args.kills} kills, seed {args.seed}", flush=True)

    reference, timing = timed_run(reference_cmd, "reference", args.timeout)
    print(f"{reference.line()}\ntiming: load {timing.load:.1f}s, capture {timing.capture:.1f}s, "
          f"total {timing.total:.1f}s", flush=True)
    if reference.failed or reference.returncode != 0:
        print(reference.stderr_tail or "the reference run failed", file=sys.stderr)
        return 1
    loop = kill_loop(cmd, args.kills, args.seed, timing, reference_cmd.store, args.timeout,
                     log=lambda m: print(m, flush=True))
    outcomes = loop.outcomes
    final, _ = timed_run(cmd, "final", args.timeout)
    print(final.line(), flush=True)
    comparison = compare_stores(reference_cmd.store, cmd.store) if final.returncode == 0 else None
    print(comparison.line() if comparison else f"the final run failed:\n{final.stderr_tail}", flush=True)

    killed = [o for o in outcomes if o.killed]
    by_phase = {p: sum(o.phase == p for o in killed) for p in PHASES}
    late = sum(o.phase == "load" and o.landed == "capture" for o in killed)
    leaked = sum(o.leaked_shm_bytes for o in outcomes)
    print(
        f"/dev/shm left by the killed runs: {sum(o.leaked_shm for o in outcomes)} files, {leaked / 2**20:.0f} MiB, "
        f"removed by the runs after them but {sum(o.unrecorded_shm for o in outcomes)} made too shortly before a kill "
        f"to be recorded (removed by this harness)",
        flush=True,
    )
    ok = (comparison is not None and comparison.ok and not final.failed and not loop.failed
          and loop.num_killed == args.kills)
    print(
        f"{'OK' if ok else 'FAILED'}: {len(killed)} of {len(outcomes)} runs killed in {len(loop.rounds) + 1} rounds "
        f"({', '.join(f'{n} in {p}' for p, n in by_phase.items())}; {late} of the load kills landed in the capture); "
        f"{sum(o.failed for o in outcomes)} runs failed, left a bad store or left processes",
        flush=True,
    )
    if args.out:
        result = {
            "ok": ok,
            "command": " ".join(cmd.argv),
            "kills": args.kills,
            "seed": args.seed,
            "timing": asdict(timing),
            "reference": asdict(reference),
            "runs": [asdict(o) for o in outcomes],
            "rounds": [asdict(c) for c in loop.rounds],
            "final": asdict(final),
            "comparison": asdict(comparison) if comparison else None,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "machine": f"{os.cpu_count()} CPUs, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if not args.work and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
