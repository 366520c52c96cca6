"""Facts about NeMo AutoModel 0.7.0's DeepSeek-V4.1 and Kimi K3 classes on CPU, for docs/nemo_families_notes.md.

    TORCHDYNAMO_DISABLE=1 PYTHONPATH=$PWD /work/nemo_venv/bin/python tools/nemo_oracle/probe_v41_k3.py

In:  the `nemo` extra (scripts/install_nemo_extra.sh). Out: one ``FACT {json}`` line per measured fact on stdout.
Tiny random models built with NeMo's own classes and the CPU backend; Kimi K3's fla names from ds_capture.target.nemo_fla.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ds_capture.target.nemo_fla import install_cpu_fla  # noqa: E402

torch.set_num_threads(1)


def fact(name: str, **values) -> None:
    print("FACT " + json.dumps({"fact": name, **values}, default=str), flush=True)


def cpu_backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
                         rope="torch", rope_fusion=False, gate_precision="float32")


def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.2) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def capture(model, layer_ids, ids):
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    return HFDSparkTargetModel(model, target_layer_ids=layer_ids).generate_batch(ids, torch.ones_like(ids),
                                                                                 torch.ones_like(ids))


def max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def word_level_tokenizer(size: int = 64):
    """A fast tokenizer of ``size`` distinct words (Engram needs one; its normalised vocabulary sets the hash)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))


def v41_config(dtype: str, engram_layer_ids=()):
    from nemo_automodel.components.models.deepseek_v41.config import (
        DeepseekV41Config,
        DeepseekV41TextConfig,
        DeepseekV41VisionConfig,
    )
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map

    engram = {}
    if engram_layer_ids:
        engram = dict(engram_num_embeddings=[256] * len(engram_layer_ids), engram_max_ngram_size=3,
                      engram_vocab_size=11, engram_n_heads=2, engram_head_dim=4, engram_pad_token_id=2,
                      engram_compressed_vocab_size=_compressed_token_map(word_level_tokenizer())[1])
    text = DeepseekV41TextConfig(
        vocab_size=64, hidden_size=16, moe_intermediate_size=16, num_hidden_layers=6, num_attention_heads=2,
        head_dim=8, qk_rope_head_dim=4, q_lora_rank=8, o_lora_rank=8, o_groups=1, n_routed_experts=4,
        num_experts_per_tok=2, compress_ratios=[0, 0, 2, 2, 1, 1], kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4, 5], index_n_heads=2, index_head_dim=8, index_topk=2,
        candidate_source_layer_id=4, candidate_topk_blocks=2, candidate_block_size=2,
        engram_layer_ids=list(engram_layer_ids), **({"engram_num_embeddings": []} if not engram else engram),
        num_nextn_predict_layers=0, dspark_block_size=0, dspark_noise_token_id=0, dtype=dtype)
    return DeepseekV41Config(vision_config=DeepseekV41VisionConfig(num_hidden_layers=0), text_config=text)


def probe_v41(dtype: str) -> None:
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41StateDictAdapter

    config = v41_config(dtype)
    torch.manual_seed(0)  # initialize_weights draws from the global generator
    model = DeepseekV41ForCausalLM(config, backend=cpu_backend())
    model.initialize_weights(torch.device("cpu"), dtype=getattr(torch, dtype))
    model.eval()
    layers = model.model.layers
    fact("v41.built", dtype=dtype, layers_container=type(layers).__name__, num_layers=len(layers),
         decoder_layer=type(layers["0"]).__name__, experts=type(layers["0"].ffn.experts).__name__,
         moe_block=type(layers["0"].ffn).__name__, inner=type(model.model).__name__)
    ids = torch.randint(1, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(ids)
        fact("v41.forward", logits_shape=tuple(out.logits.shape), logits_dtype=out.logits.dtype)
        mods = model.get_dspark_target_feature_modules([0, 2, 5])
        fact("v41.feature_modules", names=[n for m in mods for n, mm in model.named_modules() if mm is m])
        try:
            model.get_dspark_target_feature_modules([-1])
            fact("v41.rejects_minus_one", rejected=False)
        except ValueError as error:
            fact("v41.rejects_minus_one", rejected=True, error=str(error))
        batch = capture(model, [0, 2, 5], ids)
        fact("v41.dspark_batch", hidden=tuple(batch.target_hidden_states.shape),
             last=tuple(batch.target_last_hidden_states.shape), dtype=batch.target_hidden_states.dtype)
        # Is id 0 the embedding output? Is id i the output of decoder layer i-1 (mean over hc)?
        seen = {}
        hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: seen.__setitem__("embed", o))]
        for index in ("1", "4", "5"):
            hooks.append(layers[index].register_forward_hook(
                lambda m, i, o, index=index: seen.__setitem__(index, o[0] if isinstance(o, tuple) else o)))
        final = model(ids, return_hidden_states=True).hidden_states
        for hook in hooks:
            hook.remove()
        hidden = 16
        feats = batch.target_hidden_states.split(hidden, dim=-1)
        fact("v41.id0_vs_embedding", max_diff=max_diff(feats[0], seen["embed"]))
        fact("v41.id2_vs_layer1_output_mean", layer1_output_shape=tuple(seen["1"].shape),
             max_diff=max_diff(feats[1], seen["1"].mean(dim=2) if seen["1"].dim() == 4 else seen["1"]))
        fact("v41.id5_vs_layer4_output_mean", max_diff=max_diff(feats[2], seen["4"].mean(dim=2)))
        fact("v41.last_vs_return_hidden_states", max_diff=max_diff(batch.target_last_hidden_states, final),
             last_layer_output_shape=tuple(seen["5"].shape))
        # The same 8 tokens computed at width 12 (as a right-padded row) and alone at width 8.
        wide = capture(model, [0, 2, 5], ids)
        narrow = capture(model, [0, 2, 5], ids[:, :8])
        alone = capture(model, [0, 2, 5], ids[1:2])
        fact("v41.batch_row_vs_row_alone_same_width",
             max_diff=max_diff(wide.target_hidden_states[1:2], alone.target_hidden_states),
             last_max_diff=max_diff(wide.target_last_hidden_states[1:2], alone.target_last_hidden_states))
        fact("v41.width_12_vs_8_first_8_tokens",
             max_diff=max_diff(wide.target_hidden_states[:, :8], narrow.target_hidden_states),
             last_max_diff=max_diff(wide.target_last_hidden_states[:, :8], narrow.target_last_hidden_states))
    adapter = DeepseekV41StateDictAdapter(config, model.moe_config, model.backend, dtype=getattr(torch, dtype))
    native = model.state_dict()
    hf = adapter.to_hf(native)
    fact("v41.state_dict", native_keys=len(native), hf_keys=len(hf),
         native_expert_keys=sorted(k for k in native if "experts" in k)[:4],
         hf_expert_keys=sorted(k for k in hf if "experts" in k)[:6],
         hf_sample=sorted(hf)[:12])
    back = adapter.from_hf(hf)
    fact("v41.adapter_roundtrip", same_keys=sorted(back) == sorted(native),
         max_diff=max((max_diff(back[k], native[k]) for k in native if k in back), default=None))


def probe_v41_engram() -> None:
    """Engram at layers 1 and 3: id i is layer i's attn_hc input AFTER its Engram update."""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    config = v41_config("float32", engram_layer_ids=(1, 3))
    torch.manual_seed(0)
    model = DeepseekV41ForCausalLM(config, backend=cpu_backend(), tokenizer=word_level_tokenizer())
    model.initialize_weights(torch.device("cpu"), dtype=torch.float32)
    randomize(model, seed=3, std=0.1)  # Engram tables init to zero-ish; random so the update is visible
    model.eval()
    layers = model.model.layers
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    seen = {}
    def keep(index):
        return lambda module, args, out: seen.__setitem__(index, out[0] if isinstance(out, tuple) else out)

    hooks = [layers[i].register_forward_hook(keep(i)) for i in ("0", "1", "2")]
    with torch.no_grad():
        batch = capture(model, [1, 2, 3], ids)
    for hook in hooks:
        hook.remove()
    feats = batch.target_hidden_states.split(16, dim=-1)
    fact("v41.engram_id1_vs_layer0_output_mean", engram_layer=True, max_diff=max_diff(feats[0], seen["0"].mean(2)))
    fact("v41.engram_id2_vs_layer1_output_mean", engram_layer=False, max_diff=max_diff(feats[1], seen["1"].mean(2)))
    fact("v41.engram_id3_vs_layer2_output_mean", engram_layer=True, max_diff=max_diff(feats[2], seen["2"].mean(2)))
    nonpersistent = sorted(n for n, _ in model.named_buffers() if n not in model.state_dict())
    fact("v41.nonpersistent_buffers", names=nonpersistent)


def probe_meta_build() -> None:
    """Build on meta, to_empty, load the materialised model's state dict: what is left uninitialised?"""
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM

    install_cpu_fla()
    builds = {
        "v41": lambda: DeepseekV41ForCausalLM(v41_config("float32", (1, 3)), backend=cpu_backend(),
                                              tokenizer=word_level_tokenizer()),
        "k3": lambda: KimiK3ForCausalLM(k3_text_config(2), backend=cpu_backend()),
    }
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    for name, build in builds.items():
        torch.manual_seed(0)
        real = build()
        if name == "v41":
            real.initialize_weights(torch.device("cpu"), dtype=torch.float32)
        randomize(real, std=0.1)
        real.eval()
        with torch.device("meta"):
            meta = build()
        meta.to_empty(device="cpu")
        meta.load_state_dict(real.state_dict(), strict=True)
        meta.eval()
        buffers = sorted(n for n, _ in real.named_buffers() if n not in real.state_dict())
        with torch.no_grad():
            ref = real(ids).logits
            try:
                plain = f"logits max diff {max_diff(meta(ids).logits, ref)}"
            except Exception as error:  # garbage non-persistent buffers
                plain = f"{type(error).__name__}: {error}"
            restored = []
            for module_name, module in meta.named_modules():
                # The non-persistent buffers' own restore hooks (Engram's hash tables: init_weights() w/o args).
                if any(n.startswith(f"{module_name}.") and n.count(".") == module_name.count(".") + 1
                       for n in buffers) and module_name:
                    module.init_weights()
                    restored.append(module_name)
            after = max_diff(meta(ids).logits, ref)
        fact(f"{name}.meta_build_load_state_dict", nonpersistent_buffers=buffers, without_restore=plain,
             restored_by_init_weights=restored, logits_max_diff_after_restore=after)


def k3_text_config(attn_res_block_size):
    from nemo_automodel.components.models.kimi_k3.config import KimiK3TextConfig

    return KimiK3TextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
        moe_intermediate_size=32, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
        routed_expert_hidden_size=32, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=16,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, attn_res_block_size=attn_res_block_size,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3],
                            "full_attn_layers": [4], "use_full_rank_gate": True, "gate_lower_bound": -5.0},
        dtype="float32")


def probe_k3(attn_res_block_size) -> None:
    fact("k3.cpu_fla_installed", installed=install_cpu_fla())
    from nemo_automodel.components.models.kimi_k3.model import KimiK3ForCausalLM
    from nemo_automodel.components.models.kimi_k3.state_dict_adapter import KimiK3StateDictAdapter

    config = k3_text_config(attn_res_block_size)
    model = KimiK3ForCausalLM(config, backend=cpu_backend())
    randomize(model, std=0.1)
    model.eval()
    layers = model.model.layers
    fact("k3.built", attn_res_block_size=attn_res_block_size, layers_container=type(layers).__name__,
         model_type=config.model_type, kinds=[type(l.self_attn).__name__ for l in layers.values()],
         moe=[type(getattr(l, "mlp", None)).__name__ for l in layers.values()],
         has_feature_provider=hasattr(model, "get_dspark_target_feature_modules"))
    ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
        fact("k3.forward", logits_shape=tuple(logits.shape), dtype=logits.dtype)
        seen = {}
        hooks = [layers[i].register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(i, o)) for i in layers]
        hooks.append(model.model.norm.register_forward_hook(lambda m, a, o: seen.__setitem__("norm", o)))
        batch = capture(model, [0, 1, 3], ids)
        for hook in hooks:
            hook.remove()
        feats = batch.target_hidden_states.split(64, dim=-1)
        fact("k3.layer_outputs", kinds={i: (type(o).__name__, [tuple(t.shape) for t in o] if isinstance(o, tuple)
                                           else tuple(o.shape)) for i, o in seen.items() if i != "norm"})
        out0 = seen["0"][0] if isinstance(seen["0"], tuple) else seen["0"]
        fact("k3.id0_is_layer0_outputs0", max_diff=max_diff(feats[0], out0))
        fact("k3.last_id_is_final_norm", max_diff=max_diff(feats[2], batch.target_last_hidden_states))
        # Right-padded batch vs rows alone, model level (no mask, as ds_capture runs it).
        row = model(ids[1:2, :6]).logits
        fact("k3.padded_vs_row_alone_logits", max_diff=max_diff(logits[1:2, :6], row),
             bitwise=bool(torch.equal(logits[1:2, :6], row)))
    adapter = KimiK3StateDictAdapter(config, model.model.moe_config, model.backend, dtype=torch.float32)
    native = model.state_dict()
    hf = adapter.to_hf(native)
    fact("k3.state_dict", native_keys=len(native), hf_keys=len(hf),
         native_kda=sorted(k for k in native if "layers.0.self_attn" in k),
         hf_kda=sorted(k for k in hf if "layers.0.self_attn" in k),
         hf_experts=sorted(k for k in hf if "experts" in k)[:6],
         hf_kda_shapes={k.rsplit(".self_attn.", 1)[1]: tuple(v.shape) for k, v in hf.items()
                        if ".layers.0.self_attn." in k})
    back = adapter.from_hf(hf)
    fact("k3.adapter_roundtrip", same_keys=sorted(back) == sorted(native),
         missing=sorted(set(native) - set(back))[:8], extra=sorted(set(back) - set(native))[:8],
         max_diff=max((max_diff(back[k], native[k]) for k in native if k in back), default=None))


def main() -> None:
    for step, run in (("v41 fp32", lambda: probe_v41("float32")), ("v41 bf16", lambda: probe_v41("bfloat16")),
                      ("v41 engram", probe_v41_engram), ("k3 attn_res", lambda: probe_k3(2)),
                      ("k3 plain", lambda: probe_k3(None)), ("meta", probe_meta_build)):
        try:
            run()
        except Exception as error:  # a probe records what breaks, and goes on
            import traceback

            fact(f"{step}.FAILED", error=f"{type(error).__name__}: {error}",
                 where=traceback.format_exc().strip().splitlines()[-3:])


if __name__ == "__main__":
    main()
