"""What corecap/_vllm/media.py and the worker's tap rely on in vLLM for images, checked on its
source (corecap/_vllm/contract.py's "images" check notes it; a run whose input has images is
refused when it moved: doctor.checked_vllm_config)."""

from __future__ import annotations

from corecap._vllm.source_checks import first, lacks, method_of, signature_problem
from corecap._vllm.vllm_source import Source


def images_problem(source: Source) -> str | None:
    """What moved of what corecap/_vllm/media.py and the worker's tap rely on for images."""
    processor = source.cls("vllm.v1.engine.input_processor.InputProcessor")
    feature = source.cls("vllm.multimodal.inputs.MultiModalFeatureSpec")
    runner = source.cls("vllm.v1.worker.gpu_model_runner.GPUModelRunner")
    engine_args = source.cls("vllm.engine.arg_utils.EngineArgs")
    return first(
        signature_problem("InputProcessor", method_of(processor, "__init__"), {"self", "vllm_config"}),
        signature_problem("InputProcessor.process_inputs", method_of(processor, "process_inputs"),
                          {"self", "request_id", "prompt", "params", "supported_tasks"}),
        None if "renderer" in method_of(processor, "__init__").self_attributes()
        else "InputProcessor no longer keeps its renderer (corecap renders a prompt with images through it)",
        signature_problem("BaseRenderer.render_cmpl", method_of(source.cls("vllm.renderers.base.BaseRenderer"),
                                                                "render_cmpl"), {"self", "prompts"}),
        signature_problem("EngineCore.preprocess_add_request",
                          method_of(source.cls("vllm.v1.engine.core.EngineCore"), "preprocess_add_request"),
                          {"self", "request"}),
        lacks("MultiModalFeatureSpec has no field", {"mm_position", "mm_hash", "identifier", "modality"},
              feature.fields()),
        lacks("PlaceholderRange has no field", {"offset", "length"},
              source.cls("vllm.multimodal.inputs.PlaceholderRange").fields()),
        # mm_device_do_normalize is set only where EngineArgs has it (media.multimodal_values)
        lacks("EngineArgs no longer has", {"mm_processor_cache_gb", "skip_tokenizer_init"}, engine_args.fields()),
        # worker.py: a multimodal model runs from inputs_embeds; the ids are in runner.input_ids.gpu
        None if "input_ids" in method_of(runner, "__init__").self_attributes()
        else "GPUModelRunner no longer keeps an input_ids buffer (where corecap reads the ids of a multimodal batch)",
        lacks("GPUModelRunner._preprocess no longer reads", {"inputs_embeds", "input_ids", "embed_input_ids"},
              method_of(runner, "_preprocess").names()),
    )
