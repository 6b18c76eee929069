"""The data path's receiving end, in a process of its own: chunks from the workers reassembled
into samples (collect), encoded and committed durably (writer)."""

from corecap.sink.handle import Sink
from corecap.sink.messages import Done, Failed

__all__ = ["Done", "Failed", "Sink"]
