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


@pytest.fixture(scope="module", autouse=True)
def transformers_registries_restored():
    """NeMo's recipe modules (imported here for its trainer's checks) register their own config / model classes
    under transformers' model types (e.g. ``deepseek_v4``) in the auto mappings of the whole process; put those
    mappings back afterwards so the other test modules see transformers' classes (a ds-capture run imports no
    NeMo recipe)."""
    from transformers.models.auto import configuration_auto, modeling_auto

    mappings = [configuration_auto.CONFIG_MAPPING, *(value for name, value in vars(modeling_auto).items()
                                                     if name.startswith("MODEL") and name.endswith("_MAPPING")
                                                     and hasattr(value, "_extra_content"))]
    saved = [dict(mapping._extra_content) for mapping in mappings]
    yield
    for mapping, content in zip(mappings, saved):
        mapping._extra_content.clear()
        mapping._extra_content.update(content)


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


def capture(release: Path, out: Path, layer_ids: list[int], *, seq_length: int = SEQ_LENGTH, **capture_options) -> dict:
    cfg = parse_config({
        "recipe_args": dict(target_model_name_or_path=str(release), train_data_path="demo:conversations",
                            train_split=f"train[:{NUM_ROWS}]", cache_output_dir=str(out), seq_length=seq_length,
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
    from ds_capture.target.nemo_config import read_nemo_config

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


def test_kimi_k3_eagle3_aux_states_equal_nemos_eagle3_wrapper(releases, tmp_path):
    """EAGLE-3 on K3: NeMo's HFEagle3TargetModel hooks decoder layers' ``outputs[0]`` (the attention-residual block
    partial sums, taken as they are); our aux_hidden_states equal its, at every content position."""
    from nemo_automodel.components.speculative.eagle.target import HFEagle3TargetModel
    from safetensors.torch import load_file

    release, out, aux = releases["kimi_k3"], tmp_path / "eagle3", [0, 1, 2]
    cfg = parse_config({"cache_kind": "eagle3", "recipe_args": dict(
        target_model_name_or_path=str(release), train_data_path="demo:conversations", train_split=f"train[:{NUM_ROWS}]",
        cache_output_dir=str(out), seq_length=SEQ_LENGTH, micro_batch_size=2, cache_shard_size=4, cache_dtype="fp32",
        aux_layer_ids=aux, draft_vocab_size=64), "capture": {"compute_dtype": "fp32"}},
        source="eagle3.yaml", base_dir=tmp_path)
    run_capture(cfg, show_progress=False)
    shards = [load_file(p) for p in sorted(out.glob("shard-*.safetensors")) if "shard" in p.name]
    ours = {key: torch.cat([s[key] for s in shards]) for key in ("attention_mask", "aux_hidden_states")}
    lengths = content_lengths(release)
    model = nemo_k3_release.nemo_reference(release, torch.float32)
    ids = torch.cat([load_file(p)["input_ids"] for p in sorted(out.glob("shard-*.safetensors"))])
    # The cache's input_ids are shifted left by one (EAGLE3_CACHE.md): the row is its first token, then ids[:-1].
    # Its attention_mask is NeMo's (unshifted), which NeMo's precompute passes to the wrapper.
    mask = ours["attention_mask"]
    unshifted = torch.cat([torch.tensor(content_first_tokens(release))[:, None], ids[:, :-1]], dim=1)
    with torch.no_grad():
        batch = HFEagle3TargetModel(model, aux_layer_ids=aux).generate_batch(unshifted, mask, mask)
    content = mask.bool() & (torch.arange(SEQ_LENGTH)[None, :] < lengths[:, None])
    diff = float((ours["aux_hidden_states"] - batch.aux_hidden_states)[content].abs().max())
    print(f"kimi_k3 eagle3 aux_hidden_states: max |ours - NeMo| = {diff:.3g}")
    assert diff <= 1e-6 * max(1.0, float(batch.aux_hidden_states.abs().max()))


def content_first_tokens(release: Path) -> list[int]:
    """Each row's first token id (the EAGLE-3 cache's shifted ids lose it)."""
    from transformers import AutoTokenizer

    from ds_capture.data.reading import open_dataset
    from ds_capture.data.tokenization import resolve_chat_template, tokenize_conversations
    from ds_capture.demo import demo_data_path

    tokenizer = AutoTokenizer.from_pretrained(release)
    rows = open_dataset(str(demo_data_path()), split=f"train[:{NUM_ROWS}]", shuffle_seed=42)
    tokenized = tokenize_conversations(rows.conversations(0, NUM_ROWS), tokenizer,
                                       chat_template=resolve_chat_template(tokenizer, None), seq_length=SEQ_LENGTH,
                                       mask_reasoning_content=False, mask_generation_prompt=False)
    return tokenized.input_ids[:, 0].tolist()


def test_v41_rows_are_computed_at_seq_length_whatever_the_bucketing(releases, tmp_path):
    """DeepSeek-V4.1's output depends on the computed width (its indexer's tied top-k), so every row is computed at
    seq_length as NeMo does: runs configured with other buckets write the same bytes (at seq_length 128 the rows are
    shorter, so buckets of 8 or 64 would compute them narrower; with the rule switched off this test fails)."""
    layer_ids = CASES["deepseek_v41"][1]
    runs = [capture(releases["deepseek_v41"], tmp_path / f"pad{pad}", layer_ids, seq_length=128,
                    pad_to_multiple_of=pad) for pad in (0, 8, 64)]
    for other in runs[1:]:
        assert all(torch.equal(other[key], runs[0][key]) for key in runs[0])


@pytest.mark.parametrize("recipe, message", [
    ({"recipe_args": {"target_layer_ids": [-1, 2, 5]}},
     "`recipe_args.target_layer_ids` [-1, 2, 5]: model_type 'deepseek_v41' takes strictly increasing ids in 0..5 (id i "
     "is the residual streams entering decoder layer i, attn_hc's input, so 0 is the embedding output; -1 is not "
     "accepted, as in NeMo)."),
    ({"cache_kind": "eagle3", "recipe_args": {"aux_layer_ids": [1, 2, 3], "draft_vocab_size": 64}},
     "cache_kind eagle3: model_type 'deepseek_v41' has no EAGLE-3 contract to match: NeMo AutoModel 0.7.0's EAGLE-3 "
     "target wrapper (HFEagle3TargetModel) concatenates the decoder layers' outputs, which for DeepSeek-V4.1 are the "
     "4 residual streams [B, S, 4, H], into a tensor its trainer cannot read (it expects [B, S, 3H]). Use cache_kind: "
     "dspark (NeMo's DSpark wrapper captures this family's own feature points)."),
], ids=["minus_one", "eagle3"])
def test_v41_refusals_come_before_anything_is_written(releases, tmp_path, recipe, message):
    from ds_capture.errors import CaptureError

    out = tmp_path / "cache"
    recipe_args = dict(target_model_name_or_path=str(releases["deepseek_v41"]), train_data_path="demo:conversations",
                       train_split="train[:4]", cache_output_dir=str(out), seq_length=SEQ_LENGTH, micro_batch_size=2,
                       cache_shard_size=2, **recipe["recipe_args"])
    cfg = parse_config({**recipe, "recipe_args": recipe_args}, source="v41.yaml", base_dir=tmp_path)
    with pytest.raises(CaptureError) as caught:
        run_capture(cfg, show_progress=False)
    assert str(caught.value) == f"v41.yaml: {message}"
    assert not out.exists()


def test_a_nemo_family_without_nemo_installed_names_the_fix(releases, monkeypatch):
    import sys

    from ds_capture.errors import CaptureError
    from ds_capture.target.families import read_target_info

    monkeypatch.setitem(sys.modules, "nemo_automodel", None)  # `import nemo_automodel` raises ImportError
    with pytest.raises(CaptureError) as caught:
        read_target_info(releases["kimi_k3"])
    assert str(caught.value) == (
        f"{releases['kimi_k3'] / 'config.json'}: model_type 'kimi_k3' is built by NeMo AutoModel 0.7.0's model class, "
        "which is not installed. Install the nemo extra: `pip install 'ds-capture[nemo]'` then `pip install --no-deps "
        "nemo_automodel==0.7.0` (scripts/install_nemo_extra.sh does both; NeMo pins transformers 5.18, so pip cannot "
        "resolve it as a plain requirement, and its model classes run with this project's transformers).")
