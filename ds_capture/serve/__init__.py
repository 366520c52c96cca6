"""The capture service: ``ds-capture serve``, a sharded target that NeMo AutoModel 0.7.0's EAGLE-3 trainer
(``target_model_backend: remote``) trains against online, over NeMo's remote HTTP protocol (docs/serve.md)."""
