"""The store and everything that reads or writes it: the records (format), the append-only state
files (segments), the codecs, and the commands over whole stores (verify, merge)."""

from corecap.store.decode import decode_sample
from corecap.store.format import (
    FORMAT_VERSION, FP8, LAYER_MEANING, MAX_KEY_BYTES, ModelIdentity, Record, Sample, SampleHeader,
    StoreMeta, codecs_may_mix, decode_header, encode_sample, input_fingerprint,
)
from corecap.store.store import Store

__all__ = [
    "FORMAT_VERSION", "FP8", "LAYER_MEANING", "MAX_KEY_BYTES", "ModelIdentity", "Record", "Sample",
    "SampleHeader", "Store", "StoreMeta", "codecs_may_mix", "decode_header", "decode_sample",
    "encode_sample", "input_fingerprint",
]
