"""What we need to know about a model directory before vLLM loads it: its identity and tokenizer.

Identity is content, not a path: a hash of the canonical config.json, and a weights fingerprint
made of each weight file's name, size, safetensors header and first and last MiB. That tells a
re-trained or re-quantized checkpoint from the old one in milliseconds, without reading 140 GB.
"""

from __future__ import annotations

import hashlib
import json
import os

from corecap import quantization
from corecap.errors import CorecapError
from corecap.store import ModelIdentity

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")
_EDGE_BYTES = 1 << 20


def resolve_model_dir(name: str) -> str:
    """A model directory, or a Hugging Face model id already in the local cache (offline, as vLLM
    resolves it: HF_HUB_CACHE / HF_HOME). The directory is what vLLM gets, so its workers never
    need the network."""
    if os.path.isdir(name):
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    from huggingface_hub.utils import validate_repo_id

    if os.path.exists(name):
        raise CorecapError(f"--model {name}: not a directory (expected a HF model directory or a model id)")
    try:
        validate_repo_id(name)
    except HFValidationError:  # /abs/path, ./dir, a/b/c: only a path, never an id; downloading would not help
        raise CorecapError(f"--model {name}: no such directory (expected a HF model directory)") from None
    try:
        return snapshot_download(repo_id=name, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        raise CorecapError(
            f"--model {name}: not a directory, and not a model in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it first ({_download_command()} {name}) or give its directory"
        ) from None


def _download_command() -> str:
    """The installed huggingface_hub's download command: `hf` since 0.34, which 1.x and later ship
    alone (`huggingface-cli` is gone there)."""
    import huggingface_hub

    major, minor = (int(part) for part in huggingface_hub.__version__.split(".")[:2])
    return "hf download" if (major, minor) >= (0, 34) else "huggingface-cli download"


def read_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise CorecapError(f"--model {model_dir}: not a directory (expected a HF model directory)")
    try:
        with open(path) as f:
            config = json.load(f)
    except OSError as e:
        raise CorecapError(f"--model {model_dir}: cannot read config.json ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CorecapError(f"{path}: line {e.lineno}: not valid JSON ({e.msg})") from None
    text = config.get("text_config", config)
    for field in ("num_hidden_layers", "hidden_size", "vocab_size"):
        if not isinstance(text.get(field), int):
            raise CorecapError(f"{path}: missing integer field {field!r}")
    return config


def weights_fingerprint(model_dir: str, load_format: str) -> str:
    if load_format == "dummy":
        return "dummy"
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(_WEIGHT_SUFFIXES))
    if not files:
        raise CorecapError(f"--model {model_dir}: no weight files (*.safetensors, *.bin) found")
    h = hashlib.blake2b(digest_size=16)
    for name in files:
        path = os.path.join(model_dir, name)
        size = os.path.getsize(path)
        h.update(f"{name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(_EDGE_BYTES))
            if size > 2 * _EDGE_BYTES:
                f.seek(size - _EDGE_BYTES)
                h.update(f.read(_EDGE_BYTES))
    return h.hexdigest()


def model_identity(model_dir: str, load_format: str) -> ModelIdentity:
    config = read_config(model_dir)
    text = config.get("text_config", config)
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return ModelIdentity(
        path=os.path.abspath(model_dir),
        architecture=(config.get("architectures") or ["?"])[0],
        config_hash=hashlib.blake2b(canonical, digest_size=16).hexdigest(),
        weights_fingerprint=weights_fingerprint(model_dir, load_format),
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        quantization=quantization.describe(config),
    )


def load_tokenizer(model_dir: str):
    """The model's HF tokenizer from local files only; None when the directory has none."""
    if not any(
        os.path.exists(os.path.join(model_dir, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as e:  # transformers raises many types here
        raise CorecapError(f"--model {model_dir}: cannot load its tokenizer ({e})") from None
