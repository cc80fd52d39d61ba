"""Hugging Face interop: our model as a checkpoint of one of several MoE families.

    families.py the registry: per model_type, config.json keys <-> model.*, refused settings, names
    interop.py  names and state dicts between our model and a family's (on disk and in memory)
    weights.py  the policy's weights as HF-named tensors in byte-capped buckets, gathered over
                TP / EP / ETP (rollout engines' weight sync, and export-hf's shards)
    export.py   `longctx-moe export-hf`: a run's checkpoint as an HF directory of its family
    load.py     `train.init_from`: config.json into model.*, each rank reading only its slices
"""
