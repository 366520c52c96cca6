"""Feed an EAGLE-3 cache to NeMo AutoModel 0.7.0's own reader and training checks; print a JSON verdict.

In: a cache directory and the target checkpoint it was made from. Out (stdout, one JSON object):
what NeMo's ``read_manifest``, ``_validate_cached_eagle3_manifest`` (the trainer's cached-path check),
``CachedEagle3Dataset`` (every sample), ``read_target_embeddings`` and one ``Eagle3TrainerModule``
forward/backward on a cached batch (fp32, CPU, the draft built as ``TrainEagle3Recipe`` builds it) made
of it. Run it in the side environment that has NeMo installed:

    /work/nemo_venv/bin/python tools/nemo_oracle/check_eagle3_cache.py CACHE_DIR TARGET_DIR [CACHE_DIR TARGET_DIR ...]

One JSON line per pair (NeMo's import costs ~30 s on this box, so several caches share one process).
"""

from __future__ import annotations

import json
import sys


def check(cache_dir: str, target_dir: str) -> None:
    import torch
    import transformers
    from nemo_automodel.components.datasets.llm.eagle3_cache import (
        CachedEagle3Dataset,
        build_cached_eagle3_dataloader,
        read_manifest,
        read_target_embeddings,
    )
    from nemo_automodel.components.speculative.eagle.core import Eagle3TrainerModule
    from nemo_automodel.components.speculative.eagle.draft_llama import LlamaEagle3DraftModel
    from nemo_automodel.recipes.llm.train_eagle3 import _validate_cached_eagle3_manifest

    base = transformers.AutoConfig.from_pretrained(target_dir)
    manifest = read_manifest(cache_dir)
    _validate_cached_eagle3_manifest(cache_dir, manifest, base, mask_reasoning_content=manifest["mask_reasoning_content"],
                                     mask_generation_prompt=manifest["mask_generation_prompt"])
    dataset = CachedEagle3Dataset(cache_dir)
    samples = [dataset[i] for i in range(len(dataset))]
    embeddings = read_target_embeddings(cache_dir)

    selected = torch.tensor(manifest["selected_token_ids"], dtype=torch.long)
    mask = torch.zeros(int(base.vocab_size), dtype=torch.bool)
    mask[selected] = True
    draft_config = base.to_dict()  # as TrainEagle3Recipe builds its draft config
    draft_config.update(draft_vocab_size=int(selected.numel()), target_hidden_size=base.hidden_size,
                        architectures=["LlamaEagle3DraftModel"], tie_word_embeddings=False, attn_implementation="eager",
                        fc_norm=False, norm_output=False, parallel_drafting=False)
    torch.manual_seed(0)
    draft = LlamaEagle3DraftModel(type(base).from_dict(draft_config)).to(torch.float32)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(embeddings)
    trainer = Eagle3TrainerModule(draft, selected_token_ids=selected, selected_token_mask=mask, ttt_steps=2)
    batch = next(iter(build_cached_eagle3_dataloader(cache_dir=cache_dir, batch_size=4, shuffle=False)))
    metrics = trainer(**batch)
    loss = metrics.loss
    loss.backward()
    grads = [p.grad for p in draft.parameters() if p.grad is not None]
    print(json.dumps({
        "num_samples": len(dataset), "keys": sorted(samples[0]), "target_probs_shape": list(samples[0]["target_probs"].shape),
        "embeddings_shape": list(embeddings.shape), "loss": loss.item(), "loss_finite": bool(torch.isfinite(loss.detach())),
        "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads), "num_grads": len(grads),
        "supervised_positions": int(sum(s["position_mask"].sum() for s in samples)),
    }), flush=True)


def main(argv: list[str]) -> int:
    for cache_dir, target_dir in zip(argv[::2], argv[1::2]):
        check(cache_dir, target_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
