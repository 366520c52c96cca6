"""The cache half of ``ds-capture plan``: how large the cache will be, per sample, in total and on disk.

In:  the run config, the target, the cache's layer ids, and (when it is here) the dataset. Out: :func:`cache_estimate`
     -> bytes per sample and in total (format v1 pads every row to S), the target weights, and what the rows would
     take on disk without their padding (token counts measured with the target's tokenizer, or estimated).
"""

from __future__ import annotations

from typing import Any

from ds_capture.sizing import memory_model as mm
from ds_capture.target.families import TargetInfo


def row_bytes(cfg: Any, target: TargetInfo, layer_ids: list[int]) -> int:
    """One cached row as its kind stores it, padded to S (one row of the writer's micro-batch too): DSpark v1's ids,
    mask and states; EAGLE-3 v2's ids, masks, aux states and target distribution over the draft vocabulary."""
    args, H = cfg.recipe_args, target.hidden_size
    cb = mm.DTYPE_BYTES[args.cache_dtype]
    if cfg.cache_kind == "eagle3":
        vocab = target.vocab_size
        return mm.eagle3_row_bytes(seq_length=args.seq_length, hidden_size=H, num_layer_ids=len(layer_ids),
                                   cache_bytes=cb, draft_vocab_size=min(args.draft_vocab_size or vocab, vocab),
                                   target_probs_topk=args.target_probs_topk or 0)
    return mm.cache_bytes_per_sample(seq_length=args.seq_length, hidden_size=H, num_layer_ids=len(layer_ids),
                                     cache_bytes=cb)


def cache_estimate(cfg: Any, target: TargetInfo, layer_ids: list[int], count_dataset: bool) -> dict[str, Any]:
    """Bytes per sample and in total (both formats pad every row to S), and on disk if padding were not stored."""
    args = cfg.recipe_args
    H, cb = target.hidden_size, mm.DTYPE_BYTES[args.cache_dtype]
    per_sample = row_bytes(cfg, target, layer_ids)
    # DSpark's target_weights (embed_tokens + lm_head, cache dtype); EAGLE-3's target_embeddings (fp32).
    weights = (target.vocab_size * H * 4 if cfg.cache_kind == "eagle3"
               else mm.target_weights_bytes(vocab_size=target.vocab_size, hidden_size=H, cache_bytes=cb))
    out: dict[str, Any] = {"format": "EAGLE-3 format v2" if cfg.cache_kind == "eagle3" else "format v1",
                           "bytes_per_sample": per_sample, "target_weights_bytes": weights, "num_samples": None,
                           "total_bytes": None, "unpadded_total_bytes": None, "lengths": None}
    if not count_dataset or not args.train_data.exists():
        out["note"] = f"dataset {args.train_data_path} not found here: totals need its row count"
        return out
    from ds_capture.data.tokenization import read_conversations

    conversations = read_conversations(str(args.train_data), split=args.train_split,
                                       shuffle_seed=args.shuffle_seed)
    lengths, how = _sample_lengths(cfg, target, conversations)
    num_samples = len(conversations)
    mean_tokens = sum(lengths) / len(lengths) if lengths else 0.0
    out.update(num_samples=num_samples, total_bytes=num_samples * per_sample + weights,
               unpadded_total_bytes=int(per_sample // args.seq_length * mean_tokens * num_samples) + weights,
               lengths={"how": how, "rows_measured": len(lengths), "mean_tokens": round(mean_tokens, 1)})
    return out


def _sample_lengths(cfg: Any, target: TargetInfo, conversations: list, limit: int = 1000) -> tuple[list[int], str]:
    """Token counts (truncated to S) of up to ``limit`` evenly spaced rows: with the target's tokenizer when its
    directory has one, else estimated as one token per 4 characters of content (+ 8 per message for the template)."""
    args = cfg.recipe_args
    step = max(1, len(conversations) // limit)
    picked = conversations[::step][:limit]
    if any((target.path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        from transformers import AutoTokenizer

        from ds_capture.data.tokenization import resolve_chat_template, tokenize_conversations

        tokenizer = AutoTokenizer.from_pretrained(str(target.path), trust_remote_code=args.trust_remote_code)
        rows = tokenize_conversations(picked, tokenizer, chat_template=resolve_chat_template(tokenizer,
                                      args.chat_template), seq_length=args.seq_length,
                                      mask_reasoning_content=args.mask_reasoning_content,
                                      mask_generation_prompt=args.mask_generation_prompt)
        return [int(n) for n in rows.num_tokens], "tokenized with the target's tokenizer"
    lengths = []
    for messages in picked:
        chars = sum(len(str(m.get("content") or "")) + len(str(m.get("reasoning_content") or "")) for m in messages)
        lengths.append(min(args.seq_length, chars // 4 + 8 * len(messages)))
    return lengths, "estimated at 4 characters per token (no tokenizer in the target directory)"
