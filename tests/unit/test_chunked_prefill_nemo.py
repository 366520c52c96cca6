"""Chunked prefill of Kimi K3 and DeepSeek-V4.1 (NeMo AutoModel 0.7.0's classes, no cache of their own): the
carriers of :mod:`ds_capture.target.nemo_kda_mla_chunks` and :mod:`~ds_capture.target.nemo_v41_chunks` make a
chunked cache equal the whole-row cache.

Target: the tiny K3 release (tests/nemo_k3_release.py: KDA, KDA, KDA, MLA with attention residuals, latent MoE,
MXFP4 experts) with the demo's tokenizer, fp32 on CPU (KDA through :mod:`ds_capture.target.nemo_fla`'s token
recurrence). Rows of ~2,048 tokens (S = 2,048, demo conversations joined). Against the whole-row cache (``off``):
``input_ids`` and the masks byte for byte, every captured state within 1e-5 of its row's maximum, for chunks of 256
and 320 (320 does not divide S: the last chunk is 128 tokens). Measured: worst 4e-7.
CI: one row, DSpark, chunk 320 (~10 s); with ``--full``: two rows, both chunks, both cache kinds.
Also: plan's carried state (the carriers' declared shapes on the meta model) equals what a real chunked forward's
carriers hold.

DeepSeek-V4.1 (NeMo's class, the carriers of :mod:`ds_capture.target.nemo_v41_chunks`; the tiny release of
tests/nemo_v41_release.py: sliding-window, ratio-2 and ratio-1 compressed layers, a key-owning, a reindexing and a
candidate-source indexer, Engram at layers 1 and 3): NeMo's own model over a row of 2,048 tokens whole and in chunks
of 256 and 300, every indexer's top-k set and the candidate blocks identical per query, the streams within 1e-5; the
cache in chunks equal to the whole-row cache (DSpark; V4.1 has no EAGLE-3 contract). Measured: worst 1.5e-7 (NeMo's
forward), 1.8e-7 (the cache). CI: the model-level test, plan's carried state, a chunk inside a compression group;
with ``--full``: two rows' caches at both chunks, plan at 131,072 tokens against whole rows on both GPU counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("nemo_automodel")

from ds_capture.demo import demo_tokenizer  # noqa: E402
from ds_capture.recipe.config import parse_config  # noqa: E402
from ds_capture.runner import run_capture  # noqa: E402
from tests import nemo_k3_release, nemo_v41_release  # noqa: E402
from tests.unit.test_chunked_prefill import assert_equal_caches, long_rows  # noqa: E402

SEQ_LENGTH = 2048


@pytest.fixture(scope="module")
def k3_release(tmp_path_factory) -> Path:
    return nemo_k3_release.write_tiny_k3_release(tmp_path_factory.mktemp("k3_chunks") / "k3", seed=0,
                                                 tokenizer=demo_tokenizer())


@pytest.fixture(scope="module")
def long_data(tmp_path_factory) -> Path:
    return long_rows(tmp_path_factory.mktemp("k3_chunk_data") / "long.jsonl", 2)


@pytest.fixture(scope="module")
def v41_release(tmp_path_factory) -> Path:
    return nemo_v41_release.write_tiny_v41_release(tmp_path_factory.mktemp("v41_chunks") / "v41", seed=0,
                                                   tokenizer=demo_tokenizer())


def capture(release: Path, data: Path, out: Path, chunked_prefill, *, num_rows: int, kind: str = "dspark",
            layer_ids: tuple[int, ...] = (-1, 0, 1, 2)) -> dict:
    from tests.eagle3_support import load_cache

    args = dict(target_model_name_or_path=str(release), train_data_path=str(data), train_split=f"train[:{num_rows}]",
                cache_output_dir=str(out), seq_length=SEQ_LENGTH, micro_batch_size=num_rows,
                cache_shard_size=num_rows, cache_dtype="fp32")
    args.update(aux_layer_ids=[0, 2, 3], draft_vocab_size=64) if kind == "eagle3" else args.update(
        target_layer_ids=list(layer_ids))
    cfg = parse_config({"cache_kind": kind, "recipe_args": args,
                        "capture": {"compute_dtype": "fp32", "chunked_prefill": chunked_prefill}},
                       source=str(out) + ".yaml", base_dir=out.parent)
    run_capture(cfg, show_progress=False)
    return load_cache(out)


def test_k3_chunked_dspark_cache_equals_the_whole_row(k3_release, long_data, tmp_path):
    whole = capture(k3_release, long_data, tmp_path / "whole", "off", num_rows=1)
    assert int(whole["loss_mask"][:, SEQ_LENGTH // 2:].sum()) > 0, "the row is long: supervised tokens past S/2"
    ours = capture(k3_release, long_data, tmp_path / "c320", 320, num_rows=1)
    assert_equal_caches(ours, whole, "dspark 320", "kimi_k3")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_k3_chunked_caches_of_both_kinds_equal_the_whole_rows(k3_release, long_data, tmp_path, kind):
    whole = capture(k3_release, long_data, tmp_path / "whole", "off", num_rows=2, kind=kind)
    for chunk in (256, 320):
        ours = capture(k3_release, long_data, tmp_path / f"c{chunk}", chunk, num_rows=2, kind=kind)
        assert_equal_caches(ours, whole, f"{kind} {chunk}", "kimi_k3")


def counted_and_carried(release: Path, writer, seq_length: int, *, vocab: int):
    """(the target, plan's carried state at ``seq_length`` in fp32, the family's carriers after NeMo's own model
    forwarded a random row of ``seq_length`` tokens through them in chunks of 128)."""
    from ds_capture.capture.chunked import carried_state
    from ds_capture.sizing.carried_state import carried_state_bytes
    from ds_capture.target.families import read_target_info

    target = read_target_info(release)
    counted = carried_state_bytes(target, seq_length, 4)
    assert counted.how == "declared" and counted.transient_bytes > 0
    model = writer.nemo_reference(release, torch.float32)
    input_ids = torch.randint(3, vocab, (1, seq_length))
    with torch.no_grad(), carried_state(model, target.family.chunk_carriers, seq_length) as carriers:
        for start in range(0, seq_length, 128):
            model(input_ids=input_ids[:, start:start + 128], logits_to_keep=1)
    return target, counted, carriers


def test_plan_counts_the_state_k3s_carriers_hold(k3_release):
    """plan's carried state at S (the carriers' declared shapes on the meta model) is what the carriers of a real
    chunked forward hold after its last chunk, to the byte; one KDA layer's state does not grow with S."""
    from ds_capture.sizing.carried_state import carried_state_bytes

    target, counted, carriers = counted_and_carried(k3_release, nemo_k3_release, 384, vocab=100)
    seq_length = 384
    state = {c: [t for t in (*getattr(c, "conv_tails", {}).values(), getattr(c, "recurrent", None),
                             getattr(c, "latent", None)) if t is not None] for c in carriers}
    real = sum(t.numel() * t.element_size() for tensors in state.values() for t in tensors)
    latent = sum(c.latent.numel() * c.latent.element_size() for c in carriers if hasattr(c, "latent"))
    assert sorted(type(c).__name__ for c in carriers) == ["KdaCarrier"] * 3 + ["LatentKvCarrier"]
    assert counted.bytes_per_row == real, (counted, real)
    # Only MLA's latent grows with the row: twice the row, twice the latent, the same KDA state.
    assert carried_state_bytes(target, 2 * seq_length, 4).bytes_per_row == real + latent


# DeepSeek-V4.1: the streams entering layers 0, 2 (the first compressed layer), 3 (it reuses 2's selection), 5.
V41_LAYER_IDS = (0, 2, 3, 5)


def v41_records(model: torch.nn.Module, input_ids: torch.Tensor, chunk_tokens: int | None) -> dict[str, torch.Tensor]:
    """NeMo's V4.1 over one row, whole (``chunk_tokens`` None) or in chunks through the family's carriers: per layer
    the streams entering it (``attn_hc``'s input), the CSA2 selection it leaves (top-k indices, the candidate
    source's blocks), each concatenated over the chunks; and the last position's logits."""
    from ds_capture.capture.chunked import forward_in_chunks
    from ds_capture.target.families import get_family

    records: dict[str, list[torch.Tensor]] = {}

    def keep(name: str, value: torch.Tensor | None) -> None:
        if value is not None:
            records.setdefault(name, []).append(value.detach().clone())

    def keep_selection(index: str, output) -> None:  # a forward hook: returns None (the output stays)
        keep(f"top-k {index}", output.state.topk_indices)
        keep(f"candidates {index}", output.state.candidates)

    handles = []
    for index, layer in model.model.layers.items():
        handles.append(layer.attn_hc.register_forward_hook(
            lambda module, args, output, index=index: keep(f"streams {index}", args[0])))
        handles.append(layer.attn.register_forward_hook(
            lambda module, args, output, index=index: keep_selection(index, output)))
    try:
        with torch.no_grad():
            if chunk_tokens is None:
                output = model(input_ids=input_ids, logits_to_keep=1)
            else:
                output = forward_in_chunks(model, {"input_ids": input_ids}, chunk_tokens, {"logits_to_keep": 1},
                                           carriers=get_family("deepseek_v41").chunk_carriers)
    finally:
        for handle in handles:
            handle.remove()
    return {**{name: torch.cat(parts, dim=1) for name, parts in records.items()}, "logits": output.logits}


def test_v41_chunks_equal_nemos_own_whole_row_forward(v41_release):
    """NeMo's own V4.1 model over a row of 2,048 tokens, whole and in chunks of 256 and 300 (300 does not divide
    S): every indexer's top-k and the candidate source's blocks identical per query (ties broken as the whole row
    breaks them), the streams entering every layer and the last logits within 1e-5 of the row maximum."""
    model = nemo_v41_release.nemo_reference(v41_release, torch.float32)
    input_ids = torch.randint(3, 60, (1, SEQ_LENGTH), generator=torch.Generator().manual_seed(0))
    whole = v41_records(model, input_ids, None)
    assert {"top-k 2", "top-k 4", "top-k 5", "candidates 4"} <= set(whole), sorted(whole)
    for chunk in (256, 300):
        ours = v41_records(model, input_ids, chunk)
        assert sorted(ours) == sorted(whole)
        worst = 0.0
        for name, expected in whole.items():
            assert ours[name].shape == expected.shape, (chunk, name)
            if expected.is_floating_point():
                worst = max(worst, ((ours[name] - expected).abs().max() / expected.abs().max().clamp_min(1)).item())
            else:
                assert torch.equal(ours[name], expected), (chunk, name)
        print(f"[chunked prefill] deepseek_v41 NeMo's forward, chunk {chunk}: worst {worst:.2e} of the row maximum")
        assert worst <= 1e-5, (chunk, worst)


def test_v41_chunk_inside_a_compression_group_is_refused(v41_release):
    """A chunk that is not a multiple of a layer's compress ratio (resolve_chunk_tokens refuses it for the release's
    ratios before loading; a config with larger ones reaches the carrier) is refused, not pooled across chunks."""
    from ds_capture.capture.chunked import forward_in_chunks
    from ds_capture.errors import CaptureError
    from ds_capture.target.families import get_family

    model = nemo_v41_release.nemo_reference(v41_release, torch.float32)
    with pytest.raises(CaptureError) as caught, torch.no_grad():
        forward_in_chunks(model, {"input_ids": torch.randint(3, 60, (1, 64))}, 15, {"logits_to_keep": 1},
                          carriers=get_family("deepseek_v41").chunk_carriers)
    assert str(caught.value) == (
        "capture.chunked_prefill: the row's chunks so far end at token 15, inside a compression group of layer 2 "
        "(compress_ratio 2), whose compressed key would be pooled from two chunks. Use a chunk that is a multiple "
        "of 2, or off.")
    assert "forward" not in vars(model.model.layers["2"].attn), "the module's own forward is back"


@pytest.mark.slow
def test_v41_chunked_caches_equal_the_whole_rows(v41_release, long_data, tmp_path):
    """Two rows in one micro-batch, chunks of 256 and 300 (DeepSeek-V4.1 has no EAGLE-3 contract: DSpark only)."""
    whole = capture(v41_release, long_data, tmp_path / "whole", "off", num_rows=2, layer_ids=V41_LAYER_IDS)
    assert int(whole["loss_mask"][:, SEQ_LENGTH // 2:].sum()) > 0, "the rows are long: supervised tokens past S/2"
    for chunk in (256, 300):
        ours = capture(v41_release, long_data, tmp_path / f"c{chunk}", chunk, num_rows=2, layer_ids=V41_LAYER_IDS)
        assert_equal_caches(ours, whole, f"dspark {chunk}", "deepseek_v41")


def test_plan_counts_the_state_v41s_carriers_hold(v41_release):
    """plan's carried state at S is what V4.1's carriers hold after a real chunked forward's last chunk, to the
    byte: window tails (which do not grow), compressed KV and index keys (which grow with S), Engram's context."""
    from ds_capture.sizing.carried_state import carried_state_bytes

    target, counted, carriers = counted_and_carried(v41_release, nemo_v41_release, 384, vocab=60)
    seq_length = 384
    state = [t for c in carriers for t in (getattr(c, "window_kv", None), getattr(c, "compressed_kv", None),
                                           getattr(c, "index_keys", None), getattr(c, "context", None))
             if t is not None]
    real = sum(t.numel() * t.element_size() for t in state)
    assert sorted(type(c).__name__ for c in carriers) == ["CsaCarrier"] * 6 + ["EngramContextCarrier"]
    assert counted.bytes_per_row == real, (counted, real)
    growing = sum(t.numel() * t.element_size() for c in carriers for t in (getattr(c, "compressed_kv", None),
                                                                          getattr(c, "index_keys", None))
                  if t is not None)
    assert carried_state_bytes(target, 2 * seq_length, 4).bytes_per_row == real + growing


@pytest.mark.slow  # in CI, configs/deepseek_v41.yaml's plan header holds both runs (tests/unit/test_plan_recipes.py)
@pytest.mark.parametrize("world_size, gpu_memory_gib", [(16, 79.6), (8, 131.3)])
def test_v41_flash_rows_of_128k_tokens_fit_its_4k_gpus_in_chunks(world_size, gpu_memory_gib):
    """``ds-capture plan`` at release size (configs/deepseek_v41.yaml's layout, bf16, one row of 131,072 tokens):
    whole rows need terabytes (the dense bias is ``[64, S, 2 S + 1]`` fp32), while ``auto``'s chunk fits the GPUs of
    today's 4K rows: no term of the chunk's attention grows with S squared."""
    from ds_capture.recipe.config import load_config
    from ds_capture.sizing.command import plan_capture

    repo = Path(__file__).resolve().parents[2]
    seq_length = 131072

    def plan(setting):
        cfg = load_config(repo / "configs" / "deepseek_v41.yaml", [
            f"recipe_args.target_model_name_or_path={repo / 'tests/fixtures/release_configs/deepseek_v41'}",
            f"distributed.ep_size={world_size}", f"recipe_args.seq_length={seq_length}",
            f"capture.chunked_prefill={setting}"])
        return plan_capture(cfg, world_size=world_size, gpu_memory_gib=gpu_memory_gib, suggest=False,
                            count_dataset=False)

    whole, chunked = plan("off"), plan("auto")
    assert not whole.fits and whole.worst.activation_bytes > 2 ** 40
    assert chunked.fits and chunked.chunk_tokens and chunked.chunk_tokens % 2 == 0, chunked.reason()
    assert chunked.carried_state["how"] == "declared"


def test_a_mask_with_padding_before_content_is_refused_and_right_padding_is_dropped():
    """A client's mask (serve) under a NeMo family's chunks: right padding is dropped (content never sees it), padding
    before content is refused before any chunk runs."""
    from ds_capture.capture.chunked import forward_in_chunks
    from ds_capture.errors import CaptureError

    ids = torch.ones(2, 8, dtype=torch.int64)
    left = torch.tensor([[1] * 8, [0, 0] + [1] * 6])
    with pytest.raises(CaptureError) as caught:
        forward_in_chunks(torch.nn.Identity(), {"input_ids": ids, "attention_mask": left}, 4, {},
                          carriers={"Identity": "builtins:object"})
    assert str(caught.value) == (
        "capture.chunked_prefill: a row of this request has padding before its content (attention_mask 0 then 1), "
        "which the chunked prefill of a NeMo-built target cannot carry. Send right-padded rows (content first), or "
        "set capture.chunked_prefill: off.")
    model = _Recorder()
    right = torch.tensor([[1] * 8, [1] * 6 + [0, 0]])
    forward_in_chunks(model, {"input_ids": ids, "attention_mask": right}, 4, {"logits_to_keep": 1},
                      carriers={"_Inner": f"{__name__}:_CountingCarrier"})
    # Two chunks of 4, without the mask, each through a carrier of the row; the module's own forward is back after.
    assert model.seen == [(4, ["logits_to_keep"]), (4, ["logits_to_keep"])]
    assert _CountingCarrier.chunks_seen == [1, 2] and "forward" not in vars(model.inner)


class _Inner(torch.nn.Module):
    def forward(self, x):
        raise AssertionError("the carrier forwards this module during the chunks")


class _Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner, self.seen = _Inner(), []

    def forward(self, input_ids, **kwargs):
        self.seen.append((input_ids.shape[1], sorted(kwargs)))
        return self.inner(input_ids)


class _CountingCarrier:
    chunks_seen: list[int] = []

    def __init__(self, module, row_tokens) -> None:
        self.chunks = 0

    def forward(self, x):
        self.chunks += 1
        _CountingCarrier.chunks_seen.append(self.chunks)
        return x
