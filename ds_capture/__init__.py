"""ds_capture: capture a frozen target LLM's hidden states into NeMo AutoModel's DSpark offline cache.

The target runs once over a chat dataset; chosen decoder layers, the final post-norm hidden
state, token ids, loss masks and the target's embedding / lm_head are written as a sharded
cache (format v1) that NeMo's ``train_dspark`` reads through ``recipe_args.cached_target_path``.
"""

__version__ = "0.1.0"
