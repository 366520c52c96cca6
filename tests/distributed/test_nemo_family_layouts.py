"""DeepSeek-V4.1 and Kimi K3 (NeMo AutoModel's own classes): every supported distributed layout writes the same cache
as one process, and TP is refused before any weight loads.

Each case runs the real CLI (``ds-capture run -c recipe.yaml``) on real gloo ranks forked from this process with a
launcher's environment (``_kill_helpers.run_cli_forked``), on the tiny release checkpoints (tests/nemo_v41_release.py,
tests/nemo_k3_release.py: quantized as released), 8 demo rows, S=32, fp32, and compares it with the single-process cache (tests/distributed/support.py's ``max_rel_diff``):
``input_ids`` / ``loss_mask`` exactly, hidden states within ``1e-5 * max(1, max|a|)``. EP of NeMo's GroupedExperts
(ds_capture.parallel.grouped_experts) is exact by design, so an EP cache must also be the single-process cache byte
for byte, in fp32 and in bf16 (the same expert selection: a flipped top-k in bf16 would show as a changed byte).

Layer ids: V4.1 captures at its feature module (ids ``0..L-1``, ``-1`` refused), K3 through NeMo's generic rule.
Every outcome is recorded in ``benchmarks/results/support_matrix.json`` under ``DS_CAPTURE_FULL=1`` (the table in
docs/support.md). CI keeps V4.1's fp32 EP cell, K3's bf16 EP cell, K3's fp32 cell of FSDP2's expert-parallel layout
with its MXFP4 experts kept packed (``fsdp2-ep-packed``), the same on DeepSpeed's ZeRO-3 (``zero3-ep-packed``: engine
deepspeed, zero_optimization.stage 3) with ``ds-capture compare`` between the two, and one TP refusal; the rest is
``slow`` (measured once: every cell 0.0 max relative diff, the EP caches byte-identical; FSDP2's and ZeRO-3's
expert-parallel layouts on 2 and 4 ranks, dequantized and packed, fp32 and bf16: byte-identical too).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("nemo_automodel")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from support import max_rel_diff, record, safetensors_digests  # noqa: E402

from tests.distributed import _kill_helpers as kh  # noqa: E402

from ds_capture.target.families import FAMILIES  # noqa: E402

LAYER_IDS = {"deepseek_v41": [0, 1, 2, 5], "kimi_k3": [-1, 0, 1, 3]}
DTYPES = {"fp32": {"cache_dtype": "fp32", "compute_dtype": "fp32"},
          "bf16": {"cache_dtype": "bf16", "compute_dtype": "bf16"}}

# (model_type, layout, nproc, ep_size, engine): the supported layouts checked for equality with one process.
# K3's fp32 EP cell is slow: its bf16 EP cell (in CI) runs the same split, byte for byte.
# "fsdp2-ep": engine fsdp2 with ep_size = world (routed experts expert-parallel and ignored by fully_shard, Engram
# tables row-split, every other parameter sharded): exact, so byte for byte too.
# "fsdp2-ep-packed": the same with capture.expert_storage: checkpoint (the experts kept packed as released, rebuilt
# one at a time in the forward): the dequantized path's bytes.
# "zero3-ep" / "zero3-ep-packed" (engine "zero3" here): engine deepspeed with zero_optimization.stage 3, the same
# split with DeepSpeed's ZeRO-3 partitioning every other parameter.
# K3's fsdp2-ep-packed and zero3-ep-packed cells are slow: CI's test_zero3_and_fsdp2_write_the_same_cache runs both
# and holds them to one process's bytes and to each other's.
_CI_CASES = [("deepseek_v41", "ep", 2, 2, "deepspeed")]
_SLOW_CASES = [("kimi_k3", "ep", 2, 2, "deepspeed"), ("kimi_k3", "fsdp2-ep-packed", 2, 2, "fsdp2"),
               ("kimi_k3", "zero3-ep-packed", 2, 2, "zero3"),
               *[(m, layout, 2, 2, "fsdp2") for m in sorted(LAYER_IDS) for layout in ("fsdp2-ep", "fsdp2-ep-packed")
                 if (m, layout) != ("kimi_k3", "fsdp2-ep-packed")],
               *[(m, layout, 4, 4, "fsdp2") for m in sorted(LAYER_IDS) for layout in ("fsdp2-ep", "fsdp2-ep-packed")],
               *[(m, layout, 2, 2, "zero3") for m in sorted(LAYER_IDS) for layout in ("zero3-ep", "zero3-ep-packed")
                 if (m, layout) != ("kimi_k3", "zero3-ep-packed")],
               *[(m, layout, 4, 4, "zero3") for m in sorted(LAYER_IDS) for layout in ("zero3-ep", "zero3-ep-packed")],
               *[(m, layout, 2, ep, engine) for m in sorted(LAYER_IDS)
                 for layout, ep, engine in (("dp", 1, "deepspeed"), ("fsdp2", 1, "fsdp2"))]]
EQUAL_CASES = [*_CI_CASES, *[pytest.param(*case, marks=pytest.mark.slow) for case in _SLOW_CASES]]
REFUSED_CASES = [("kimi_k3", "tp"), pytest.param("deepseek_v41", "tp", marks=pytest.mark.slow)]
# bf16 EP vs one process, bitwise: K3 in CI (12 s with its reference), V4.1 slow (17 s).
BF16_CASES = [("kimi_k3", "deepspeed", "dequantized"),
              pytest.param("deepseek_v41", "deepspeed", "dequantized", marks=pytest.mark.slow),
              *[pytest.param(m, engine, storage, marks=pytest.mark.slow) for m in sorted(LAYER_IDS)
                for engine in ("fsdp2", "zero3") for storage in ("dequantized", "checkpoint")]]


def _case_id(case) -> str:
    values = case.values if hasattr(case, "values") else case  # a pytest.param (slow) or a plain tuple
    return f"{values[0]}-{values[1]}" + (f"-{values[2]}" if len(values) > 2 and values[2] != 2 else "")


def _recipe(release: Path, out: Path, model_type: str, *, tp_size: int = 1, ep_size: int = 1,
            engine: str = "deepspeed", dtype: str = "fp32", split: str = "train[:8]",
            expert_storage: str = "dequantized") -> Path:
    recipe = out.parent / f"{out.name}.yaml"
    zero3 = {"deepspeed_config": {"zero_optimization": {"stage": 3}}} if engine == "zero3" else {}
    recipe.write_text(yaml.safe_dump({
        **zero3, "engine": "deepspeed" if engine == "zero3" else engine,
        "distributed": {"tp_size": tp_size, "ep_size": ep_size},
        "capture": {"compute_dtype": DTYPES[dtype]["compute_dtype"], "expert_storage": expert_storage,
                    "cpu_threads": 1},  # one thread per rank in every layout: the count is part of the bits
        "recipe_args": dict(target_model_name_or_path=str(release), train_data_path="demo:conversations",
                            train_split=split, cache_output_dir=str(out), seq_length=32, micro_batch_size=2,
                            cache_shard_size=2, cache_dtype=DTYPES[dtype]["cache_dtype"],
                            target_layer_ids=LAYER_IDS[model_type])}))
    return recipe


def _run(nproc: int, recipe: Path):
    return kh.run_cli_forked(nproc, recipe)


@pytest.fixture(scope="module")
def releases(tmp_path_factory) -> dict[str, Path]:
    """Both tiny releases, written once for the module."""
    from ds_capture.demo import demo_tokenizer
    from tests import nemo_k3_release, nemo_v41_release

    root = tmp_path_factory.mktemp("nemo_layout_releases")
    writers = {"deepseek_v41": nemo_v41_release.write_tiny_v41_release,
               "kimi_k3": nemo_k3_release.write_tiny_k3_release}
    return {name: writer(root / name, seed=0, tokenizer=demo_tokenizer()) for name, writer in writers.items()}


@pytest.fixture(scope="module")
def single_caches(releases, tmp_path_factory):
    """``single_caches(model_type, dtype, split) -> cache dir`` of one process, each made once for the module."""
    root = tmp_path_factory.mktemp("nemo_single_caches")
    made: dict[tuple[str, str, str], Path] = {}

    def make(model_type: str, dtype: str = "fp32", split: str = "train[:8]") -> Path:
        key = (model_type, dtype, split)
        if key not in made:
            out = root / f"{model_type}-{dtype}-{len(made)}"
            result = _run(1, _recipe(releases[model_type], out, model_type, dtype=dtype, split=split))
            assert result.returncode == 0, result.stdout[-4000:]
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="module")
def layout_caches(releases, tmp_path_factory):
    """``layout_caches(model_type, layout, nproc, ep_size, engine) -> cache dir`` (fp32), each made once for the
    module (the compare test reads the equality cells' caches)."""
    root = tmp_path_factory.mktemp("nemo_layout_caches")
    made: dict[tuple, Path] = {}

    def make(model_type: str, layout: str, nproc: int, ep_size: int, engine: str) -> Path:
        key = (model_type, layout, nproc, ep_size, engine)
        if key not in made:
            out = root / f"{model_type}-{layout}-{nproc}-{engine}"
            _run_layout(releases[model_type], out, model_type, nproc, ep_size, engine, "fp32",
                        expert_storage="checkpoint" if layout.endswith("-packed") else "dequantized")
            made[key] = out
        return made[key]

    return make


def _run_layout(release: Path, out: Path, model_type: str, nproc: int, ep_size: int, engine: str, dtype: str,
                split: str = "train[:8]", expert_storage: str = "dequantized"):
    result = _run(nproc, _recipe(release, out, model_type, ep_size=ep_size, engine=engine, dtype=dtype, split=split,
                                 expert_storage=expert_storage))
    assert result.returncode == 0, result.stdout[-6000:]
    assert not result.leftover_shm, result.leftover_shm
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is True
    producer = manifest["producer"]
    assert (producer["engine"], producer["world_size"], producer["ep_size"]) == (
        "deepspeed" if engine == "zero3" else engine, nproc, ep_size), producer


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model_type, layout, nproc, ep_size, engine", EQUAL_CASES,
                         ids=[_case_id(c) for c in EQUAL_CASES])
def test_layout_equals_single_process(releases, single_caches, layout_caches, model_type, layout, nproc, ep_size,
                                     engine):
    reference = single_caches(model_type)
    record(model_type, "single", {"status": "equal", "max_rel_diff": 0.0, "note": "reference"})
    out = layout_caches(model_type, layout, nproc, ep_size, engine)
    diff = max_rel_diff(reference, out)
    record(model_type, layout, {"status": "equal" if diff <= 1e-5 else "differs", "max_rel_diff": diff,
                                "nproc": nproc, "tp_size": 1, "ep_size": ep_size})
    assert diff <= 1e-5, (model_type, layout, diff)
    if layout != "dp":  # GroupedExperts' split is exact: the very bytes of one process
        assert safetensors_digests(out) == safetensors_digests(reference), (model_type, layout, diff)


@pytest.mark.distributed
@pytest.mark.timeout(400)
def test_zero3_and_fsdp2_write_the_same_cache(single_caches, layout_caches, capsys):
    """DeepSpeed ZeRO-3's and FSDP2's expert-parallel layouts (K3, MXFP4 experts kept packed, 2 ranks, fp32) write one
    process's cache byte for byte, and ``ds-capture compare`` (the command a user runs) finds them equal to the
    last bit."""
    from ds_capture.cli import main

    fsdp2 = layout_caches("kimi_k3", "fsdp2-ep-packed", 2, 2, "fsdp2")
    zero3 = layout_caches("kimi_k3", "zero3-ep-packed", 2, 2, "zero3")
    code = main(["compare", str(zero3), str(fsdp2), "--atol", "0", "--rtol", "0", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["equal"] is True and report["compared_tensors"], report
    assert {key: (diff["max_abs"], diff["num_mismatched"]) for key, diff in report["keys"].items()} == {
        key: (0.0, 0) for key in report["keys"]}, report["keys"]
    producers = report["bookkeeping"]["producer"]
    assert [p["engine"] for p in producers] == ["deepspeed", "fsdp2"], producers
    assert safetensors_digests(zero3) == safetensors_digests(fsdp2) == safetensors_digests(single_caches("kimi_k3"))


@pytest.mark.distributed
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model_type, engine, expert_storage", BF16_CASES)
def test_expert_parallel_bf16_is_bitwise(releases, single_caches, tmp_path, model_type, engine, expert_storage):
    """bf16 compute and cache: EP routes every token to the experts one process picks, so the bytes are the same
    (``fsdp2``: FSDP2's expert-parallel layout, the rest sharded and gathered per block)."""
    reference = single_caches(model_type, "bf16")
    out = tmp_path / "cache"
    _run_layout(releases[model_type], out, model_type, 2, 2, engine, "bf16", expert_storage=expert_storage)
    assert safetensors_digests(out) == safetensors_digests(reference), (model_type, max_rel_diff(reference, out))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("model_type", sorted(LAYER_IDS))
def test_expert_parallel_idle_rank_is_bitwise(releases, single_caches, tmp_path, model_type):
    """2 rows (one shard) over 2 EP ranks: rank 1 has no data and forwards the padding batch (V4.1's at the full
    seq_length), entering every all-to-all of rank 0's forward; rank 0's shard is one process's, byte for byte."""
    reference = single_caches(model_type, "fp32", "train[:2]")
    out = tmp_path / "cache"
    _run_layout(releases[model_type], out, model_type, 2, 2, "deepspeed", "fp32", split="train[:2]")
    assert safetensors_digests(out) == safetensors_digests(reference), (model_type, max_rel_diff(reference, out))


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("model_type, layout", REFUSED_CASES, ids=[_case_id(c) for c in REFUSED_CASES])
def test_tensor_parallelism_is_refused_before_loading(releases, tmp_path, model_type, layout):
    """On a copy of the release whose weight files are empty: any read of a weight would fail with another error
    (a supported layout on it fails naming the cut-short safetensors header), so the refusal comes before loading."""
    message = f"tp_size 2: {FAMILIES[model_type].tp_refusal}"
    release = shutil.copytree(releases[model_type], tmp_path / "release_without_weights")
    for weights in release.glob("*.safetensors"):
        weights.write_bytes(b"")
    out = tmp_path / "cache"
    result = _run(2, _recipe(release, out, model_type, tp_size=2))
    # Each rank exits 2 (a user error; torchrun would report it as its own exit code 1).
    assert result.returncode == 2, result.stdout[-4000:]
    assert f"ds-capture run: error: {message}" in result.stdout and "Traceback (most recent call last):\n  File" \
        not in result.stdout, result.stdout[-4000:]
    assert "not a readable safetensors file" not in result.stdout and not out.exists(), result.stdout[-4000:]
    record(model_type, layout, {"status": "refused", "reason": message})
