"""DSA indexer tie-breaking: how far a padded row's hidden states sit from the same row forwarded alone.

In:  the tiny random-init DSA families (``ds_capture.demo.TINY_CONFIGS``: deepseek_v32, glm_moe_dsa, glm5_next; and
     deepseek_v4, whose compressed-attention indexer selects top-k the same way) with
     their indexer at 2 and at 16 heads, the first 16 demo conversations (at most 64 tokens), right-padded in pairs.
Out: JSON on stdout: per family and head count, the max |padded - alone| over every hidden state of every row.

The indexer scores each key as a sum over heads of ReLU'd dot products and keeps the top ``index_topk``; with few
heads many scores are exactly 0, and ``torch.topk`` breaks those ties differently for a row of another length
(padding), so the selected keys and the attention output change. With realistic head counts exact ties vanish.

    python benchmarks/dsa_ties.py
"""

from __future__ import annotations

import json

import torch
import transformers

from ds_capture.demo import TINY_CONFIGS, _padded_vocab_size, demo_data_path, demo_tokenizer
from ds_capture.target.families import FAMILIES

FAMILIES_WITH_DSA = ("deepseek_v32", "glm_moe_dsa", "glm5_next", "deepseek_v4")
HEAD_COUNTS = (2, 16)
NUM_ROWS, MAX_TOKENS = 16, 64


def build(model_type: str, index_n_heads: int, tokenizer) -> torch.nn.Module:
    config = dict(TINY_CONFIGS[model_type])
    if "text_config" in config:
        config["text_config"] = dict(config["text_config"], index_n_heads=index_n_heads)
    else:
        config["index_n_heads"] = index_n_heads
    special = dict(vocab_size=_padded_vocab_size(tokenizer), pad_token_id=tokenizer.pad_token_id,
                   eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    auto_class = getattr(transformers, FAMILIES[model_type].auto_class)
    config = transformers.AutoConfig.for_model(model_type, **{**config, **special})
    return auto_class.from_config(config, dtype=torch.float32).eval()


@torch.no_grad()
def padded_vs_alone(model: torch.nn.Module, rows: list[list[int]], pad_id: int) -> float:
    worst = 0.0
    for start in range(0, len(rows), 2):
        pair = rows[start:start + 2]
        length = max(len(row) for row in pair)
        ids = torch.full((len(pair), length), pad_id)
        mask = torch.zeros(len(pair), length, dtype=torch.long)
        for i, row in enumerate(pair):
            ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
        batched = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False).hidden_states
        for i, row in enumerate(pair):
            alone = model(input_ids=ids[i:i + 1, :len(row)], output_hidden_states=True, use_cache=False).hidden_states
            worst = max(worst, max((a[i, :len(row)] - b[0]).abs().max().item() for a, b in zip(batched, alone)))
    return worst


def main() -> None:
    tokenizer = demo_tokenizer()
    lines = demo_data_path().read_text(encoding="utf-8").splitlines()[:NUM_ROWS]
    texts = [tokenizer.apply_chat_template(json.loads(line)["messages"], tokenize=False) for line in lines]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"][:MAX_TOKENS] for text in texts]
    results = {f"{model_type} index_n_heads={heads}": padded_vs_alone(build(model_type, heads, tokenizer), rows,
                                                                        tokenizer.pad_token_id)
               for model_type in FAMILIES_WITH_DSA for heads in HEAD_COUNTS}
    print(json.dumps({"max_abs_padded_vs_alone": results}, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
