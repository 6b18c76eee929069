"""The input: rows of a file (rows), conversations and their loss masks (chat), and the samples
that a run captures, validated before the model loads (samples)."""

from corecap.data.samples import DatasetSummary, Sample, check_rows, parse_shard, read_samples, shard_of, validate

__all__ = ["DatasetSummary", "Sample", "check_rows", "parse_shard", "read_samples", "shard_of", "validate"]
