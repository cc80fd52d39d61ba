"""The parallel layout's padding multiple reaches the loader as an argument: every document slot
is padded to the lcm of the layout's multiple and the user's data.pad_multiple, and the user's
setting is never overwritten."""

import numpy as np

from data_packing.config import DataConfig
from data_packing.loader import build_step_loader


def test_slots_pad_to_the_lcm_and_the_user_setting_stays(ids_dataset):
    path, _ = ids_dataset
    cfg = DataConfig(path=path, global_batch_tokens=2048, micro_batch_tokens=512, pad_multiple=6, seed=3)
    loader = build_step_loader(cfg, 0, 1, layout_multiple=8)
    assert loader.pad_multiple == 24 and cfg.pad_multiple == 6
    slots = np.concatenate([np.diff(mb.cu_seqlens_padded.numpy()) for mb in next(iter(loader))])
    assert len(slots) and (slots % 24 == 0).all()
    lengths = np.concatenate([np.diff(mb.cu_seqlens.numpy()) for mb in next(iter(loader))])
    assert (lengths % 24 != 0).any()  # real lengths are not multiples: the padding did the work
