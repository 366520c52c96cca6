"""Chunked prefill (``capture.chunked_prefill``): a row forwarded in chunks is captured as the whole row is.

Per family of the support table that transformers builds, a tiny random-init target (``test_families``' builder:
sharded release layout, DeepSeek-V4's hash routes randomised) captures rows of 2,043 to 2,048 tokens (S = 2,048,
several demo conversations joined) three times through ``run_capture``: whole rows (``off``), chunks of 256, and a
chunk that does not divide S (300; 320 where the family computes in 64-token blocks). Against the whole-row cache:
``input_ids`` and ``loss_mask`` byte for byte, every captured state (fp32) within 1e-5 of its row's maximum.
DSA families (GLM-5, DeepSeek-V3.2) and DeepSeek-V4's CSA indexer also compare each indexer's top-k set per query,
whole row vs chunked, with the chunk's queries scored in blocks of 16 (``ds_capture.target.query_blocks``; the
same sets as the chunk scored at once).
The EAGLE-3 kind the same way, per family (aux layers 0, 2, 3 of the 4; a draft vocabulary of 256): aux states and
``target_probs`` within 1e-5 of the row maximum, every integer tensor byte for byte.
Measured (2,048 tokens, chunks 256 / 320): worst 9.2e-6 (Qwen3-Next's Gated DeltaNet), most families 1e-6 or
less, Qwen3 0.0 at 256.

The refusals (before anything loads): a chunk that splits DeepSeek-V4.1's compression groups or a linear-attention
family's 64-token blocks; a setting that is neither auto, off nor a positive count.
CI runs a representative cut (DSpark: Gated DeltaNet, sliding windows with GQA; EAGLE-3: Gemma 4); every other
family with ``--full``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ds_capture.capture.chunked import resolve_chunk_tokens
from ds_capture.demo import demo_data_path
from ds_capture.errors import CaptureError
from ds_capture.recipe.config import load_config
from ds_capture.runner import run_capture
from ds_capture.target import attention_sizes
from ds_capture.target.families import get_family
from tests.unit.test_families import family_target_builder

SEQ_LENGTH = 2048
LAYER_IDS = [-1, 0, 1, 2, 3]
# model_type -> the chunk that does not divide S (the family's chunk_multiple allowing).
FAMILIES = {"qwen3": 300, "qwen3_moe": 300, "mixtral": 300, "deepseek_v3": 300, "deepseek_v4": 300,
            "glm_moe_dsa": 300, "gemma4": 300, "kimi_k25": 300, "glm4_moe": 300, "qwen3_5_moe": 320,
            "qwen3_next": 320, "deepseek_v32": 300, "minimax_m2": 300, "kimi_linear": 320, "gpt_oss": 300,
            "glm5_next": 320, "llama4": 300}
CI_CUT = {"qwen3_next", "gemma4"}
INDEXER_FAMILIES = {"glm_moe_dsa", "deepseek_v32", "deepseek_v4"}  # DSA, and DeepSeek-V4's CSA indexer


def long_rows(path: Path, num_rows: int, conversations_per_row: int = 60) -> Path:
    """``num_rows`` chat rows, each the user / assistant turns of ``conversations_per_row`` demo conversations."""
    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines()]
    with path.open("w") as out:
        for i in range(num_rows):
            turns = [m for row in rows[i * conversations_per_row:(i + 1) * conversations_per_row]
                     for m in row["messages"] if m["role"] in ("user", "assistant")]
            out.write(json.dumps({"messages": turns}) + "\n")
    return path


@pytest.fixture(scope="module")
def family_target(tmp_path_factory):
    return family_target_builder(tmp_path_factory.mktemp("chunked_targets"))


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> Path:
    return long_rows(tmp_path_factory.mktemp("chunked_data") / "long.jsonl", 2)


def capture(target: Path, data: Path, out: Path, chunked_prefill, **capture_options) -> dict[str, torch.Tensor]:
    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({
        "recipe_args": dict(target_model_name_or_path=str(target), train_data_path=str(data),
                            cache_output_dir=str(out), seq_length=SEQ_LENGTH, micro_batch_size=2, cache_shard_size=2,
                            cache_dtype="fp32", target_layer_ids=LAYER_IDS),
        "capture": {"chunked_prefill": chunked_prefill, **capture_options}}))
    run_capture(load_config(recipe), show_progress=False)
    return load_file(out / "shard-000000.safetensors")


def worst_row_difference(ours: dict[str, torch.Tensor], whole: dict[str, torch.Tensor]) -> float:
    """The largest |chunked - whole| over every state tensor and row, relative to that row's maximum."""
    worst = 0.0
    for key in ("target_hidden_states", "target_last_hidden_states"):
        for a, b in zip(ours[key], whole[key]):
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item())
    return worst


def _indexer_topk(target: Path, model_type: str, input_ids: torch.Tensor, chunk: int | None, *,
                  blocks: bool = True) -> list[torch.Tensor]:
    """Every sparse-attention indexer's top-k sets ([S, k], sorted per query) over ``input_ids``, whole row or
    chunked; ``blocks``: the family's indexers score the chunk's queries in blocks (as ``run`` does), and they did."""
    from ds_capture.capture.chunked import forward_in_chunks
    from tests.unit.test_families import reference_model

    model = reference_model(target, model_type)
    seen: dict[str, list[torch.Tensor]] = {}
    indexers = [(name, module) for name, module in model.named_modules() if name.endswith("self_attn.indexer")
                or name.endswith("compressor.indexer")]
    assert indexers, f"{model_type}: no indexer module"
    handles = [module.register_forward_hook(lambda _m, _a, out, name=name: seen.setdefault(name, []).append(out))
               for name, module in indexers]
    kind = type(indexers[0][1])
    calls, own = [], kind.forward
    kind.forward = lambda *args, **kwargs: calls.append(1) or own(*args, **kwargs)  # counts the module's forwards
    kwargs = {"use_cache": False, "logits_to_keep": 1}
    try:
        with torch.no_grad():
            if chunk is None:
                model(input_ids=input_ids[None], **kwargs)
            else:
                query_blocks = get_family(model_type).chunk_query_blocks if blocks else None
                forward_in_chunks(model, {"input_ids": input_ids[None]}, chunk, kwargs, query_blocks=query_blocks)
    finally:
        kind.forward = own
        for handle in handles:
            handle.remove()
    chunks = 1 if chunk is None else -(-input_ids.shape[0] // chunk)
    assert (len(calls) > chunks * len(indexers)) == (chunk is not None and blocks), (model_type, len(calls))
    # A query with fewer than k keys before it takes masked (future) positions to fill its k, in an order that
    # depends on how many keys the forward had: those never reach the attention (the causal mask removes them).
    selected = []
    for outs in seen.values():
        topk = torch.cat(outs, dim=1)[0].long()
        causal = topk <= torch.arange(topk.shape[0])[:, None]
        selected.append(torch.where(causal, topk, -1).sort(dim=-1).values)
    return selected


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=() if m in CI_CUT else pytest.mark.slow)
                                        for m in FAMILIES])
def test_chunked_cache_equals_the_whole_row_cache(family_target, long_data, tmp_path, monkeypatch, model_type):
    # Indexers score a chunk's queries in blocks as small as they go (16 queries), so the tiny rows take many.
    monkeypatch.setattr(attention_sizes, "QUERY_BLOCK_BYTES", 1)
    target = family_target(model_type)
    whole = capture(target, long_data, tmp_path / "whole", "off")
    assert int(whole["loss_mask"][:, SEQ_LENGTH // 2:].sum()) > 0, "the rows are long: supervised tokens past S/2"
    for chunk in (256, FAMILIES[model_type]):
        ours = capture(target, long_data, tmp_path / f"chunk{chunk}", chunk)
        assert torch.equal(ours["input_ids"], whole["input_ids"]) and torch.equal(ours["loss_mask"],
                                                                                  whole["loss_mask"])
        worst = worst_row_difference(ours, whole)
        print(f"[chunked prefill] {model_type} chunk {chunk}: worst {worst:.2e} of the row maximum")
        assert worst <= 1e-5, (model_type, chunk, worst)
    if model_type in INDEXER_FAMILIES:
        ids = whole["input_ids"][0]
        rows, blocks = _indexer_topk(target, model_type, ids, None), _indexer_topk(target, model_type, ids, 300)
        chunks = _indexer_topk(target, model_type, ids, 300, blocks=False)
        for row, blocked, chunked in zip(rows, blocks, chunks):
            assert torch.equal(blocked, chunked), f"{model_type}: an indexer's blocks chose other keys than its chunks"
            assert torch.equal(row, blocked), f"{model_type}: an indexer's top-k set differs between whole row and chunks"


def assert_equal_caches(ours: dict, whole: dict, label: str, family: str) -> float:
    """Integer tensors byte for byte; every float tensor within 1e-5 of its row's maximum. Returns the worst."""
    assert sorted(ours) == sorted(whole), label
    worst = 0.0
    for key, expected in whole.items():
        if expected.is_floating_point():
            for a, b in zip(ours[key], expected):
                worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item())
        else:
            assert torch.equal(ours[key], expected), (label, key)
    print(f"[chunked prefill] {family} {label}: worst {worst:.2e} of the row maximum")
    assert worst <= 1e-5, (family, label, worst)
    return worst


def eagle3_capture(target: Path, data: Path, out: Path, chunked_prefill) -> dict[str, torch.Tensor]:
    from tests.eagle3_support import load_cache

    recipe = out.parent / f"{out.name}.yaml"
    recipe.write_text(yaml.safe_dump({
        "cache_kind": "eagle3",
        "recipe_args": dict(target_model_name_or_path=str(target), train_data_path=str(data),
                            cache_output_dir=str(out), seq_length=SEQ_LENGTH, micro_batch_size=2, cache_shard_size=2,
                            cache_dtype="fp32", draft_vocab_size=256, aux_layer_ids=EAGLE3_AUX_LAYER_IDS),
        "capture": {"chunked_prefill": chunked_prefill}}))
    run_capture(load_config(recipe), show_progress=False)
    return load_cache(out)


# Every tiny target has 4 decoder layers: the first, a middle one and the last (pre-norm).
EAGLE3_AUX_LAYER_IDS = [0, 2, 3]
EAGLE3_CI = "gemma4"  # sliding windows with GQA; its target is built for the DSpark cut


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=() if m == EAGLE3_CI else pytest.mark.slow)
                                        for m in FAMILIES])
def test_eagle3_cache_chunked_equals_whole_rows(family_target, long_data, tmp_path, model_type):
    """The EAGLE-3 kind: aux states, target_probs and masks of a chunked capture equal the whole row's (every family
    here allows the kind; DeepSeek-V4.1 refuses it, Kimi K3's cells are in test_chunked_prefill_nemo.py)."""
    assert not get_family(model_type).eagle3_refusal, model_type
    target = family_target(model_type)
    whole = eagle3_capture(target, long_data, tmp_path / "whole", "off")
    assert int(whole["loss_mask"][:, SEQ_LENGTH // 2:].sum()) > 0, "the rows are long: supervised tokens past S/2"
    for chunk in (256, FAMILIES[model_type]):
        ours = eagle3_capture(target, long_data, tmp_path / f"chunk{chunk}", chunk)
        assert_equal_caches(ours, whole, f"eagle3 chunk {chunk}", model_type)


def test_chunk_as_long_as_the_row_is_the_whole_row_and_off_is_unchanged(family_target, long_data, tmp_path):
    """``chunked_prefill`` >= S forwards whole rows (the same bytes as off); so does auto without a GPU budget."""
    target = family_target("qwen3_next")
    whole = capture(target, long_data, tmp_path / "off", "off")
    for setting in (SEQ_LENGTH, "auto"):
        ours = capture(target, long_data, tmp_path / f"s{setting}", setting)
        for key in whole:
            assert torch.equal(ours[key], whole[key]), (setting, key)


def test_nemo_families_take_chunks_of_their_multiple_and_refuse_others_before_loading():
    # DeepSeek-V4.1 carries its CSA2 and Engram state in its compression groups (tests/unit/test_chunked_prefill_nemo.py).
    family = get_family("deepseek_v41")
    assert resolve_chunk_tokens(1024, family, 4096, source="r.yaml") == 1024
    assert resolve_chunk_tokens(300, family, 2048, source="r.yaml") == 300
    with pytest.raises(CaptureError) as caught:
        resolve_chunk_tokens(1001, family, 4096, source="r.yaml")
    assert str(caught.value) == (
        "r.yaml: `capture.chunked_prefill` 1001: model_type 'deepseek_v41' takes chunks that are a multiple of 2 "
        "tokens (its compressed attention pools groups of 1 or 2 tokens into one compressed key, and a chunk must end "
        "on a group's boundary). Use 1000 or 1002, or off.")
    assert resolve_chunk_tokens("auto", family, 4096, source="r.yaml") is None
    assert resolve_chunk_tokens(4096, family, 4096, source="r.yaml") is None
    # Kimi K3 carries its KDA and MLA state (tests/unit/test_chunked_prefill_nemo.py), in KDA's 64-token blocks.
    assert resolve_chunk_tokens(1024, get_family("kimi_k3"), 4096, source="r.yaml") == 1024
    with pytest.raises(CaptureError, match="model_type 'kimi_k3' takes chunks that are a multiple of 64 tokens"):
        resolve_chunk_tokens(1000, get_family("kimi_k3"), 4096, source="r.yaml")


def test_a_chunk_that_splits_linear_attention_blocks_is_refused():
    with pytest.raises(CaptureError) as caught:
        resolve_chunk_tokens(300, get_family("qwen3_next"), 2048, source="r.yaml")
    assert str(caught.value) == (
        "r.yaml: `capture.chunked_prefill` 300: model_type 'qwen3_next' takes chunks that are a multiple of 64 tokens "
        "(its linear-attention layers compute in blocks of 64, and a chunk that splits a block changes the captured "
        "states). Use 256 or 320, or off.")
    assert resolve_chunk_tokens(320, get_family("qwen3_next"), 2048, source="r.yaml") == 320
    assert resolve_chunk_tokens(300, get_family("qwen3"), 2048, source="r.yaml") == 300


def test_a_bare_yaml_off_is_off(write_recipe):
    path = write_recipe("recipe_args: {target_model_name_or_path: demo:qwen3_moe_tiny, train_data_path: "
                        "demo:conversations, cache_output_dir: out, seq_length: 64, micro_batch_size: 1, "
                        "cache_shard_size: 1}\ncapture: {chunked_prefill: off}\n")
    assert load_config(path).capture.chunked_prefill == "off"


@pytest.mark.parametrize("value, message", [
    ("sometimes", "must be auto, off or a number of tokens, got 'sometimes'"),
    (True, "must be auto, off or a number of tokens, got true"),
    (0, "must be >= 1 tokens (or auto / off), got 0"),
])
def test_bad_settings_are_refused(write_recipe, value, message):
    path = write_recipe({"recipe_args": {"target_model_name_or_path": "demo:qwen3_moe_tiny",
                                         "train_data_path": "demo:conversations", "cache_output_dir": "out",
                                         "seq_length": 64, "micro_batch_size": 1, "cache_shard_size": 1},
                         "capture": {"chunked_prefill": value}})
    with pytest.raises(CaptureError, match="capture.chunked_prefill") as caught:
        load_config(path)
    assert message in str(caught.value)


def test_a_rerun_never_mixes_two_chunk_settings_in_one_cache(tiny_target, tmp_path, caplog):
    """The chunk is recorded with the cache's numerics: auto continues with it, another setting is refused."""
    from ds_capture.cache.registry import verify_cache

    target = tiny_target("qwen3", num_hidden_layers=2)

    def recipe(setting) -> Path:
        path = tmp_path / f"r-{setting}.yaml"
        path.write_text(yaml.safe_dump({
            "recipe_args": dict(target_model_name_or_path=str(target), train_data_path=str(long_data_rows(tmp_path)),
                                cache_output_dir=str(tmp_path / "cache"), seq_length=512, micro_batch_size=1,
                                cache_shard_size=1, cache_dtype="fp32"),
            "capture": {"chunked_prefill": setting}}))
        return path

    run_capture(load_config(recipe(128)), show_progress=False)
    assert json.loads((tmp_path / "cache" / ".ds_capture" / "numerics.json").read_text())["chunk_tokens"] == 128
    assert "rows in chunks of 128 tokens" in verify_cache(tmp_path / "cache").summary()
    first = (tmp_path / "cache" / "shard-000001.safetensors").read_bytes()
    with pytest.raises(CaptureError) as caught:
        run_capture(load_config(recipe("off")), show_progress=False)
    assert str(caught.value) == (
        f"{tmp_path / 'cache'} was begun with rows in chunks of 128 tokens (.ds_capture/numerics.json), and this run sets "
        "capture.chunked_prefill: off: chunks sum each layer's attention and recurrences in another order, so shards "
        "computed with the two settings differ in their last bits and cannot be mixed in one cache. Set "
        "capture.chunked_prefill to 128 (or auto, which continues with the recorded setting) to continue this cache, "
        "use a new cache_output_dir, or pass --restart to recompute every shard with the new setting.")
    (tmp_path / "cache" / "shard-000001.safetensors").unlink()
    with caplog.at_level("INFO", logger="ds_capture"):
        run_capture(load_config(recipe("auto")), show_progress=False)
    assert "with chunks of 128 tokens, as it was begun" in caplog.text
    assert (tmp_path / "cache" / "shard-000001.safetensors").read_bytes() == first


def long_data_rows(tmp_path: Path) -> Path:
    path = tmp_path / "rows.jsonl"
    return path if path.is_file() else long_rows(path, 2, conversations_per_row=20)


# ---------------------------------------------------------------------------------------------------- plan
COUNTED_CI = {"qwen3_next", "deepseek_v4"}


@pytest.mark.parametrize("model_type", [pytest.param(m, marks=() if m in COUNTED_CI else pytest.mark.slow)
                                        for m in FAMILIES])
def test_plan_counts_the_carried_state_a_real_forward_holds(family_target, model_type):
    """plan's carried state (a meta forward's cache, scaled from bf16) is what a real fp32 forward's cache holds (to
    within 3%: DeepSeek-V4's compressor buffers round differently); families whose forward cannot run on meta (Gemma 4,
    GLM-5-Next) get the config's bound, which must hold too."""
    from ds_capture.sizing.carried_state import _collect, carried_state_bytes
    from ds_capture.target.families import read_target_info
    from tests.unit.test_families import reference_model

    target = family_target(model_type)
    counted = carried_state_bytes(read_target_info(target), 512, 4)
    model = reference_model(target, model_type)
    with torch.no_grad():
        output = model(input_ids=torch.randint(3, 500, (1, 512)), use_cache=True, logits_to_keep=1)
    tensors: dict = {}
    _collect(output.cache, tensors, depth=0)
    real = sum(t.numel() * t.element_size() for t in tensors.values())
    assert counted.how == ("bound" if model_type in ("gemma4", "glm5_next") else "counted")
    assert real <= counted.bytes_per_row <= (5 * real if counted.how == "bound" else 1.03 * real), (counted, real)


def _plan(tiny_target, tmp_path, chunked_prefill, gpu_memory_gib: float):
    from ds_capture.sizing.command import plan_capture

    path = tmp_path / f"plan-{chunked_prefill}.yaml"
    path.write_text(yaml.safe_dump({
        "recipe_args": dict(target_model_name_or_path=str(tiny_target("qwen3_next")), train_data_path="demo:conversations",
                            cache_output_dir=str(tmp_path / "out"), seq_length=16384, micro_batch_size=1,
                            cache_shard_size=1),
        "capture": {"chunked_prefill": chunked_prefill}}))
    return plan_capture(load_config(path), world_size=1, gpu_memory_gib=gpu_memory_gib, suggest=False,
                        count_dataset=False)


def test_plan_sizes_a_chunk_against_the_whole_row_and_auto_takes_the_largest_that_fits(tiny_target, tmp_path):
    whole = _plan(tiny_target, tmp_path, "off", 80)
    chunked = _plan(tiny_target, tmp_path, 1024, 80)
    assert whole.chunk_tokens is None and chunked.chunk_tokens == 1024
    terms = {term.name: term.bytes for term in chunked.activation_terms}
    assert terms["carried state"] == chunked.carried_state["bytes_per_row"] > 0
    assert chunked.worst.activation_bytes < whole.worst.activation_bytes
    # A budget between the two: auto keeps whole rows where they fit, else takes the largest chunk that fits.
    assert _plan(tiny_target, tmp_path, "auto", 80).chunk_tokens is None
    budget = (whole.worst.peak_bytes + chunked.worst.peak_bytes) / 2 / 2**30
    auto = _plan(tiny_target, tmp_path, "auto", budget)
    assert auto.fits and auto.chunk_tokens is not None and auto.chunk_tokens % 64 == 0
    assert not _plan(tiny_target, tmp_path, auto.chunk_tokens * 2, budget).fits or auto.chunk_tokens * 2 >= 16384
    assert "chunked prefill: rows forwarded in chunks of" in auto.format()


def test_plan_counts_an_indexer_block_not_the_chunk(tiny_target, tmp_path):
    """Under chunks, plan sizes a DSA indexer's scores for one block of queries against the row (what run computes,
    ``ds_capture.target.query_blocks``), not the chunk's: GLM-5's tiny target at S = 16,384 in chunks of 4,096."""
    from ds_capture.sizing.command import plan_capture

    path = tmp_path / "plan-dsa.yaml"
    path.write_text(yaml.safe_dump({
        "recipe_args": dict(target_model_name_or_path=str(tiny_target("glm_moe_dsa")), train_data_path="demo:conversations",
                            cache_output_dir=str(tmp_path / "out"), seq_length=16384, micro_batch_size=1,
                            cache_shard_size=1),
        "capture": {"chunked_prefill": 4096}}))
    report = plan_capture(load_config(path), world_size=1, gpu_memory_gib=1000, compute_dtype="fp32", suggest=False,
                          count_dataset=False)
    per_query = attention_sizes.dsa_query_bytes(16, 16, 16384)  # the tiny indexer: 16 heads of 16
    block = attention_sizes.block_queries(per_query)
    assert block == 128 and f"a block of {block} queries ({block * per_query / 2**30:.1f} GiB" in \
        report.activation_largest.note
    assert report.activation_largest.bytes < 4096 * per_query / 4  # a chunk's scores would be 8 GiB


@pytest.mark.parametrize("model_type, index_topk", [("glm_moe_dsa", 40), ("deepseek_v32", 40), ("deepseek_v4", 16)])
def test_query_blocks_equal_the_whole_row_where_a_block_sees_fewer_keys_than_top_k(monkeypatch, model_type, index_topk):
    """A block of 16 queries early in the row sees fewer keys than ``index_topk`` (its top-k is narrower than the
    chunk's and is filled with keys none of its queries may attend to): the top-k sets and the states are still the
    whole row's. GLM-5's and DeepSeek-V3.2's MLA attend on the latent throughout (as past
    ``LATENT_ATTENTION_FROM_BYTES``). Tiny random-init targets, 160 tokens in chunks of 80."""
    import transformers

    from ds_capture.capture.chunked import forward_in_chunks
    from ds_capture.demo import TINY_CONFIGS

    monkeypatch.setattr(attention_sizes, "QUERY_BLOCK_BYTES", 1)  # blocks of 16 queries
    monkeypatch.setattr(attention_sizes, "LATENT_ATTENTION_FROM_BYTES", 0)
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **{**TINY_CONFIGS[model_type], "vocab_size": 512,
                                                              "index_topk": index_topk})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    indexer = next(m for name, m in model.named_modules() if name.endswith("indexer"))
    layer = model.model.layers[-1]
    seen: dict[str, list[torch.Tensor]] = {"topk": [], "states": []}
    indexer.register_forward_hook(lambda _m, _a, out: seen["topk"].append(out.long()))
    layer.register_forward_hook(lambda _m, _a, out: seen["states"].append(out[0] if isinstance(out, tuple) else out))
    ids = torch.randint(3, 500, (1, 160))
    kwargs = {"use_cache": False, "logits_to_keep": 1}
    with torch.no_grad():
        model(input_ids=ids, **kwargs)
        whole = {key: torch.cat(value, dim=1) for key, value in seen.items()}
        for value in seen.values():
            value.clear()
        forward_in_chunks(model, {"input_ids": ids}, 80, kwargs,
                          query_blocks=get_family(model_type).chunk_query_blocks)
    blocks = {key: torch.cat(value, dim=1) for key, value in seen.items()}

    def sets(topk: torch.Tensor) -> torch.Tensor:  # keys a query may attend to (DSA: causal; CSA: not -1)
        if model_type == "deepseek_v4":
            return topk.sort(dim=-1).values
        return torch.where(topk <= torch.arange(topk.shape[1])[:, None], topk, -1).sort(dim=-1).values

    assert blocks["topk"].shape == whole["topk"].shape
    assert torch.equal(sets(blocks["topk"]), sets(whole["topk"]))
    worst = ((blocks["states"] - whole["states"]).abs().max() / whole["states"].abs().max()).item()
    assert worst <= 1e-5, worst
