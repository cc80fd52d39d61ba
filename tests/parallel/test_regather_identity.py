"""_Regather (sequence_parallel.py) tells the gathered input's storage from every other saved
tensor by the storage itself, not by its address: storages without memory (meta tensors, empty
ones) all sit at address 0, and a region saves many of them (the attention boundaries among
them). One process, no group: pack() talks to nobody."""

from __future__ import annotations

import pytest
import torch

from longctx_moe.parallel.sequence_parallel import _Regather


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_only_views_of_the_gathered_input_are_packed(device):
    x_TD = torch.zeros(8, 4, device=device)
    hooks = _Regather(x_TD[:4], x_TD, group=None)
    cu_S = torch.zeros(3, dtype=torch.int32, device=device)  # another tensor the region saves
    weight = torch.zeros(4, 4, device=device)
    assert hooks.pack(cu_S) is cu_S and hooks.pack(weight) is weight
    packed = hooks.pack(x_TD.t()[1:])  # a view: kept as (hooks, size, stride, offset)
    assert packed[0] is hooks and packed[1:] == ((3, 8), (1, 4), 1)
    assert hooks.pack(x_TD) is not x_TD
    assert hooks.pending == 2


def test_the_address_alone_cannot_tell_meta_storages_apart():
    # Why the identity: this is what the address-based test saw on meta.
    a, b = torch.zeros(4, device="meta"), torch.zeros(3, dtype=torch.int32, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
