"""corecap: capture an LLM's hidden states at chosen layers, at serving speed, into LMDB.

    corecap run --model DIR --data FILE.jsonl --store out.lmdb --layers 2,16,29,32
    corecap get KEY --store out.lmdb --out sample.safetensors
"""

__version__ = "0.1.0"


class CorecapError(Exception):
    """An error the user can cause and fix; the CLI prints it as one line and exits non-zero."""
