"""The same recipe gives the same cache whatever the DeepSpeed layout: 1 process, DP=2, TP=2, EP=2, TP=2 x EP=2.

Targets: tiny random-init Qwen3-MoE and DeepSeek-V3 (hidden 64, 3 layers, 8 experts, sharded safetensors) in
every mode below; Mixtral, DeepSeek-V4, GLM-5 (glm_moe_dsa, TP through our own plan) and Kimi-K2.5 in ``bf16``
only, in the layouts their families support (``BF16_FAMILY_LAYOUTS``; their fp32 equality is
test_family_layouts.py's); the families added for today's drafters (``BF16_SLOW_FAMILY_LAYOUTS``) only with
``DS_CAPTURE_FULL=1``, as the cells ``SLOW_RUNS`` names (not launched in the CI cut).
Data: the first 10 demo conversations, seq_length 40, micro-batch 2, shards of 4 (3 shards, the last one
ragged). Every run is the real ``run_capture`` path; this file doubles as the worker that launches it
(``python test_layouts.py worker SPECS OUT``): it wraps ``ds_capture.runner.build_model`` to put a forward
hook on every router of the family (``family.moe_block`` + ``family.router``; routers return
``(logits, weights, indices)``) and a pre-hook on the model that records each forward's ``input_ids`` and
content positions (from the planned batch: the runner forwards no padding mask), then dumps per rank the
selected experts of every content token. Several recipes run in one launch (one distributed session each),
so the whole matrix costs one launch per world size.

Modes and what must hold against the single process (same mode):

* ``fp32`` (cache fp32, compute fp32): input_ids, loss_mask, target weights exact; every captured layer
  within ``max|a-b| <= 1e-5 * max(1, max|a|)`` per tensor and layer (fp32 sums of ~64 products of values
  up to ~20 reassociated by the TP all-reduce differ by a few ulps: 2^-23 * 20 ~ 2.4e-6 per rounding);
  every token's selected experts identical.
* ``bf16`` (cache bf16, ``capture.compute_dtype: bf16``): integers and weights exact. DP and EP-only:
  hidden states bit-identical and routes identical (EP runs the model's own expert math in its own
  order). With TP, row-parallel layers compute and all-reduce their partial sums in fp32 and round once
  (``deepspeed_engine.reduce_row_parallel_in_fp32``), so only the fp32 summation order differs from one
  process: every token's experts must be identical (measured: 0 flips of 1,200 / 800 routed tokens;
  AutoTP's own bf16 partial sums had flipped up to 23 of 400). Hidden states, row by row, must sit within
  ``32 * 2^-8 * max(1, max|a|)`` (32 bf16 ulps of the layer's scale; measured at most 0.0124 = ~3 ulps).
  DP and EP-only: 0 flips, 0.0 difference. Families with their own ``tp_plan`` (glm_moe_dsa, deepseek_v32) add
  no partial sums under TP either: 0 flips, 0.0 difference required.
* ``bf16auto`` (cache bf16, compute auto = fp32 on CPU): all layouts compute in fp32, so the caches are
  identical after the cast to bf16 except where an fp32 ulp-level difference crosses a bf16 rounding
  boundary: at most one bf16 ulp (``2^-8 * max(1, max|a|)``) and at most 1% of the elements (measured:
  with TP, 27 of 25,600 elements (0.11%) of the post-norm layer differ by exactly one ulp; DP, EP: 0).

The measured figures are printed by ``test_print_measured_figures`` (run with ``-s``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from pathlib import Path

if __name__ != "__main__":
    import pytest

    sys.path.insert(0, str(Path(__file__).resolve().parent))

HERE = Path(__file__).resolve()
MODEL_TYPES = ("qwen3_moe", "deepseek_v3")
MODES = {  # mode -> (cache_dtype, capture.compute_dtype)
    "fp32": ("fp32", "auto"),
    "bf16": ("bf16", "bf16"),
    "bf16auto": ("bf16", "auto"),
}
LAYOUTS = {  # layout -> (world, tp_size, ep_size)
    "dp2": (2, 1, 1),
    "tp2": (2, 2, 1),
    "ep2": (2, 1, 2),
    "tp2ep2": (4, 2, 2),  # EP groups = TP groups: experts and attention each split 2 ways, 2 replicas
    "tp2ep4": (4, 2, 4),  # experts over all 4 ranks, attention over 2: the 4-way TP x EP layout
}
# Every other MoE family, bf16 compute only, in the layouts it supports (test_family_layouts.py checks fp32):
# every token's experts identical to the single process. Targets from test_families' builder (release key
# layouts; DeepSeek-V4's hash routes randomised), 4 layers.
BF16_FAMILY_LAYOUTS = {
    "mixtral": ("ep2", "tp2ep2"),
    "deepseek_v4": ("ep2", "tp2ep2"),  # TP: our own plan (heads, sinks, grouped o_a_proj; o_b_proj gathered)
    "glm_moe_dsa": ("ep2", "tp2ep2"),  # TP: our own head-parallel MLA plan (fp32 o_proj / down_proj reduction)
    "kimi_k25": ("ep2", "tp2ep2"),
}
# The other families added for today's drafters: slow (deselected, and not launched, unless DS_CAPTURE_FULL=1).
BF16_SLOW_FAMILY_LAYOUTS = {
    "glm5_next": ("ep2",),
    "glm4_moe": ("ep2", "tp2ep2"),
    "deepseek_v32": ("ep2", "tp2ep2"),
    **{m: ("ep2",) for m in ("qwen3_5_moe", "qwen3_next", "minimax_m2", "kimi_linear")},
    "gpt_oss": ("ep2", "tp2ep2"),  # TP: our own plan (GQA heads with their sinks; o_proj gathered)
}
FULL = os.environ.get("DS_CAPTURE_FULL") == "1"
# CI cut (run, and not launched, only with DS_CAPTURE_FULL=1): DeepSeek-V3's bf16-cache-fp32-compute mode (qwen3_moe
# keeps it in every layout), its bf16 DP-only and EP-only cells (qwen3_moe and the families keep them), and Mixtral
# (a GQA MoE as qwen3_moe).
SLOW_RUNS = {("deepseek_v3", "bf16auto", layout) for layout in LAYOUTS} | {
    ("deepseek_v3", "bf16", "dp2"), ("deepseek_v3", "bf16", "ep2"),
    *(("mixtral", "bf16", layout) for layout in BF16_FAMILY_LAYOUTS["mixtral"])}
BF16_CASES = [(m, layout) for m in MODEL_TYPES for layout in LAYOUTS] + [
    (m, layout) for m, layouts in BF16_FAMILY_LAYOUTS.items() for layout in layouts]
BF16_SLOW_CASES = [(m, layout) for m, layouts in BF16_SLOW_FAMILY_LAYOUTS.items() for layout in layouts]


def _cells(mode: str, cases) -> list:
    """``cases`` ((model_type, layout) pairs) as parameters, those in SLOW_RUNS marked slow."""
    return [pytest.param(m, layout, marks=pytest.mark.slow, id=f"{m}-{layout}") if (m, mode, layout) in SLOW_RUNS
            else pytest.param(m, layout, id=f"{m}-{layout}") for m, layout in cases]
SUPPORT_LAYOUT = {"dp2": "dp", "tp2": "tp", "ep2": "ep", "tp2ep2": "tp_x_ep"}  # names in support_matrix.json
TARGET_OVERRIDES = dict(num_hidden_layers=3)
FP32_RTOL = 1e-5
BF16_ULP = 2.0 ** -8  # bf16 has 8 significant bits: ulp(x) <= 2^-7 |x|; 2^-8 is half-ulp at the top of a binade
TP_BF16_ULPS = 32


# --------------------------------------------------------------------------- worker (runs under a launcher)


def _worker(specs_path: str, out_root: str) -> None:
    import torch

    torch.set_num_threads(1)
    import ds_capture.runner as runner
    from ds_capture.capture.micro_batches import PlannedBatch
    from ds_capture.recipe.config import load_config
    from ds_capture.target.family import get_submodule

    real_build_model = runner.build_model
    real_model_inputs = PlannedBatch.model_inputs
    records: list[dict] = []
    content_masks: list = []

    def model_inputs_with_content_mask(batch):
        content_masks[:] = [torch.arange(batch.length)[None, :] < batch.num_tokens[:, None]]
        return real_model_inputs(batch)

    PlannedBatch.model_inputs = model_inputs_with_content_mask

    def build_model_with_router_hooks(engine, target, plan, groups, **kwargs):
        model = real_build_model(engine, target, plan, groups, **kwargs)
        family = target.family
        current: dict = {}

        def pre_hook(_module, _args, kwargs):
            current.clear()
            ids = kwargs["input_ids"]
            # The runner forwards no padding mask (right padding, causal): the content positions come from the
            # planned batch; a rank's filler batch (no planned batch) has none.
            mask = content_masks.pop() if content_masks else torch.zeros_like(ids, dtype=torch.bool)
            assert mask.shape == ids.shape, (mask.shape, ids.shape)
            current.update(input_ids=ids.clone(), attention_mask=mask, routes={})
            records.append(current.copy())
            records[-1]["routes"] = current["routes"]

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        for index, layer in enumerate(get_submodule(model, family.layers)):
            block = getattr(layer, family.moe_block, None)
            if block is None or not hasattr(block, family.experts):
                continue  # a dense layer (DeepSeek-V3's first)

            def hook(_module, _args, output, index=index):
                current["routes"][index] = output[-1].detach().sort(dim=-1).values.clone()

            getattr(block, family.router).register_forward_hook(hook)
        return model

    runner.build_model = build_model_with_router_hooks
    rank = int(os.environ.get("RANK", "0"))
    specs = json.loads(Path(specs_path).read_text())
    for number, spec in enumerate(specs):
        records.clear()
        if number and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # one process has no store
            # A second process group on the first one's store hangs (keys of the destroyed group are
            # still there): each run gets its own TCP store, rank 0 hosting it on the next port. The
            # launcher reserved one port per spec (ports next to a port found free are anyone's: EADDRINUSE).
            first, count = map(int, os.environ["DS_CAPTURE_TEST_PORTS"].split(":"))
            assert count == len(specs) and int(os.environ["MASTER_PORT"]) == first + number - 1, (first, count)
            os.environ["MASTER_PORT"] = str(int(os.environ["MASTER_PORT"]) + 1)
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "False"
        # restart: a launch retried after EADDRINUSE recomputes every spec (and records every route again).
        summary = runner.run_capture(load_config(spec["config"], []), restart=True, show_progress=False)
        out = Path(out_root) / spec["name"]
        out.mkdir(parents=True, exist_ok=True)
        torch.save(records, out / f"routes.rank{rank}.pt")
        (out / f"summary.rank{rank}.json").write_text(json.dumps(dataclasses.asdict(summary)))


if __name__ == "__main__":
    _worker(sys.argv[2], sys.argv[3])
    sys.exit(0)


# --------------------------------------------------------------------------- the launches (module fixture)

import torch  # noqa: E402
import yaml  # noqa: E402
from launchers import ensure_shm_op_built, run_launcher  # noqa: E402
from support import record  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_families import family_target_builder  # noqa: E402

pytestmark = [pytest.mark.distributed]


def _recipe(path: Path, target: Path, out: Path, mode: str, tp_size: int, ep_size: int) -> Path:
    cache_dtype, compute_dtype = MODES[mode]
    recipe = {
        "engine": "deepspeed",
        "recipe_args": {
            "target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
            "train_split": "train[:10]", "cache_output_dir": str(out), "seq_length": 40,
            "micro_batch_size": 2, "cache_shard_size": 4, "cache_dtype": cache_dtype,
        },
        "distributed": {"tp_size": tp_size, "ep_size": ep_size},
        "capture": {"compute_dtype": compute_dtype, "cpu_threads": 1},  # the count is part of the bits
        "dist_env": {"timeout_minutes": 3},
    }
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def layout_runs(tiny_target, tmp_path_factory) -> Path:
    """Every (target, mode, layout) cache plus its routes, in three launches: single, world 2, world 4."""
    ensure_shm_op_built()
    root = tmp_path_factory.mktemp("layouts")
    targets = {model_type: tiny_target(model_type, **TARGET_OVERRIDES) for model_type in MODEL_TYPES}
    family_target = family_target_builder(root / "family_targets")
    runs = [(model_type, mode, layout) for model_type in MODEL_TYPES for mode in MODES for layout in ("single", *LAYOUTS)]
    for model_type, layouts in {**BF16_FAMILY_LAYOUTS, **(BF16_SLOW_FAMILY_LAYOUTS if FULL else {})}.items():
        targets[model_type] = family_target(model_type)
        runs += [(model_type, "bf16", layout) for layout in ("single", *layouts)]
    if not FULL:  # the CI cut: the slow cells, and a reference no kept cell compares with
        runs = [run for run in runs if run not in SLOW_RUNS]
        kept = {(m, mode) for m, mode, layout in runs if layout != "single"}
        runs = [(m, mode, layout) for m, mode, layout in runs if layout != "single" or (m, mode) in kept]
    by_world: dict[int, list[dict]] = {1: [], 2: [], 4: []}
    for model_type, mode, layout in runs:
        world, tp_size, ep_size = {"single": (1, 1, 1), **LAYOUTS}[layout]
        name = f"{model_type}-{mode}-{layout}"
        cfg = _recipe(root / f"{name}.yaml", targets[model_type], root / name / "cache", mode, tp_size, ep_size)
        by_world[world].append({"name": name, "config": str(cfg)})
    for world, specs in by_world.items():
        specs_path = root / f"specs_w{world}.json"
        specs_path.write_text(json.dumps(specs))
        kind = "single" if world == 1 else "torchrun"
        result = run_launcher(kind, world, [str(HERE), "worker", str(specs_path), str(root)], None, 420,
                              num_ports=len(specs))
        assert result.returncode == 0, result.stdout[-8000:]
        assert result.leftover_shm == [], result.leftover_shm
    return root


# --------------------------------------------------------------------------- comparison helpers


def _shards(cache: Path) -> list[dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    return [load_file(path) for path in sorted(cache.glob("shard-*.safetensors"))]


def _layers(shard: dict[str, torch.Tensor], manifest: dict) -> dict[str, torch.Tensor]:
    """Captured features by layer id (``target_hidden_states`` split per layer) plus ``last``."""
    hidden, size = shard["target_hidden_states"].float(), manifest["hidden_size"]
    features = {f"layer{layer_id}": hidden[..., i * size:(i + 1) * size]
                for i, layer_id in enumerate(manifest["target_layer_ids"])}
    return {**features, "last": shard["target_last_hidden_states"].float()}


def _routes(run_dir: Path) -> dict[str, dict]:
    """input_ids digest -> {"mask": [B, L] bool, "routes": {layer: [B, L, k]}} over every rank of one run."""
    found: dict[str, dict] = {}
    for path in sorted(run_dir.glob("routes.rank*.pt")):
        for entry in torch.load(path):
            ids = entry["input_ids"]
            key = hashlib.sha256(repr(tuple(ids.shape)).encode() + ids.numpy().tobytes()).hexdigest()
            batch, length = ids.shape
            routes = {layer: r.reshape(batch, length, -1) for layer, r in entry["routes"].items()}
            found.setdefault(key, {"mask": entry["attention_mask"].bool(), "routes": routes, "input_ids": ids})
    return found


def _compare_routes(got: Path, want: Path) -> dict:
    """Per MoE layer: content tokens routed, and those whose top-k expert set differs."""
    got_routes, want_routes = _routes(got), _routes(want)
    assert set(want_routes) <= set(got_routes), "a reference micro-batch was never forwarded by the layout"
    per_layer: dict[int, dict] = {}
    flips = []
    for key, ref in want_routes.items():
        mask = ref["mask"]
        for layer, indices in ref["routes"].items():
            differ = (got_routes[key]["routes"][layer] != indices).any(dim=-1) & mask
            stats = per_layer.setdefault(layer, {"tokens": 0, "flipped": 0})
            stats["tokens"] += int(mask.sum())
            stats["flipped"] += int(differ.sum())
            flips += [(key, layer, int(row), int(pos)) for row, pos in differ.nonzero().tolist()]
    # First-order flips: in the first MoE layer, or in a sequence with no flip in an earlier layer
    # (a flipped token changes its row, and later rows through attention, from that layer on).
    first_layer_of_row: dict[tuple, int] = {}
    for key, layer, row, _pos in flips:
        first_layer_of_row[(key, row)] = min(layer, first_layer_of_row.get((key, row), layer))
    first_order = [f for f in flips if f[1] == first_layer_of_row[(f[0], f[2])]]
    # A flip at (layer, position) can change only that position and later ones (causal attention, per-token
    # experts): positions before the row's earliest flipped position are unaffected on every layer.
    first_position_of_row: dict[tuple, int] = {}
    for key, _layer, row, pos in flips:
        first_position_of_row[(key, row)] = min(pos, first_position_of_row.get((key, row), pos))
    flipped_rows = {tuple(want_routes[key]["input_ids"][row].tolist()): position
                    for (key, row), position in first_position_of_row.items()}
    return {"per_layer": per_layer, "flips": flips, "first_order": first_order, "flipped_rows": flipped_rows}


def _compare_caches(got: Path, want: Path) -> dict:
    """Exact integer and weight checks, and per layer max|a-b| / max(1, max|a|)."""
    from safetensors.torch import load_file

    manifest = json.loads((want / "manifest.json").read_text())
    got_manifest = json.loads((got / "manifest.json").read_text())
    from ds_capture.cache.dspark.format import IDENTITY_FIELDS

    identity = {k: manifest[k] for k in IDENTITY_FIELDS}
    assert {k: got_manifest.get(k) for k in identity} == identity
    assert got_manifest["complete"] is True
    weights_a, weights_b = load_file(got / "target_weights.safetensors"), load_file(want / "target_weights.safetensors")
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_b)
    shards_a, shards_b = _shards(got), _shards(want)
    assert len(shards_a) == len(shards_b) == -(-manifest["num_samples"] // manifest["shard_size"])
    per_layer: dict[str, dict] = {}
    for shard_a, shard_b in zip(shards_a, shards_b):
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(shard_a[key], shard_b[key]), key
        layers_a, layers_b = _layers(shard_a, manifest), _layers(shard_b, manifest)
        for name in layers_b:
            a, b = layers_a[name], layers_b[name]
            diff = (a - b).abs()
            stats = per_layer.setdefault(name, {"max_abs": 0.0, "max_ref": 0.0, "mismatched": 0, "numel": 0})
            stats["max_abs"] = max(stats["max_abs"], float(diff.max()))
            stats["max_ref"] = max(stats["max_ref"], float(b.abs().max()))
            stats["mismatched"] += int((diff != 0).sum())
            stats["numel"] += diff.numel()
    for stats in per_layer.values():
        stats["scaled"] = stats["max_abs"] / max(1.0, stats["max_ref"])
    return per_layer


MEASURED: dict[str, dict] = {}


def _case(layout_runs: Path, model_type: str, mode: str, layout: str) -> tuple[dict, dict]:
    got, want = layout_runs / f"{model_type}-{mode}-{layout}", layout_runs / f"{model_type}-{mode}-single"
    cache = _compare_caches(got / "cache", want / "cache")
    routes = _compare_routes(got, want)
    MEASURED[f"{model_type} {mode} {layout}"] = {
        "max_scaled_diff": max(s["scaled"] for s in cache.values()),
        "max_abs_diff": max(s["max_abs"] for s in cache.values()),
        "per_layer_scaled": {k: s["scaled"] for k, s in cache.items()},
        "mismatched_elements": sum(s["mismatched"] for s in cache.values()),
        "routed_tokens": sum(s["tokens"] for s in routes["per_layer"].values()),
        "flipped_by_layer": {layer: s["flipped"] for layer, s in routes["per_layer"].items() if s["flipped"]},
    }
    return cache, routes


# --------------------------------------------------------------------------- tests


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_fp32_cache_equals_single_process(layout_runs, model_type, layout):
    cache, routes = _case(layout_runs, model_type, "fp32", layout)
    worst = max(stats["scaled"] for stats in cache.values())
    world, tp_size, ep_size = LAYOUTS[layout]
    record(model_type, "single", {"status": "equal", "max_rel_diff": 0.0, "note": "reference"})
    if layout in SUPPORT_LAYOUT:  # one layout per table cell (tp2ep4 is the second TP x EP shape)
        record(model_type, SUPPORT_LAYOUT[layout], {"status": "equal" if worst <= FP32_RTOL else "differs",
                                                    "max_rel_diff": worst, "nproc": world, "tp_size": tp_size,
                                                    "ep_size": ep_size})
    for name, stats in cache.items():
        assert stats["scaled"] <= FP32_RTOL, (name, stats)
    assert routes["per_layer"] and all(s["tokens"] > 0 for s in routes["per_layer"].values())
    assert not routes["flips"], routes["per_layer"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type, layout", [
    *_cells("bf16", BF16_CASES),
    *[pytest.param(m, layout, marks=pytest.mark.slow, id=f"{m}-{layout}") for m, layout in BF16_SLOW_CASES]])
def test_bf16_compute_same_experts_and_states(layout_runs, model_type, layout):
    cache, routes = _case(layout_runs, model_type, "bf16", layout)
    tp_size = LAYOUTS[layout][1]
    total = sum(s["tokens"] for s in routes["per_layer"].values())
    assert total > 0
    from ds_capture.target.families import FAMILIES

    if tp_size == 1 or FAMILIES[model_type].tp_plan:
        # DP and EP run the model's own math on the same rows; our own TP plans add no partial sums
        # (ds_capture.parallel.tensor_parallel.GatheredLinear): bit-identical.
        assert not routes["flips"], routes["per_layer"]
        assert all(s["max_abs"] == 0.0 for s in cache.values()), cache
        return
    # Row-parallel partial sums are reduced in fp32 and rounded once (deepspeed_engine.reduce_row_parallel_in_fp32),
    # as one process's bf16 matmul does: every token keeps the single process's experts.
    assert not routes["flips"], routes["per_layer"]
    # Row by row, on every captured layer (post-norm included): the positions before the row's earliest
    # flipped token (all of them where nothing flipped) within 32 bf16 ulps of the layer's scale.
    manifest = json.loads((layout_runs / f"{model_type}-bf16-single" / "cache" / "manifest.json").read_text())
    got_shards = _shards(layout_runs / f"{model_type}-bf16-{layout}" / "cache")
    want_shards = _shards(layout_runs / f"{model_type}-bf16-single" / "cache")
    checked_rows = 0
    for shard_a, shard_b in zip(got_shards, want_shards):
        layers_a, layers_b = _layers(shard_a, manifest), _layers(shard_b, manifest)
        for row, ids in enumerate(shard_b["input_ids"]):
            unaffected = min((position for prefix, position in routes["flipped_rows"].items()
                              if tuple(ids[:len(prefix)].tolist()) == prefix), default=len(ids))
            if unaffected == 0:
                continue
            for name in layers_b:
                a, b = layers_a[name][row, :unaffected], layers_b[name][row, :unaffected]
                bound = TP_BF16_ULPS * BF16_ULP * max(1.0, float(layers_b[name].abs().max()))
                assert float((a - b).abs().max()) <= bound, (name, row, unaffected)
            checked_rows += 1
    # DeepSeek-V3 under TP flips the first token (<|im_start|>, the same in every sample) in its first MoE
    # layer, which reaches every later position: no row prefix is left to compare there (reported instead).
    MEASURED[f"{model_type} bf16 {layout}"]["rows_compared"] = checked_rows
    MEASURED[f"{model_type} bf16 {layout}"]["first_flipped_positions"] = sorted(routes["flipped_rows"].values())
    assert checked_rows > 0 or all(p == 0 for p in routes["flipped_rows"].values())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("model_type, layout", _cells("bf16auto", [(m, layout) for m in MODEL_TYPES
                                                                   for layout in LAYOUTS]))
def test_bf16_cache_with_fp32_compute_is_identical(layout_runs, model_type, layout):
    cache, routes = _case(layout_runs, model_type, "bf16auto", layout)
    assert not routes["flips"], routes["per_layer"]
    for name, stats in cache.items():
        assert stats["scaled"] <= BF16_ULP, (name, stats)
        assert stats["mismatched"] <= 1e-2 * stats["numel"], (name, stats)


def test_print_measured_figures(layout_runs):
    """Prints every measured figure as JSON (the parametrized tests above fill MEASURED)."""
    print("\nLAYOUT_FIGURES " + json.dumps(MEASURED, sort_keys=True))
