"""End to end: ``run_capture`` (defaults: trimmed + sorted batches, async writer) vs a plain baseline loop.

In: the demo target (``ensure_demo_target``) and the first ``--samples`` bundled conversations at
seq 512. Out: one JSON object on stdout: each path's runs, median seconds and tokens/s, and
``ratio`` = run_capture tokens/s / baseline tokens/s (goal: >= 2).

Both paths are timed around everything they do, from the dataset file to the last byte on disk:
tokenisation (the same ``ds_capture.data.tokenization`` functions), model load, forwards, writes.

- ``baseline`` (kept here as the reference): the plain loop one would write first. Every micro-batch
  (dataset order) is forwarded at the full seq_length with an attention mask; forward hooks on the
  captured decoder layers and the final norm keep their outputs; each finished shard is written
  with ``safetensors.torch.save_file`` synchronously; target weights and a manifest are written too.
  It does less bookkeeping than the runner (no checksums, fsync, lock or fingerprints).
- ``run_capture``: the real job from a YAML recipe (default ``capture`` options), into a fresh
  directory each repeat.

    . .venv/bin/activate && python benchmarks/end_to_end.py [--samples 128] [--shard-size 64] [--repeats 3]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
import yaml
from common import base_parser, interleaved, median, summary, workload


def baseline(work, out: Path) -> None:
    """The reference loop: full padded forward + output hooks + synchronous safetensors writes."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations
    from ds_capture.demo import demo_data_path

    out.mkdir(parents=True)
    tokenizer = AutoTokenizer.from_pretrained(str(work.target_dir))
    rows = tokenize_conversations(
        read_conversations(str(demo_data_path()), split=work.split, shuffle_seed=42), tokenizer,
        chat_template=resolve_chat_template(tokenizer, None), seq_length=work.seq_length,
        mask_reasoning_content=False, mask_generation_prompt=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(work.target_dir, dtype=torch.float32).eval()
    save_file({"embed_tokens.weight": model.model.embed_tokens.weight.detach().contiguous(),
               "lm_head.weight": model.lm_head.weight.detach().contiguous()}, out / "target_weights.safetensors")
    (out / "manifest.json").write_text(work.manifest().to_json())

    num_layers = work.target.num_hidden_layers
    outputs: dict[int, torch.Tensor] = {}

    def keep(layer_id):
        def hook(_module, _args, output):
            outputs[layer_id] = (output[0] if isinstance(output, tuple) else output).detach().clone()
        return hook

    handles = [model.model.layers[i].register_forward_hook(keep(i)) for i in work.layer_ids if i < num_layers - 1]
    handles.append(model.model.norm.register_forward_hook(keep(num_layers - 1)))
    n, S, mb = len(rows.input_ids), work.seq_length, work.micro_batch_size
    try:
        with torch.no_grad():
            for shard, lo in enumerate(range(0, n, work.shard_size)):
                hi = min(n, lo + work.shard_size)
                hidden, last = [], []
                for b in range(lo, hi, mb):
                    ids = rows.input_ids[b:min(hi, b + mb)]
                    mask = (torch.arange(S)[None, :] < rows.num_tokens[b:min(hi, b + mb), None]).long()
                    model(input_ids=ids, attention_mask=mask, use_cache=False)
                    hidden.append(torch.cat([outputs[i] for i in work.layer_ids], dim=-1))
                    last.append(outputs[num_layers - 1])
                save_file({"input_ids": rows.input_ids[lo:hi].contiguous(),
                           "loss_mask": rows.loss_mask[lo:hi].contiguous(),
                           "target_hidden_states": torch.cat(hidden), "target_last_hidden_states": torch.cat(last)},
                          out / f"shard-{shard:06d}.safetensors")
    finally:
        for handle in handles:
            handle.remove()


def main() -> None:
    args = base_parser(__doc__, samples=128, shard_size=64).parse_args()
    work = workload(args)  # builds the demo target once, outside the timings

    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture

    with tempfile.TemporaryDirectory(prefix="end_to_end-") as tmp:
        root = Path(tmp)

        def run_baseline(repeat: int) -> float:
            started = time.perf_counter()
            baseline(work, root / f"baseline{repeat}")
            return time.perf_counter() - started

        def run_runner(repeat: int) -> float:
            recipe = root / f"recipe{repeat}.yaml"
            # The baseline's thread count (--threads) for the runner too (capture.cpu_threads: auto would take every
            # core): the ratio compares the two loops, not two thread counts.
            recipe.write_text(yaml.safe_dump({"capture": {"cpu_threads": args.threads}, "recipe_args": dict(
                target_model_name_or_path=str(work.target_dir), train_data_path="demo:conversations",
                train_split=work.split, cache_output_dir=str(root / f"capture{repeat}"), seq_length=work.seq_length,
                micro_batch_size=work.micro_batch_size, cache_shard_size=work.shard_size, cache_dtype="fp32")}))
            started = time.perf_counter()
            result = run_capture(load_config(recipe), show_progress=False)
            seconds = time.perf_counter() - started
            assert result.num_tokens == work.num_tokens, (result.num_tokens, work.num_tokens)
            return seconds

        baseline(work, root / "warmup")  # first-call allocations, file cache
        seconds = interleaved({"baseline": run_baseline, "run_capture": run_runner}, args.repeats)
        # Same content where it matters: the runner's states equal the baseline's at content positions.
        from safetensors.torch import load_file

        a = load_file(str(root / "baseline0" / "shard-000000.safetensors"))
        b = load_file(str(root / "capture0" / "shard-000000.safetensors"))
        content = (b["input_ids"] != 0)[..., None]
        max_diff = float(((a["target_last_hidden_states"] - b["target_last_hidden_states"]) * content).abs().max())

    ratio = median(seconds["baseline"]) / median(seconds["run_capture"])
    print(json.dumps({
        "benchmark": "end_to_end",
        **work.describe(),
        "baseline": summary(seconds["baseline"], work.num_tokens),
        "run_capture": summary(seconds["run_capture"], work.num_tokens),
        "content_max_abs_diff_shard0_last": max_diff,
        "ratio": round(ratio, 3),
        "goal_ratio": 2.0,
        "goal_met": ratio >= 2.0,
    }, indent=2))


if __name__ == "__main__":
    main()
