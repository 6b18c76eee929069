"""Requests with images, through vLLM's own multimodal input path: its renderer runs the model's
own processor over the prompt's token ids and the images (the placeholder token of each image
expanded to the image's tokens, the pixel values made, each item hashed by content), vLLM's
InputProcessor turns that into an EngineCoreRequest with its multimodal features, and the engine
core's `preprocess_add_request` makes the `Request` of it with the features in place at
construction, so that its block hashes include the images' hashes (prefix caching keys on them).
corecap holds no copy of that logic: what it reads back is the expanded ids and, per image, the
span of its tokens and vLLM's content hash (`Expanded`).

An engine runs with the tokenizer on, its processor cache off and the pixels normalized on the
host when the input has images (options.py, `_multimodal_values`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Expanded:
    """A prompt as the model's processor expanded it: the token ids the model runs on, and per
    image (in prompt order) its (offset, length) and vLLM's hash of its content."""

    token_ids: np.ndarray  # int32 [T]
    spans: tuple[tuple[int, int], ...]
    hashes: tuple[str, ...]


def load_image(source):
    """A PIL RGB image of `source` (a path or bytes), decoded whole."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    image.load()
    return image.convert("RGB")


class MediaInputs:
    """vLLM's input processor for one engine configuration (the driver's process)."""

    def __init__(self, vllm_config):
        from vllm.multimodal import MULTIMODAL_REGISTRY
        from vllm.v1.engine.input_processor import InputProcessor

        self.processor = InputProcessor(vllm_config)
        self.vllm_config = vllm_config
        limits = MULTIMODAL_REGISTRY.get_processing_info(vllm_config.model_config).get_supported_mm_limits()
        # Kimi-K2.5 takes images as "vision_chunk" items (its processor's one modality)
        self.modality = "image" if "image" in limits else "vision_chunk" if "vision_chunk" in limits else None
        if self.modality is None:
            raise RuntimeError(f"{vllm_config.model_config.architecture} takes no images "
                               f"(its modalities: {', '.join(limits) or 'none'})")

    def _items(self, images) -> list:
        pictures = [load_image(source) for source in images]
        if self.modality == "vision_chunk":
            return [{"type": "image", "image": p, "uuid": None} for p in pictures]
        return pictures

    def engine_request(self, req_id: str, token_ids, images, params):
        """vLLM's EngineCoreRequest for the prompt `token_ids` (one placeholder token per image)
        and `images` (paths or bytes, in prompt order)."""
        prompt = {"prompt_token_ids": [int(t) for t in token_ids],
                  "multi_modal_data": {self.modality: self._items(images)}}
        (engine_input,) = self.processor.renderer.render_cmpl([prompt])
        return self.processor.process_inputs(req_id, engine_input, params, supported_tasks=("generate",))

    def expand(self, token_ids, images, params=None) -> Expanded:
        """The prompt as the processor expands it (for the validation pass, before any request)."""
        if params is None:
            from vllm.sampling_params import SamplingParams

            params = SamplingParams(max_tokens=1, detokenize=False)
        return expanded(self.engine_request("corecap-expand", token_ids, images, params))


def block_hashes(media: MediaInputs, token_ids, images, block_size: int) -> list:
    """vLLM's prefix-cache keys of a prompt with images, made as the engine core makes them for
    the Request of it (`media_request`, with prefix caching on): each full block's hash chains
    the ids up to its end and, for every image that overlaps the block, the image's content hash
    and offset. So two prompts share a cached block only where their ids and their images up to
    its end are the same (tests/test_images.py checks that on the installed vLLM, without an
    engine). vLLM hashes an image's content only where `vllm_config` has prefix caching (or its
    processor cache) on; otherwise it names each image after its request."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(media.vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    core_request = media.engine_request("corecap-block-hashes", token_ids, images,
                                        SamplingParams(max_tokens=1, detokenize=False))
    return list(Request.from_engine_core_request(core_request, get_request_block_hasher(block_size, hash_fn))
                .block_hashes)


def expanded(request) -> Expanded:
    """What an EngineCoreRequest's multimodal features say of its prompt."""
    features = request.mm_features or []
    return Expanded(
        token_ids=np.asarray(request.prompt_token_ids, np.int32),
        spans=tuple((int(f.mm_position.offset), int(f.mm_position.length)) for f in features),
        hashes=tuple(str(f.mm_hash or f.identifier) for f in features),
    )


def media_request(core, media: MediaInputs, req_id: str, token_ids: list[int], images: tuple, params):
    """The Request of a prompt with images (`Engine.add`): vLLM's processor makes its
    EngineCoreRequest (the features, their hashes and placeholders), the engine core its Request
    (block hashes over them). `images`: (the prompt before its expansion, the images' sources);
    the expanded prompt must be `token_ids`, the one the validation pass made."""
    from corecap.errors import CorecapError

    prompt, sources = images
    core_request = media.engine_request(req_id, prompt, sources, params)
    # corecap's own sampling, as a text request has it (InputProcessor adds the model's defaults to its copy)
    core_request.sampling_params = params
    if list(core_request.prompt_token_ids) != list(token_ids):
        raise CorecapError(f"request {req_id}: vLLM's processor expanded its images to other tokens than when the "
                           "input was checked")
    request, _ = core.preprocess_add_request(core_request)
    return request


MULTIMODAL_NOTE = ("images: vLLM's tokenizer and multimodal processor on, its processor cache off, "
                   "pixels normalized on the host")


def multimodal_values(extra: dict) -> dict:
    """What an input with images needs of vLLM's engine arguments (options.py): the tokenizer
    (without it vLLM runs a vision-language model text-only: set there), no processor cache
    (corecap processes a request's images in this process and hands the request to the engine
    core itself, which then holds no copy of a cached item's data), and the pixels normalized by
    the image processor on the host (the values the vision tower sees are the processor's output,
    as HF's are), unless given otherwise. A vLLM without `mm_device_do_normalize` (0.26) always
    normalizes on the host."""
    from corecap._vllm.vllm_source import vllm_engine_arg_names
    from corecap.errors import CorecapError

    cache = extra.get("mm_processor_cache_gb")
    if cache:
        raise CorecapError(f"--mm-processor-cache-gb {cache}: corecap runs image rows with vLLM's processor cache off "
                           "(it hands each request to the engine core itself)")
    names = vllm_engine_arg_names()  # empty where vLLM's source cannot be read: then the adapter's check stands
    host = {"mm_device_do_normalize": False} if not names or "mm_device_do_normalize" in names else {}
    return {**host, **extra, "mm_processor_cache_gb": 0}
