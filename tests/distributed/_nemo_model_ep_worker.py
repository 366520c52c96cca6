"""Run on every rank by tests/distributed/test_nemo_model_ep.py: whole tiny NeMo V4.1 / K3 models, EP=2 vs unsplit.

In:  torchrun with 2 gloo ranks, nemo_automodel 0.7.0 installed; an output directory. Out: ``rank{R}.json`` there,
     a list with one entry per case: whether the split model's logits and DSpark features (NeMo's own HFDSparkTargetModel) equal this rank's
     single-process forward bit for bit, and the max diffs.

The models are built BEFORE the process group exists: NeMo's V4.1 constructor shards Engram tables over WORLD
once a group exists (issue 20). Same weights on every rank (seeded), different rows per rank.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools", "nemo_oracle"))

import probe_v41_k3 as tiny  # noqa: E402  (the tiny configs of docs/nemo_families_notes.md)

from ds_capture.parallel.dist import discover_env, distributed_session  # noqa: E402
from ds_capture.parallel.grouped_experts import ExpertParallelGroupedExperts, apply_grouped_experts_parallel  # noqa: E402
from ds_capture.target.nemo_fla import install_cpu_fla  # noqa: E402

CASES = {
    # name: (builder, DSpark layer ids, vocab size)
    "v41_engram": ("v41", [1, 2, 3], 64),
    "k3_attn_res": ("k3", [0, 1, 3], 128),
}


def build(kind: str, dtype: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "v41":
        from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

        model = DeepseekV41ForCausalLM(tiny.v41_config(dtype, engram_layer_ids=(1, 3)), backend=tiny.cpu_backend(),
                                       tokenizer=tiny.word_level_tokenizer())
        model.initialize_weights(torch.device("cpu"), dtype=getattr(torch, dtype))
        tiny.randomize(model, seed=3, std=0.1)
    else:
        install_cpu_fla()
        from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM

        config = tiny.k3_text_config(2)
        config.torch_dtype = dtype
        model = KimiK3ForCausalLM(config, backend=tiny.cpu_backend())
        tiny.randomize(model, std=0.1)
        if dtype != "float32":
            from nemo_automodel.components.models.common.utils import cast_model_to_dtype

            cast_model_to_dtype(model, getattr(torch, dtype))  # keeps NeMo's fp32 modules (KDA holders) in fp32
    return model.eval()


def main() -> None:
    torch.set_num_threads(1)
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    out_dir = sys.argv[1]
    env = discover_env()
    results = []
    models = {(name, dtype): build(CASES[name][0], dtype) for name in CASES for dtype in ("float32", "bfloat16")}
    with distributed_session(env, backend="gloo", timeout_minutes=3):
        for (name, dtype), model in models.items():
            _, layer_ids, vocab = CASES[name]
            rows = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(10 + env.rank))
            ones = torch.ones_like(rows)
            with torch.no_grad():
                reference = model(rows).logits
                ref_batch = HFDSparkTargetModel(model, layer_ids).generate_batch(rows, ones, ones)
                split = apply_grouped_experts_parallel(copy.deepcopy(model), ep_group=None,
                                                       ep_size=env.world_size, ep_rank=env.rank)
                local_experts = sorted({m.gate_and_up_projs.shape[0] for m in split.modules()
                                        if isinstance(m, ExpertParallelGroupedExperts)})
                fp32_kda = sorted({str(p.dtype) for n, p in split.named_parameters() if "_fp32_params" in n})
                logits = split(rows).logits
                batch = HFDSparkTargetModel(split, layer_ids).generate_batch(rows, ones, ones)
            equal = (torch.equal(logits, reference)
                     and torch.equal(batch.target_hidden_states, ref_batch.target_hidden_states)
                     and torch.equal(batch.target_last_hidden_states, ref_batch.target_last_hidden_states))
            results.append({
                "case": f"{name}-{dtype}", "rank": env.rank, "equal": bool(equal), "local_experts": local_experts,
                "fp32_holder_dtypes": fp32_kda, "logits_dtype": str(logits.dtype),
                "logits_max_diff": (logits.float() - reference.float()).abs().max().item(),
                "features_max_diff": (batch.target_hidden_states.float()
                                      - ref_batch.target_hidden_states.float()).abs().max().item()})
    with open(os.path.join(out_dir, f"rank{env.rank}.json"), "w") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main()
