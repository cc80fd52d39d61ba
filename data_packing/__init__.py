"""data_packing: tokenize and pack documents into rows with exact boundaries; feed micro-batches.

- `longctx-pack` CLI (`data_packing.cli`, `python -m data_packing`) writes packed shards;
- `data_packing.loader` reads them: `read_metadata`, `PackedDataset`, `StepLoader`,
  `build_step_loader`.
"""

from data_packing.batch import IGNORE_INDEX, PackedBatch
from data_packing.config import DataConfig
from data_packing.loader import PackedDataset, StepLoader, build_step_loader, read_metadata

__all__ = ["IGNORE_INDEX", "DataConfig", "PackedBatch", "PackedDataset", "StepLoader",
           "build_step_loader", "read_metadata"]
