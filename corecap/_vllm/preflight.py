"""Before any weight loads: which model class vLLM will build, and how corecap captures from it.

Runs in the driver on the engine configuration (`build_vllm_config`), with vLLM's own resolver
(`get_model_architecture`: the same answer the workers get, honouring --model-impl, the
Transformers fallback and `model_class_overrides`); it imports one model module and costs well
under a second. Three ways to capture, chosen here:

- the model's own EAGLE-3 auxiliary outputs (`SupportsEagle3`: Llama, Qwen2/3, Qwen3-MoE,
  DeepSeek-V2/V3, Kimi, GPT-OSS, Qwen3-Next, Mistral, Phi-3, and vLLM's Transformers backend);
- corecap's own, for vLLM classes without them whose decoder is the standard residual loop
  (corecap/_vllm/models.py: Gemma 2/3, Mixtral, Qwen2-MoE, GLM-4, GLM-4-MoE);
- neither: a one-line error naming the architecture and what to do instead, before the
  20-minute weight load that would otherwise end in a worker's traceback.

Layer 0 and N need no auxiliary outputs (the embeddings and the main output), so a run asking
only for those captures any architecture.
"""

from __future__ import annotations

from dataclasses import dataclass

from corecap.config import PRENORM, Layer
from corecap.errors import CorecapError


@dataclass(frozen=True)
class CapturePlan:
    architecture: str  # the class vLLM builds
    route: str  # "eagle3" (the model's own), "override" (corecap's), "none" (no aux needed)
    override: str | None = None  # the model_class_overrides target, for "override"

    def line(self) -> str:
        how = {
            "eagle3": "the model's own EAGLE-3 auxiliary outputs",
            "override": "corecap's auxiliary outputs (corecap/_vllm/models.py)",
            "none": "the embeddings and the main output only",
        }[self.route]
        return f"capture: {self.architecture}, {how}"


def needs_aux(layers: tuple[Layer, ...] | None, num_layers: int) -> bool:
    """Whether any requested layer comes from auxiliary outputs (None: not known yet, assume so)."""
    return layers is None or any(k == PRENORM or 0 < k < num_layers for k in layers)


def plan_capture(vllm_config, layers: tuple[Layer, ...] | None) -> CapturePlan:
    """How corecap will capture `layers` from the model this configuration builds, or a
    CorecapError saying why it cannot and what to do instead."""
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.model_executor.models.interfaces import supports_eagle3

    from corecap._vllm import models

    model_config = vllm_config.model_config
    try:
        cls, arch = get_model_architecture(model_config)
    except Exception as e:  # vLLM's words, one line
        raise CorecapError(f"vLLM cannot resolve the model class of {model_config.model}: "
                           f"{str(e).strip().splitlines()[0]}") from None
    if models.is_override(cls):  # an earlier run in this process registered corecap's class: judge vLLM's
        cls = cls.__mro__[1]
    name = cls.__name__
    if not needs_aux(layers, model_config.hf_text_config.num_hidden_layers):
        return CapturePlan(name, "none")
    if supports_eagle3(cls):
        _check_transformers_backend(cls)
        return CapturePlan(name, "eagle3")
    reason = models.why_not(cls)
    if reason is None:
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise CorecapError(
                f"{arch}: corecap's auxiliary outputs for {name} do not cross pipeline stages; "
                f"run it with --pipeline-parallel-size 1 (tensor parallelism is fine)"
            )
        return CapturePlan(name, "override", models.override_target(cls))
    instead = (
        "run with --model-impl transformers (vLLM's Transformers backend has auxiliary outputs)"
        if model_config.model_impl != "transformers" else "ask only for layers 0 and N"
    )
    raise CorecapError(
        f"{arch}: vLLM's {name} has no EAGLE-3 auxiliary outputs and corecap has none of its own for it "
        f"({reason}); {instead}"
    )


def _check_transformers_backend(cls) -> None:
    """vLLM 0.26's Transformers backend needs transformers 5.2 for its auxiliary outputs, and
    says so only in the worker, after the weights have loaded."""
    if not cls.__module__.startswith("vllm.model_executor.models.transformers"):
        return
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("5.2.0"):
        raise CorecapError(
            f"{cls.__name__} (--model-impl transformers) has auxiliary outputs from transformers 5.2 on; "
            f"this is {transformers.__version__}: upgrade transformers"
        )
