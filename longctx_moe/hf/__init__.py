"""Hugging Face interop: our model in transformers' Qwen3-MoE terms.

    interop.py  config and state-dict conversion between our model and transformers' classes
    weights.py  the policy's weights as HF-named tensors in byte-capped buckets, gathered over
                TP / EP / ETP (rollout engines' weight sync, and export-hf's shards)
    export.py   `longctx-moe export-hf`: a run's checkpoint as an HF directory
    load.py     `train.init_from`: an HF directory into our model
"""
