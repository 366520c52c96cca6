"""A tiny DeepSeek-V4.1 checkpoint written as DeepSeek released it, from a random model built by NeMo's own class.

    from tests.nemo_v41_release import write_tiny_v41_release
    path = write_tiny_v41_release(tmp_path / "v41", seed=0)

``write_tiny_v41_release(out_dir, *, seed, quantized=True, engram=True, num_layers=6, scale=1) -> out_dir``
(``scale``: every width times ``scale``, below at 1):

- the model: NeMo AutoModel 0.7.0's ``DeepseekV41ForCausalLM`` on CPU, bf16 (the release dtype), every floating
  tensor random (std 0.1): hidden 32, 4 routed experts of intermediate 32 (2 per token), mHC with 4 streams,
  CSA2 compressed / indexed layers (compress ratios ``[0, 0, 2, 2, 1, 1]``), Engram at layers 1 and 3 (tables
  [256, 32]), no vision tower; q / o LoRA ranks 48 / 40, so ``wq_a`` [48, 32], ``wq_b`` [32, 48], ``wo_a`` / ``wo_b``
  end in partial 32 x 32 blocks;
- ``config.json``: NeMo's ``DeepseekV41Config`` as saved (``model_type`` ``deepseek_v41``, nested
  ``text_config`` / ``vision_config``) plus the release's ``quantization_config`` (:data:`QUANTIZATION_CONFIG`);
- the tensors under the release names (NeMo's ``to_hf``), in two shard files and
  ``model.safetensors.index.json``, quantized as the release is (NeMo's adapter docstring and
  ``../shared/CHECKPOINT_FORMATS.md``): routed experts packed FP4 e2m1 (two per int8, low nibble = even column)
  with e8m0 ``[out, in / 32]`` scales; Engram tables FP8 e4m3 with row-wise e8m0 ``[rows, cols / 32]`` scales;
  the other big linears (``attn.{wq_a, wq_b, wkv, wo_a, wo_b}``, ``attn.indexer.wq_b``, shared experts,
  ``engram.wkv``) FP8 e4m3 with e8m0 scales over 32 x 32 blocks (partial at the edges); everything else as the
  bf16 model holds it (bf16, or fp32 for mHC, router bias, sinks, compressors, the head). The scales of even
  layers sit in the other shard file than their weights;
- extras the loader must skip: a DSpark draft ``mtp.0.*`` (layer L-1's tensors plus ``main_proj``, quantized)
  and ``layers.{L}.*`` (a copy of layer L-1, past ``num_hidden_layers``);
- the tokenizer Engram hashes with (``tokenizer.json``, ``tokenizer_config.json``; a 64-word level tokenizer whose
  normalised vocabulary is ``engram_compressed_vocab_size``), found by ``config.build_tokenizer()`` through
  ``_name_or_path``.

Scales are powers of two and the codes are what the scaled values round to, so the release dequantizes exactly
to ``code * 2^e`` (representable in fp32 and bf16) and NeMo's ``from_hf`` and ds_capture's reader must agree bitwise.
``quantized=False`` writes the same model unquantized (bf16, no ``quantization_config``).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
"""The release's ``quantization_config``: NeMo's adapter fixes the 32 x 32 blocks and e8m0 scales; the field names
follow DeepSeek-V3.1 / V4 (``expert_dtype`` inside it for V4.1, CHECKPOINT_FORMATS.md). NeMo reads none of them."""

BLOCK = 32
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
NUM_WORDS = 64
FILES = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")

# What NeMo's adapter quantizes (its convert_single_tensor_to_hf), by scheme.
_FP4 = re.compile(r"(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_ROWWISE = re.compile(r"layers\.\d+\.engram\.embed\.weight")
_FP8 = re.compile(r"(?:layers|mtp)\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                  r"|engram\.wkv|main_proj)\.weight")


def cpu_backend():
    """NeMo's backend for CPU builds (docs/nemo_families_notes.md)."""
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
                         rope="torch", rope_fusion=False, gate_precision="float32")


def word_level_tokenizer():
    """A fast tokenizer of ``NUM_WORDS`` distinct words (Engram needs a fast one; its normalised vocabulary sets
    the hash)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(NUM_WORDS)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="w0")))


def tiny_v41_config(*, engram: bool, num_layers: int, compressed_vocab_size: int, vocab_size: int = NUM_WORDS,
                    scale: int = 1):
    """NeMo's ``DeepseekV41Config`` of the tiny release (text only, bf16). ``scale`` multiplies every width (hidden,
    expert intermediate, q / o LoRA ranks, Engram's head size and table rows), so the parameter count grows about
    ``scale**2`` in the same layout; head counts, attention / indexer head sizes, layers and experts stay."""
    from nemo_automodel.components.models.deepseek_v41.config import (
        DeepseekV41Config,
        DeepseekV41TextConfig,
        DeepseekV41VisionConfig,
    )

    engram_layer_ids = [i for i in (1, 3) if i < num_layers] if engram else []
    text = DeepseekV41TextConfig(
        vocab_size=vocab_size, hidden_size=32 * scale, moe_intermediate_size=32 * scale, num_hidden_layers=num_layers,
        num_attention_heads=2, head_dim=16, qk_rope_head_dim=8, q_lora_rank=48 * scale, o_lora_rank=40 * scale,
        o_groups=1, n_routed_experts=4, num_experts_per_tok=2, compress_ratios=[0, 0, 2, 2, 1, 1][:num_layers],
        kv_source_layer_ids=[i for i in (2, 4) if i < num_layers],
        index_source_layer_ids=[i for i in (2, 4, 5) if i < num_layers], index_n_heads=2, index_head_dim=16,
        index_topk=2, candidate_source_layer_id=4 if num_layers > 4 else -1, candidate_topk_blocks=2,
        candidate_block_size=2, engram_layer_ids=engram_layer_ids,
        engram_num_embeddings=[256 * scale] * len(engram_layer_ids), engram_max_ngram_size=3, engram_vocab_size=11,
        engram_n_heads=2, engram_head_dim=32 * scale, engram_pad_token_id=2,
        engram_compressed_vocab_size=compressed_vocab_size, num_nextn_predict_layers=1, dspark_block_size=0,
        dspark_noise_token_id=0, dtype="bfloat16")
    return DeepseekV41Config(vision_config=DeepseekV41VisionConfig(num_hidden_layers=0), text_config=text,
                             architectures=["DeepseekV41ForCausalLM"])


def write_tiny_v41_release(out_dir: Path | str, *, seed: int, quantized: bool = True, engram: bool = True,
                           num_layers: int = 6, tokenizer=None, scale: int = 1) -> Path:
    """Write the tiny release (module docstring) into ``out_dir``; returns ``out_dir``. ``num_layers`` in [1, 6]
    cuts the 6-layer schedule (compression, KV / index sources, Engram at 1 and 3) to its first layers.
    ``tokenizer``: saved instead of the word-level one (the vocabulary padded to a multiple of 64), e.g. the
    demo's ChatML tokenizer so that the release can capture chat data. ``scale``: every width times ``scale``
    (:func:`tiny_v41_config`), e.g. for a model whose parameter bytes outweigh a process's fixed build cost
    (benchmarks/nemo_layout_memory.py)."""
    assert 1 <= num_layers <= 6, num_layers
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41StateDictAdapter
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (tokenizer or word_level_tokenizer()).save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = tiny_v41_config(engram=engram, num_layers=num_layers,
                             compressed_vocab_size=_compressed_token_map(tokenizer)[1],
                             vocab_size=max(NUM_WORDS, 64 * -(-len(tokenizer) // 64)), scale=scale)
    torch.manual_seed(seed)  # initialize_weights draws from the global generator
    model = DeepseekV41ForCausalLM(config, backend=cpu_backend(), tokenizer=tokenizer)
    model.initialize_weights(torch.device("cpu"), dtype=torch.bfloat16)
    randomize(model, seed=seed)
    adapter = DeepseekV41StateDictAdapter(config, model.moe_config, model.backend, dtype=torch.bfloat16)
    release = {key: value.detach().clone().contiguous() for key, value in adapter.to_hf(model.state_dict()).items()}
    release.update(_extras(release, num_layers, seed))

    tensors: dict[str, torch.Tensor] = {}
    for key, value in release.items():
        tensors.update(quantize_release_tensor(key, value) if quantized else {key: value})
    shards: tuple[dict, dict] = ({}, {})
    for key, value in tensors.items():
        shards[_shard_of(key)][key] = value
    for name, shard in zip(FILES, shards):
        save_file(shard, out / name, metadata={"format": "pt"})
    weight_map = {key: FILES[_shard_of(key)] for key in sorted(tensors)}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))

    config.save_pretrained(out)
    if quantized:
        raw = json.loads((out / "config.json").read_text())
        raw["quantization_config"] = dict(QUANTIZATION_CONFIG)
        (out / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True))
    return out


def randomize(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Every floating parameter random (NeMo's init leaves Engram tables and mHC mixers near zero / constant)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _extras(release: dict[str, torch.Tensor], num_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """A DSpark draft ``mtp.0.*`` and a layer past ``num_hidden_layers``: copies of the last layer's tensors."""
    last = f"layers.{num_layers - 1}."
    extras = {}
    for key, value in release.items():
        if key.startswith(last):
            rest = key[len(last):]
            extras[f"mtp.0.{rest}"] = value.clone()
            extras[f"layers.{num_layers}.{rest}"] = value.clone()
    hidden = release["embed.weight"].shape[1]
    generator = torch.Generator().manual_seed(seed + 1)
    extras["mtp.0.main_proj.weight"] = (torch.randn(hidden, 2 * hidden, generator=generator) * 0.1).to(torch.bfloat16)
    return extras


def _shard_of(key: str) -> int:
    """Layers alternate between the two files; the scales of even layers sit in the other file."""
    layer = re.match(r"(?:layers|mtp)\.(\d+)\.", key)
    if layer is None:
        return 0
    number = int(layer[1])
    return (number + (key.endswith(".scale") and number % 2 == 0)) % 2


# ------------------------------------------------------------------------------------------------ quantizers


def quantize_release_tensor(key: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """One release tensor as stored: ``{key: codes, key.scale: e8m0}`` for a quantized one, else ``{key: value}``."""
    base = key.removesuffix(".weight")
    if _FP4.fullmatch(key):
        codes, scale = quantize_fp4(value.float())
    elif _ROWWISE.fullmatch(key):
        codes, scale = quantize_fp8(value.float(), row_block=1)
    elif _FP8.fullmatch(key):
        codes, scale = quantize_fp8(value.float(), row_block=BLOCK)
    else:
        return {key: value}
    return {key: codes, f"{base}.scale": scale}


def _power_of_two_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest power of two ``s`` with ``amax / s <= top`` (an e8m0 value)."""
    return torch.pow(2.0, torch.ceil(torch.log2(amax.clamp(min=2.0 ** -60) / top)))


def quantize_fp8(w: torch.Tensor, *, row_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 codes ``[rows, cols]`` and e8m0 scales over ``row_block x 32`` blocks (partial at the edges):
    ``[ceil(rows / row_block), ceil(cols / 32)]``."""
    rows, cols = w.shape
    grid = (math.ceil(rows / row_block), math.ceil(cols / BLOCK))
    padded = torch.zeros(grid[0] * row_block, grid[1] * BLOCK)
    padded[:rows, :cols] = w
    amax = padded.reshape(grid[0], row_block, grid[1], BLOCK).abs().amax(dim=(1, 3))
    scale = _power_of_two_scale(amax, 448.0)
    expanded = scale.repeat_interleave(row_block, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed e2m1 codes ``[rows, cols / 2]`` int8 (even column = low nibble) and e8m0 ``[rows, cols / 32]``."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // BLOCK, BLOCK)
    scale = _power_of_two_scale(groups.abs().amax(-1), 6.0)
    values = (groups / scale[..., None]).reshape(rows, cols)
    codes = (values[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(torch.int8), scale.to(torch.float8_e8m0fnu)


def nemo_reference(path: Path, dtype: torch.dtype):
    """NeMo's own load of the release, as its DSpark target builds it: the class on CPU in ``dtype`` (the config's
    ``name_or_path`` finds the Engram tokenizer), ``from_hf`` over the whole release dict, ``load_state_dict``."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41StateDictAdapter
    from safetensors.torch import load_file

    config = DeepseekV41Config.from_pretrained(path, name_or_path=str(path))
    config.text_config.dtype = dtype
    model = DeepseekV41ForCausalLM(config, backend=cpu_backend())
    stored = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        stored.update(load_file(file))
    adapter = DeepseekV41StateDictAdapter(config, model.moe_config, model.backend, dtype=dtype)
    model.load_state_dict(adapter.from_hf(stored), strict=True)
    return model.eval()
