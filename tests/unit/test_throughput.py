"""Throughput paths change speed, never the cache: length-trimmed + sorted batches equal fixed padding at
content positions, the async writer equals the synchronous one byte for byte, a writer error stops the
run cleanly, and progress/metrics count every sample."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from ds_capture.cache.common.names import BOOKKEEPING_DIR
from ds_capture.errors import CaptureError
from ds_capture.recipe.config import load_config
from ds_capture.capture.micro_batches import plan_micro_batches
from ds_capture.runner import run_capture

NUM_SAMPLES = 13  # two full shards of 6 and a short last shard of 1
SHARD_SIZE = 6
SEQ_LENGTH = 256
FIXED = ["capture.pad_to_multiple_of=0", "capture.sort_by_length=false"]
METRICS_KEYS = {"time_s", "step", "samples_done", "tokens_done", "tokens_per_s", "write_mb_per_s",
                "writer_queue_depth", "peak_rss_mb", "peak_cuda_mb"}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory, tiny_target) -> Path:
    root = tmp_path_factory.mktemp("throughput")
    path = root / "recipe.yaml"
    path.write_text(yaml.safe_dump({"recipe_args": dict(
        target_model_name_or_path=str(tiny_target("qwen3")), train_data_path="demo:conversations",
        train_split=f"train[:{NUM_SAMPLES}]", cache_output_dir=str(root / "unused"), seq_length=SEQ_LENGTH,
        micro_batch_size=3, cache_shard_size=SHARD_SIZE, cache_dtype="fp32",
    )}))
    return path


def run(recipe: Path, out: Path, *overrides: str, show_progress: bool = False):
    cfg = load_config(recipe, overrides=[f"recipe_args.cache_output_dir={out}", *overrides])
    return run_capture(cfg, show_progress=show_progress)


def shards(out: Path) -> list[dict[str, torch.Tensor]]:
    paths = sorted(out.glob("shard-*.safetensors"))
    return [load_file(str(p)) for p in paths]


@pytest.fixture(scope="module")
def caches(recipe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One run per path: default (trimmed + sorted, async), fixed padding, and the synchronous writer."""
    root = tmp_path_factory.mktemp("caches")
    outs = {"trimmed": root / "trimmed", "fixed": root / "fixed", "sync": root / "sync"}
    run(recipe, outs["trimmed"], "capture.writer_buffer_mib=1")
    run(recipe, outs["fixed"], *FIXED)
    run(recipe, outs["sync"], "capture.writer_buffer_mib=0")
    return outs


def computed_lengths(recipe: Path, shard_index: int, rows: tuple) -> torch.Tensor:
    """Per row of one shard, the length the default (trimmed + sorted) plan forwards it at."""
    cfg = load_config(recipe)
    lengths = torch.zeros(len(rows[0]), dtype=torch.long)
    for batch in plan_micro_batches(shard_index, rows, cfg.recipe_args.micro_batch_size, SEQ_LENGTH, cfg.capture):
        lengths[batch.rows] = batch.length
    return lengths


def test_trimmed_sorted_equals_fixed_padding_at_content_positions(recipe, caches):
    """Bitwise equal wherever a row was forwarded at the full length; elsewhere equal to fp32 rounding.

    Found on this CPU (MKL, AVX2): a content position does not depend on the other rows of its batch
    (equal bitwise after sorting alone), but it does depend on how far its batch is padded: the
    attention's P @ V contracts over the key axis, and MKL (and SDPA's blocked kernel) split that axis
    into differently sized blocks for 192 keys than for 256, so the same products (plus exact zeros for
    masked keys) are summed in a different grouping. That is a few ulp at the tensor's magnitude
    (measured 6.8e-6 at |x| <= ~12 after three layers), so the tolerance is 2e-6 x the tensor's max
    magnitude, i.e. about 17 ulp of the largest value, on those rows only.
    """
    trimmed, fixed = shards(caches["trimmed"]), shards(caches["fixed"])
    assert len(trimmed) == len(fixed) == -(-NUM_SAMPLES // SHARD_SIZE)
    lengths_seen, trimmed_rows = set(), 0
    for index, (a, b) in enumerate(zip(trimmed, fixed)):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["loss_mask"], b["loss_mask"])
        num_tokens = (a["input_ids"] != 0).sum(1)  # the demo pad id 0 only pads the right end
        lengths_seen.update(int(n) for n in num_tokens)
        full = computed_lengths(recipe, index, (a["input_ids"], a["loss_mask"], num_tokens)) == SEQ_LENGTH
        trimmed_rows += int((~full).sum())
        content = (torch.arange(SEQ_LENGTH)[None, :] < num_tokens[:, None])[..., None]
        for key in ("target_hidden_states", "target_last_hidden_states"):
            x, y = a[key] * content, b[key] * content
            assert torch.equal(x[full], y[full]), key
            scale = float(y.abs().max())
            torch.testing.assert_close(x[~full], y[~full], rtol=0, atol=2e-6 * scale, msg=key)
            # The trimmed path writes 0 at every padding position, whatever it computed there.
            assert not a[key].masked_select(~content).any(), key
    # The data really exercises trimming: rows of several lengths, some forwarded shorter than S.
    assert len(lengths_seen) > 3 and trimmed_rows > 0


def test_rows_are_in_dataset_order(recipe, caches):
    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import read_conversations, resolve_chat_template, tokenize_conversations
    from ds_capture.demo import demo_data_path

    cfg = load_config(recipe)
    tokenizer = AutoTokenizer.from_pretrained(cfg.recipe_args.target_model_name_or_path)
    rows = tokenize_conversations(
        read_conversations(str(demo_data_path()), split=f"train[:{NUM_SAMPLES}]", shuffle_seed=42), tokenizer,
        chat_template=resolve_chat_template(tokenizer, None), seq_length=SEQ_LENGTH,
        mask_reasoning_content=False, mask_generation_prompt=False)
    written = torch.cat([s["input_ids"] for s in shards(caches["trimmed"])])
    assert torch.equal(written, rows.input_ids)
    # Sorting actually reorders rows within a shard (else this test proves nothing).
    first = rows.num_tokens[:SHARD_SIZE]
    assert not torch.equal(torch.sort(first, descending=True, stable=True).indices, torch.arange(SHARD_SIZE))


def test_async_and_sync_writers_give_byte_identical_shards(caches):
    names = sorted(p.name for p in caches["trimmed"].glob("shard-*.safetensors"))
    assert names == sorted(p.name for p in caches["sync"].glob("shard-*.safetensors")) and names
    for name in names:
        assert (caches["trimmed"] / name).read_bytes() == (caches["sync"] / name).read_bytes(), name


def test_metrics_and_progress_reach_num_samples(caches):
    for out in caches.values():
        lines = (out / BOOKKEEPING_DIR / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert records and all(set(r) == METRICS_KEYS for r in records)
        assert records[-1]["samples_done"] == NUM_SAMPLES
        assert [r["samples_done"] for r in records] == sorted(r["samples_done"] for r in records)


def test_progress_counts_reach_num_samples(recipe, tmp_path, monkeypatch):
    import ds_capture.capture.progress as progress

    seen = []
    real_close = progress.Progress.close

    def close(self):
        seen.append((self.global_samples, self.bar.n, self.bar.total))
        real_close(self)

    monkeypatch.setattr(progress.Progress, "close", close)
    summary = run(recipe, tmp_path / "out", "capture.metrics_interval_steps=1", show_progress=True)
    assert seen == [(NUM_SAMPLES, NUM_SAMPLES, NUM_SAMPLES)]
    assert summary.num_samples == NUM_SAMPLES and summary.num_tokens > 0


@pytest.mark.parametrize("buffer_mib", [1, 0])
def test_writer_error_stops_the_run_without_a_final_shard(recipe, tmp_path, monkeypatch, buffer_mib):
    import os

    from ds_capture.cache.common.shard_file import ShardFile

    real_write_rows = ShardFile.write_rows
    failing = 1

    def write_rows(self, rows, tensors, num_tokens):
        if self.path.name == f"shard-{failing:06d}.safetensors":
            # Fail half-way, as a full disk does: the temporary file exists when the error hits.
            assert self.tmp.exists()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.tmp))
        return real_write_rows(self, rows, tensors, num_tokens)

    monkeypatch.setattr(ShardFile, "write_rows", write_rows)
    out = tmp_path / "out"
    with pytest.raises(CaptureError, match="disk is full") as caught:
        run(recipe, out, f"capture.writer_buffer_mib={buffer_mib}")
    assert str(out) in str(caught.value)
    assert not (out / f"shard-{failing:06d}.safetensors").exists()
    assert not list(out.glob("*.tmp"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False
