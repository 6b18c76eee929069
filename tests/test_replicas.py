"""The data-parallel loop's bookkeeping (corecap/_vllm/replicas.py) and where each replica's
ranks go (corecap/_vllm/parallel.py, `placement`), with stand-in engines and configs: no vLLM
engine starts here (tests/test_parallel.py runs the real ones)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from corecap._vllm import parallel
from corecap._vllm.engine import StepTiming
from corecap._vllm.replicas import Replicas
from corecap.errors import CorecapError


class _Engine:
    """Stands in for `Engine`: requests finish after one step, except `slow` ones."""

    def __init__(self, k: int, fail: str | None = None):
        self.replica, self.fail = k, fail
        self.tokens: dict[str, int] = {}
        self.num_outstanding_tokens = self.num_unfinished = 0
        self.stepped = 0

    def add(self, req_id, token_ids, response=None, settings=None):  # Engine.add's signature
        self.tokens[req_id] = len(token_ids) + (response.max_tokens if response is not None else 0)
        self.num_outstanding_tokens += self.tokens[req_id]
        self.num_unfinished += 1

    def step(self):
        if self.fail:
            raise CorecapError(self.fail)
        self.stepped += 1
        finished = list(self.tokens)
        self.tokens.clear()
        self.num_unfinished, self.num_outstanding_tokens = 0, 0
        return StepTiming(start=0.0, finished=finished, replica=self.replica)

    def problem(self):
        return self.fail


def _replicas(*engines) -> Replicas:
    r = Replicas.__new__(Replicas)
    r.engines, r.num_replicas, r._next = list(engines), len(engines), 0
    return r


def test_samples_go_to_the_replica_with_the_fewest_outstanding_tokens():
    a, b = _Engine(0), _Engine(1)
    r = _replicas(a, b)
    r.add("long", [1] * 100)  # a: 100
    r.add("s1", [1] * 10)  # b: 10
    r.add("s2", [1] * 10)  # b: 20
    r.add("s3", [1] * 85)  # b: 105
    r.add("s4", [1] * 3)  # a: 103
    assert sorted(a.tokens) == ["long", "s4"] and sorted(b.tokens) == ["s1", "s2", "s3"]
    assert r.num_unfinished == 5


def test_steps_go_round_robin_over_the_replicas_with_work():
    a, b, c = _Engine(0), _Engine(1), _Engine(2)
    r = _replicas(a, b, c)
    a.add("x", [1]), c.add("y", [1])
    assert [r.step().replica for _ in range(2)] == [0, 2]  # b has nothing to do: skipped
    assert r.num_unfinished == 0
    with pytest.raises(AssertionError):
        r.step()


def test_errors_and_problems_name_the_replica():
    r = _replicas(_Engine(0), _Engine(1, fail="worker rank 0 (pid 42) died during an engine step"))
    r.engines[1].add("x", [1])
    with pytest.raises(CorecapError, match=r"^replica 1: worker rank 0 \(pid 42\) died during an engine step$"):
        r.step()
    assert r.problem() == "replica 1: worker rank 0 (pid 42) died during an engine step"
    alone = _replicas(_Engine(0, fail="worker rank 0 (pid 7) died"))
    assert alone.problem() == "worker rank 0 (pid 7) died"  # one engine: as before -dp existed


def _config(tp=1, pp=1, nnodes=1):
    return SimpleNamespace(parallel_config=SimpleNamespace(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, nnodes=nnodes, local_world_size=tp * pp // nnodes,
    ))


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(parallel, "cpu_platform", lambda: True)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr(parallel.os, "sched_getaffinity", lambda pid: set(range(8)))
    return monkeypatch


def test_each_replica_gets_its_own_cores(cpu):
    assert parallel.placement(_config(), 1) == [{}]  # a lone rank: vLLM's own binding
    assert parallel.placement(_config(tp=2), 1) == [{"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}]
    assert parallel.placement(_config(tp=2), 2) == [{"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"},
                                                    {"VLLM_CPU_OMP_THREADS_BIND": "4-5|6-7"}]
    assert parallel.placement(_config(), 4) == [{"VLLM_CPU_OMP_THREADS_BIND": f"{2 * k}-{2 * k + 1}"} for k in range(4)]
    with pytest.raises(CorecapError, match=r"^-dp 3 x -tp 1 x -pp 3 = 9 ranks need 9 CPU cores, this machine gives 8$"):
        parallel.placement(_config(pp=3), 3)


def test_a_users_core_lists_are_split_by_replica(cpu):
    cpu.setenv("VLLM_CPU_OMP_THREADS_BIND", "0,1|2,3|4|5")
    assert parallel.placement(_config(tp=2), 2) == [{"VLLM_CPU_OMP_THREADS_BIND": "0,1|2,3"},
                                                    {"VLLM_CPU_OMP_THREADS_BIND": "4|5"}]
    with pytest.raises(CorecapError, match=r"4 core lists, expected one per rank \(-dp 1 x -tp 2 x -pp 1 = 2 ranks\)"):
        parallel.placement(_config(tp=2), 1)
    cpu.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert parallel.placement(_config(), 2) == [{}, {}]


def test_each_replica_gets_its_own_gpus(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(parallel, "cpu_platform", lambda: False)
    monkeypatch.setattr(type(current_platform), "device_count", classmethod(lambda cls: 8), raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert parallel.placement(_config(tp=8), 1) == [{}]
    assert parallel.placement(_config(tp=2), 4) == [{"CUDA_VISIBLE_DEVICES": f"{2 * k},{2 * k + 1}"} for k in range(4)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert parallel.placement(_config(), 2) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    with pytest.raises(CorecapError,
                       match=r"^-dp 4 x -tp 2 x -pp 1 = 8 ranks need 8 GPUs, CUDA_VISIBLE_DEVICES=3,5,6,7 gives 4$"):
        parallel.placement(_config(tp=2), 4)
    # a node's share of an engine across nodes: its own ranks only
    assert parallel.placement(_config(tp=8, nnodes=2), 1) == [{}]


def test_a_replicas_environment_is_its_workers_and_then_the_runs_again(monkeypatch):
    import os

    import vllm.envs as envs

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert envs.VLLM_CPU_OMP_THREADS_BIND == "0-1"
    envs.enable_envs_cache()  # as an engine leaves it
    try:
        with parallel.replica_environment({"VLLM_CPU_OMP_THREADS_BIND": "1"}):
            assert envs.VLLM_CPU_OMP_THREADS_BIND == "1"  # not the cached value
            envs.enable_envs_cache()
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and envs.VLLM_CPU_OMP_THREADS_BIND == "0-1"
    finally:
        envs.disable_envs_cache()
