"""DeepSeek-V4.1's release read one tensor at a time equals NeMo AutoModel 0.7.0's whole-dict ``from_hf``, bitwise.

The checkpoint is ``tests.nemo_v41_release.write_tiny_v41_release``'s (FP4 experts, FP8 32 x 32 blocks, row-wise
FP8 Engram tables, e8m0 scales, scales in the other shard file, an ``mtp.0`` draft and a layer past
``num_hidden_layers``). Our side: every logical key through ``v41_placement`` and ``read_release_tensor`` (
``quant.read_dequantized``, one ``safe_open`` per tensor), experts placed as slices of the stacked tensors. NeMo's
side: ``DeepseekV41StateDictAdapter.from_hf`` over the whole dict. Same keys, dtypes and values (``torch.equal``) in
fp32 and bf16; a model built on meta and filled our way gives NeMo's logits exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo_automodel")

from ds_capture.errors import CaptureError  # noqa: E402
from ds_capture.target import quant  # noqa: E402
from ds_capture.target.nemo_release import place, read_release_tensor, transform  # noqa: E402
from ds_capture.target.nemo_v41 import v41_placement, v41_release_info  # noqa: E402
from tests.nemo_v41_release import cpu_backend, write_tiny_v41_release  # noqa: E402

NUM_LAYERS, NUM_EXPERTS = 6, 4


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_v41_release(tmp_path_factory.mktemp("v41") / "release", seed=0, num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def unquantized_release(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_v41_release(tmp_path_factory.mktemp("v41") / "bf16", seed=1, quantized=False,
                                  num_layers=NUM_LAYERS)


def nemo_config(path: Path, dtype: torch.dtype):
    """NeMo's config of the release, as its DSpark target loads it (``name_or_path`` finds the tokenizer)."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    config = DeepseekV41Config.from_pretrained(path, name_or_path=str(path))
    config.text_config.dtype = dtype
    return config


def nemo_model(config, device: str):
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    with torch.device(device):
        return DeepseekV41ForCausalLM(config, backend=cpu_backend())


def nemo_from_hf(path: Path, config, model) -> dict[str, torch.Tensor]:
    """NeMo's conversion of the whole release state dict."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import DeepseekV41StateDictAdapter
    from safetensors.torch import load_file

    hf = {}
    for file in sorted(path.glob("*.safetensors")):
        hf.update(load_file(file))
    adapter = DeepseekV41StateDictAdapter(config, model.moe_config, model.backend, dtype=config.text_config.dtype)
    return adapter.from_hf(hf)


def release_index(path: Path) -> tuple[dict[str, Path], dict[str, Path], dict]:
    """(checkpoint key -> file, logical key -> file, headers)."""
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = {key: path / name for key, name in weight_map.items()}
    headers = quant.read_headers(set(files.values()))
    logical, _parts = quant.logical_keys(files, headers)
    return files, logical, headers


def read_native(path: Path, config, dtype: torch.dtype, experts: range = range(NUM_EXPERTS)
                ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The native state dict built one logical tensor at a time, and the logical keys read (in order)."""
    files, logical, headers = release_index(path)
    info = v41_release_info(json.loads((path / "config.json").read_text()))
    placements = {key: v41_placement(key, config) for key in sorted(logical)}
    kept = [key for key, p in placements.items() if p is not None and (p.expert is None or p.expert in experts)]
    planned = quant.plan_quantized(files, headers, quant.load_quant_config(path), kept)
    size, hidden = info.moe_intermediate_size, info.hidden_size
    stacked = {"gate_and_up_projs": (len(experts), hidden, 2 * size), "down_projs": (len(experts), size, hidden)}
    native: dict[str, torch.Tensor] = {}
    filled: dict[str, int] = {}
    for key in kept:
        placement = placements[key]
        tensor, _num_bytes = read_release_tensor(key, logical, planned, dtype)
        if placement.expert is None:
            assert placement.native not in native, placement
            native[placement.native] = transform(placement, tensor)
            continue
        shape = stacked[placement.native.rsplit(".", 1)[1]]
        destination = native.setdefault(placement.native, torch.full(shape, float("nan"), dtype=dtype))
        place(destination, placement, tensor, first_expert=experts.start)
        filled[placement.native] = filled.get(placement.native, 0) + 1
    for name, count in filled.items():  # w1 + w3 per expert into gate_and_up, w2 into down
        assert count == len(experts) * (2 if name.endswith("gate_and_up_projs") else 1), (name, count)
    return native, kept


@pytest.mark.parametrize("dtype, quantized", [(torch.float32, True), (torch.bfloat16, True), (torch.bfloat16, False)],
                         ids=["fp32", "bf16", "bf16-unquantized-release"])
def test_reading_one_tensor_at_a_time_equals_nemo_from_hf_bitwise(request, dtype, quantized):
    release = request.getfixturevalue("release" if quantized else "unquantized_release")
    config = nemo_config(release, dtype)
    theirs = nemo_from_hf(release, config, nemo_model(config, "meta"))
    ours, _read = read_native(release, config, dtype)
    assert sorted(ours) == sorted(theirs)
    assert len(ours) == 170  # 6 layers (2 stacked expert tensors each), Engram at 1 and 3: NeMo's native keys
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    # What is what: fp32 stays fp32 (mHC, router bias, sinks, compressors, head); dequantized and stacked experts
    # take the model dtype; the rest as stored (bf16)
    assert ours["model.layers.0.attn_hc.fn"].dtype == torch.float32
    assert ours["model.layers.1.engram.embed.weight"].dtype == dtype
    assert ours["model.layers.0.ffn.experts.gate_and_up_projs"].dtype == dtype
    assert ours["model.layers.0.attn_norm.weight"].dtype == torch.bfloat16


def test_the_keys_never_read_are_exactly_the_draft_and_the_layer_past_num_hidden_layers(release):
    config = nemo_config(release, torch.bfloat16)
    files, logical, _headers = release_index(release)
    skipped = {key for key in logical if v41_placement(key, config) is None}
    assert skipped == {key for key in logical if key.startswith(("mtp.", f"layers.{NUM_LAYERS}."))}
    last_layer = [key for key in logical if key.startswith(f"layers.{NUM_LAYERS - 1}.")]
    assert len(skipped) == 2 * len(last_layer) + 1  # copies of the last layer, and the draft's main_proj
    scales = set(files) - set(logical)
    assert scales == {key for key in files if key.endswith(".scale")} and len(scales) > 0


def test_an_expert_parallel_rank_reads_only_its_experts(release):
    """Experts [2, 4) of 4, as EP rank 1 of 2 owns them: no other expert's tensor is opened, and the stacked tensors
    equal NeMo's rows 2 and 3."""
    config = nemo_config(release, torch.bfloat16)
    theirs = nemo_from_hf(release, config, nemo_model(config, "meta"))
    ours, read = read_native(release, config, torch.bfloat16, experts=range(2, 4))
    experts_read = {int(m[1]) for key in read if (m := re.search(r"\.experts\.(\d+)\.", key))}
    assert experts_read == {2, 3}
    assert len([key for key in read if ".experts." in key]) == NUM_LAYERS * 2 * 3
    for key in theirs:
        expected = theirs[key][2:4] if ".ffn.experts." in key else theirs[key]
        assert torch.equal(ours[key], expected), key


def test_placements_rename_as_nemo_does_and_refuse_what_is_not_v41(release):
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import _native_key

    config = nemo_config(release, torch.bfloat16)
    _files, logical, _headers = release_index(release)
    for key in logical:
        placement = v41_placement(key, config)
        if placement is not None and placement.expert is None:
            assert placement.native == _native_key(key), key
    assert v41_placement("layers.0.ffn.gate.bias_vl", config).native == "model.layers.0.ffn.gate.bias_vl"
    up = v41_placement("layers.2.ffn.experts.3.w3.weight", config)
    assert (up.native, up.expert, up.index, up.transpose) == (
        "model.layers.2.ffn.experts.gate_and_up_projs", 3, (slice(None), slice(32, 64)), True)
    assert v41_placement("vision.blocks.0.attn.qkv.weight", config) is None  # text-only build
    assert v41_placement("image_newline", config) is None
    with pytest.raises(CaptureError) as caught:
        v41_placement("layers.0.attn.wq.weight", config)
    assert str(caught.value) == (
        "layers.0.attn.wq.weight: not a tensor of DeepSeek-V4.1's release (neither a tensor of NeMo AutoModel "
        "0.7.0's DeepseekV41ForCausalLM nor mtp.*, vision.* / aligner.* / image_*, or a layer >= num_hidden_layers "
        "6). The checkpoint is not DeepSeek-V4.1's release layout: check config.json's model_type and the "
        "checkpoint's model.safetensors.index.json.")
    with pytest.raises(CaptureError) as caught:
        v41_placement("layers.0.ffn.experts.4.w1.weight", config)
    assert str(caught.value) == (
        "layers.0.ffn.experts.4.w1.weight: expert 4, but config.json's text_config.n_routed_experts is 4. The "
        "checkpoint and its config.json disagree: use the release's own config.json.")


def test_release_info_reads_the_nested_text_config(release):
    info = v41_release_info(json.loads((release / "config.json").read_text()))
    assert (info.num_hidden_layers, info.num_routed_experts, info.moe_intermediate_size, info.hidden_size) == (
        6, 4, 32, 32)
    with pytest.raises(CaptureError) as caught:
        v41_release_info({"text_config": {"num_hidden_layers": 2, "moe_intermediate_size": 8, "hidden_size": 8}})
    assert str(caught.value) == (
        "config.json: text_config.n_routed_experts is missing or not an integer (DeepSeek-V4.1 needs "
        "num_hidden_layers, n_routed_experts, moe_intermediate_size, hidden_size). Use the release's own config.json.")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_meta_built_model_filled_one_tensor_at_a_time_gives_nemos_logits(release, dtype):
    """NeMo's own path (from_hf + load_state_dict into a CPU-built model) against ours (meta, to_empty, place
    every tensor, then the Engram hash buffers, which are non-persistent)."""
    config = nemo_config(release, dtype)
    reference = nemo_model(config, "cpu")
    reference.load_state_dict(nemo_from_hf(release, config, reference), strict=True)
    model = nemo_model(config, "meta").to_empty(device="cpu").eval()
    files, logical, headers = release_index(release)
    destinations = model.state_dict()
    placements = {key: v41_placement(key, config) for key in logical}
    kept = [key for key, placement in placements.items() if placement is not None]
    planned = quant.plan_quantized(files, headers, quant.load_quant_config(release), kept)
    assert {placements[key].native for key in kept} == set(destinations)
    with torch.no_grad():
        for key in kept:
            place(destinations[placements[key].native], placements[key],
                  read_release_tensor(key, logical, planned, dtype)[0])
    model.model.engram_hash.init_weights()
    ids = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference.eval()(ids).logits
    assert torch.equal(ours, theirs)
    assert ours.abs().max() > 0
