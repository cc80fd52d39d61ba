"""data_packing: tokenize and pack documents into rows with exact boundaries; feed micro-batches."""

from data_packing.batch import IGNORE_INDEX, PackedBatch

__all__ = ["IGNORE_INDEX", "PackedBatch"]
