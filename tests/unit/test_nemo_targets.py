"""DeepSeek-V4.1 and Kimi K3 (NeMo AutoModel 0.7.0's own classes) captured single-process equal what NeMo's DSpark
target wrapper captures, and NeMo's reader and trainer checks accept the cache.

Each family: a tiny release-layout checkpoint (tests/nemo_v41_release.py: V4.1's FP8 + FP4 tensors as released,
Engram, mHC, compressed attention; tests/nemo_k3_release.py: K3's vision-language wrapper, MXFP4 experts, KDA
with attention residuals, MLA), the demo's chat data, fp32. ``ds-capture run`` (one process) against
``HFDSparkTargetModel.generate_batch`` over the same rows, on the model NeMo loads itself (``from_hf`` over the whole
release, ``load_state_dict``), computed at ``seq_length`` with the real attention mask as NeMo's precompute does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo_automodel")

from ds_capture.demo import demo_tokenizer  # noqa: E402
from ds_capture.recipe.config import parse_config  # noqa: E402
from ds_capture.runner import run_capture  # noqa: E402
from tests import nemo_k3_release, nemo_v41_release  # noqa: E402

SEQ_LENGTH, NUM_ROWS = 48, 8
# (writer, layer ids, the tolerance of content positions vs NeMo: max |a - b| / max(1, max |b|)).
# V4.1: bitwise (its forward without the padding mask, at NeMo's width, is NeMo's). K3: NeMo's wrapper passes the
# padding mask, so its KDA layers unpad the rows into one cu_seqlens sequence; ours computes the rows padded, and
# NeMo's small Linears (e.g. b_proj, 2 output columns) round differently with more GEMM rows (6e-8 in the logits,
# docs/nemo_families_notes.md).
CASES = {
    "deepseek_v41": (nemo_v41_release, [0, 2, 5], 0.0),
    "kimi_k3": (nemo_k3_release, [-1, 1, 3], 1e-6),
}


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nemo_releases")
    writers = {"deepseek_v41": nemo_v41_release.write_tiny_v41_release,
               "kimi_k3": nemo_k3_release.write_tiny_k3_release}
    return {name: writer(root / name, seed=0, tokenizer=demo_tokenizer()) for name, writer in writers.items()}


@pytest.fixture(scope="module")
def caches(releases, tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """One single-process cache per family (its directory and its tensors), shared by the tests."""
    root = tmp_path_factory.mktemp("nemo_caches")
    return {name: (root / name, capture(releases[name], root / name, CASES[name][1])) for name in CASES}


def capture(release: Path, out: Path, layer_ids: list[int], **capture_options) -> dict:
    cfg = parse_config({
        "recipe_args": dict(target_model_name_or_path=str(release), train_data_path="demo:conversations",
                            train_split=f"train[:{NUM_ROWS}]", cache_output_dir=str(out), seq_length=SEQ_LENGTH,
                            micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32", target_layer_ids=layer_ids),
        "capture": {"compute_dtype": "fp32", **capture_options}}, source=str(out) + ".yaml", base_dir=out.parent)
    summary = run_capture(cfg, show_progress=False)
    assert summary.shards_written == 2
    return read_cache(out)


def read_cache(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    shards = [load_file(path) for path in sorted(out.glob("shard-*.safetensors"))]
    return {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}


def nemo_capture(release: Path, cache: dict, layer_ids: list[int], lengths: torch.Tensor) -> dict:
    """NeMo's DSpark wrapper over the cache's rows: at seq_length, with the real attention mask (its precompute)."""
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    module = CASES[json.loads((release / "config.json").read_text())["model_type"]][0]
    model = module.nemo_reference(release, torch.float32)
    ids = cache["input_ids"]
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    with torch.no_grad():
        batch = HFDSparkTargetModel(model, target_layer_ids=layer_ids).generate_batch(ids, mask, cache["loss_mask"])
    return {"target_hidden_states": batch.target_hidden_states,
            "target_last_hidden_states": batch.target_last_hidden_states}


def content_lengths(release: Path) -> torch.Tensor:
    """Each row's token count, from ds_capture's tokenization of the same rows (NeMo-exact:
    tests/unit/test_data_conformance.py), independent of what the cache holds."""
    from transformers import AutoTokenizer

    from ds_capture.data.reading import open_dataset
    from ds_capture.data.tokenization import resolve_chat_template, tokenize_conversations
    from ds_capture.demo import demo_data_path

    tokenizer = AutoTokenizer.from_pretrained(release)
    rows = open_dataset(str(demo_data_path()), split=f"train[:{NUM_ROWS}]", shuffle_seed=42)
    tokenized = tokenize_conversations(rows.conversations(0, NUM_ROWS), tokenizer,
                                       chat_template=resolve_chat_template(tokenizer, None), seq_length=SEQ_LENGTH,
                                       mask_reasoning_content=False, mask_generation_prompt=False)
    return tokenized.num_tokens


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_single_process_cache_equals_nemos_dspark_wrapper(model_type, releases, caches):
    module, layer_ids, tolerance = CASES[model_type]
    release = releases[model_type]
    _, ours = caches[model_type]
    lengths = content_lengths(release)
    assert int(lengths.min()) > 0 and int(lengths.max()) <= SEQ_LENGTH
    theirs = nemo_capture(release, ours, layer_ids, lengths)
    for key, expected in theirs.items():
        got = ours[key]
        assert got.shape == expected.shape, key
        content = torch.arange(SEQ_LENGTH)[None, :] < lengths[:, None]
        diff = float((got - expected.float())[content].abs().max())
        scale = max(1.0, float(expected.abs().max()))
        print(f"{model_type} {key}: max |ours - NeMo| = {diff:.3g} (max |NeMo| {scale:.3g})")
        assert diff <= tolerance * scale, (key, diff)
        assert torch.count_nonzero(got[~content]) == 0, key  # zeros at padding: our contract


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_nemos_reader_and_trainer_checks_accept_the_cache(model_type, releases, caches):
    """NeMo's ``read_manifest`` / ``CachedDSparkDataset`` read every row as written, and its trainer's own cache
    checks (``_validate_cached_dspark_manifest`` against NeMo's config of the target, the supervision options)
    accept the cache."""
    from nemo_automodel.components.datasets.llm.dspark_cache import CachedDSparkDataset, read_manifest
    from nemo_automodel.components.datasets.llm.offline_cache import ensure_supervision_options_match
    from nemo_automodel.recipes.llm.train_dspark import _validate_cached_dspark_manifest

    from ds_capture.target.families import FAMILIES
    from ds_capture.target.nemo_models import read_nemo_config

    module, layer_ids, _ = CASES[model_type]
    release, (out, ours) = releases[model_type], caches[model_type]
    manifest = read_manifest(str(out))
    config = read_nemo_config(FAMILIES[model_type], release)
    _validate_cached_dspark_manifest(str(out), manifest, config.text_config, layer_ids, target_model=str(release),
                                     target_model_type=json.loads((release / "config.json").read_text())["model_type"],
                                     seq_length=SEQ_LENGTH, compute_dtype=torch.float32)
    ensure_supervision_options_match(manifest, {"mask_generation_prompt": False, "mask_reasoning_content": False},
                                     cache_name="DSpark", cache_dir=str(out), producer_name="ds-capture")
    dataset = CachedDSparkDataset(str(out))
    assert len(dataset) == NUM_ROWS
    for row in range(NUM_ROWS):
        item = dataset[row]
        for key, value in item.items():
            if key in ours:
                assert torch.equal(value, ours[key][row]), (row, key)
