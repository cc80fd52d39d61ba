"""The Ray runner: a local two-CPU Ray cluster builds the same bytes as one process."""

import shutil

import pytest

from data_packing.pipeline import PackArgs
from tests.data_packing.conftest import random_texts, run_pack, write_jsonl
from tests.data_packing.test_cli import _same_tree
from tests.ray_local import local_ray_cluster


@pytest.fixture(scope="module")
def ray_cluster():
    yield from local_ray_cluster("the Ray runner needs ray (pip install 'longctx-moe[ray]')")


@pytest.mark.slow
def test_four_shards_on_ray_equal_one_process(ray_cluster, tmp_path):
    from data_packing.ray_runner import pack_on_ray

    src = write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in random_texts(160, seed=7)])
    kw = dict(sources=[src], train_tokenizer=300, seq_len=128, num_shards=4, seed=1)
    run_pack(tmp_path / "local", **kw)
    res = pack_on_ray(PackArgs(output=str(tmp_path / "ray"), progress=False, workers=2, **kw))
    assert res["complete"] and res["num_shards"] == 4 and res["skipped_shards"] == 0
    _same_tree(tmp_path / "ray", tmp_path / "local")
    # A rerun has nothing left to do; a deleted shard is rebuilt by one task.
    assert pack_on_ray(PackArgs(output=str(tmp_path / "ray"), progress=False, **kw))["skipped_shards"] == 4
    shutil.rmtree(tmp_path / "ray" / "shard_00002")
    res = pack_on_ray(PackArgs(output=str(tmp_path / "ray"), progress=False, **kw))
    assert res["skipped_shards"] == 3
    _same_tree(tmp_path / "ray", tmp_path / "local")
