"""The prepared GPU check: layout equality on nccl in bf16, throughput with MFU, and the device-memory bound.

In:  a CUDA machine with one or more GPUs (every layout the GPU count allows is run), a writable ``--out``.
Out: one JSON object (stdout and ``--out``):
  - ``layouts``: every layout's cache (``ds-capture run`` through torchrun, ``dist_env.backend: nccl``,
    ``capture.compute_dtype: bf16``, bf16 cache) compared with the single-GPU cache by ``ds-capture compare``
    (its bf16 tolerance); tiny Qwen3-MoE for every layout, tiny DeepSeek-V3 and DeepSeek-V4 for the
    expert-parallel ones;
  - ``throughput``: tokens/s of a ~0.9B-parameter Qwen3-MoE (hidden 2048, 8 layers, 16 experts, top 2) at
    S = 2048 on one GPU (and expert-parallel over all GPUs, up to 8), and model FLOPs utilisation against the
    device's dense bf16 peak (2 x active parameters per token + causal attention, every row full length);
  - ``memory``: the same capture with ``capture.writer_buffer_mib`` 8192 and 0 (synchronous): micro-batches waiting
    to be written must hold no device memory (peak difference <= one micro-batch of states + 64 MiB), and ``ds-capture plan``'s estimate of the
    rank's peak (minus its runtime reserve) must bound the measured ``torch.cuda.max_memory_allocated``;
  - ``long_rows`` (issue 33): the tiny Kimi K3 and DeepSeek-V4.1 releases (NeMo's classes, ds_capture's chunk
    carriers) capture one row of S = 16,384 and 32,768 tokens in bf16 on one GPU, in chunks of ``LONG_ROW_CHUNK``
    and whole: the chunked cache equals the whole-row one (``ds-capture compare``, bf16 tolerance), the loop's
    tokens/s side by side, and the chunked run's ``torch.cuda.max_memory_allocated`` beside plan's estimate for
    the same recipe (minus its runtime reserve), which must bound it. A whole row that does not fit the device is
    recorded as such (V4.1's dense attention bias is quadratic in S), not a failure.
Without CUDA it prints ``{"skipped": true, ...}`` and exits 0 (benchmarks/gpu_check.sh is the entry point).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check.json [--quick] [--only long_rows]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "distributed"))

SUMMARY = re.compile(r"([\d,]+) tokens at ([\d,]+) tokens/s")
# Dense bf16 tensor-core peaks (TFLOP/s, no sparsity) by device-name substring, most specific first.
BF16_PEAK_TFLOPS = (("H200", 989.4), ("GH200", 989.4), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.4),
                    ("H800", 989.4), ("H20", 148.0), ("B200", 2250.0), ("B100", 1750.0), ("A100", 312.0),
                    ("A800", 312.0), ("L40S", 362.0), ("L40", 181.0), ("A10G", 70.0), ("A10", 125.0), ("L4", 121.0))
# name -> (world, tp, ep, engine); run when world <= the GPU count.
LAYOUTS = {"dp2": (2, 1, 1, "deepspeed"), "tp2": (2, 2, 1, "deepspeed"), "ep2": (2, 1, 2, "deepspeed"),
           "fsdp2": (2, 1, 1, "fsdp2"), "tp2_ep2": (4, 2, 2, "deepspeed"), "ep4": (4, 1, 4, "deepspeed"),
           "tp2_ep4": (4, 2, 4, "deepspeed"), "ep8": (8, 1, 8, "deepspeed"), "tp2_ep8": (8, 2, 8, "deepspeed")}
EP_ONLY_FAMILIES = ("deepseek_v3", "deepseek_v4")  # besides qwen3_moe: checked on their expert-parallel layouts
THROUGHPUT_MODEL = dict(hidden_size=2048, intermediate_size=4096, moe_intermediate_size=1024, num_hidden_layers=8,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=16,
                        num_experts_per_tok=2)
LONG_ROW_TARGETS = ("kimi_k3", "deepseek_v41")
LONG_ROW_SEQS = (16384, 32768)
LONG_ROW_CHUNK = 4096
CHECKS = ("layouts", "throughput", "memory", "long_rows")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "gpu_check.json")
    parser.add_argument("--quick", action="store_true", help="qwen3_moe layouts only, one throughput run")
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS), help="run only these checks")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        result = {"skipped": True, "ok": True, "reason": "no CUDA device here (torch.cuda.is_available() is False)"}
    else:
        result = run_checks(torch.cuda.device_count(), quick=args.quick, only=args.only)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    print(json.dumps(result, indent=2, sort_keys=True))


def run_checks(num_gpus: int, *, quick: bool, only: list[str] = CHECKS) -> dict:
    import torch

    name = torch.cuda.get_device_name(0)
    peak = next((tflops for key, tflops in BF16_PEAK_TFLOPS if key in name), None)
    started = time.perf_counter()
    found: dict = {}
    with tempfile.TemporaryDirectory(prefix="ds_capture_gpu_check_") as tmp:
        work = Path(tmp)
        if "layouts" in only:
            found["layouts"] = check_layouts(work, num_gpus, quick=quick)
        if "throughput" in only or "memory" in only:  # the memory check captures with the throughput target
            found["throughput"] = check_throughput(work, num_gpus, peak, quick=quick)
        if "memory" in only:
            found["memory"] = check_memory(work)
        if "long_rows" in only:
            found["long_rows"] = check_long_rows(work)
    ok = (all(r["equal"] for r in found.get("layouts", [])) and all(r["ok"] for r in found.get("throughput", []))
          and found.get("memory", {"ok": True})["ok"] and all(r["ok"] for r in found.get("long_rows", [])))
    return {"skipped": False, "ok": ok, "device": name, "num_gpus": num_gpus, "bf16_peak_tflops": peak, **found,
            "seconds": round(time.perf_counter() - started, 1)}


# ----------------------------------------------------------------------------------------------------------------

def _recipe(work: Path, name: str, target: Path, data: Path, *, world_tp_ep_engine=(1, 1, 1, "deepspeed"),
            seq_length: int = 256, micro_batch_size: int = 4, shard_size: int = 16, capture: dict | None = None,
            backend: str = "nccl", dtype: str = "bf16") -> Path:
    """``backend`` / ``dtype`` other than nccl / bf16: a check's dry run on a CPU (gloo, fp32)."""
    import yaml

    _, tp, ep, engine = world_tp_ep_engine
    recipe = {"engine": engine, "distributed": {"tp_size": tp, "ep_size": ep}, "dist_env": {"backend": backend},
              "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": str(data),
                              "cache_output_dir": str(work / "caches" / name), "seq_length": seq_length,
                              "micro_batch_size": micro_batch_size, "cache_shard_size": shard_size,
                              "cache_dtype": dtype},
              "capture": {"compute_dtype": dtype, **(capture or {})}}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def _run(recipe: Path, world: int, timeout_s: int = 600) -> dict:
    from launchers import run_launcher

    kind = "single" if world == 1 else "torchrun"
    started = time.perf_counter()
    result = run_launcher(kind, world, ["-m", "ds_capture", "run", "-c", str(recipe), "--no-progress"], None, timeout_s)
    found = SUMMARY.search(result.stdout)
    return {"returncode": result.returncode, "seconds": round(time.perf_counter() - started, 1),
            "tokens_per_s": float(found.group(2).replace(",", "")) if found else None,
            "num_tokens": int(found.group(1).replace(",", "")) if found else None,
            "log_tail": "" if result.returncode == 0 else result.stdout[-3000:]}


def _peak_cuda_mb(cache: Path) -> float | None:
    """The largest ``peak_cuda_mb`` a run's ``.ds_capture/metrics.jsonl`` recorded (None: none, e.g. off CUDA)."""
    metrics = cache / ".ds_capture" / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    return max((r["peak_cuda_mb"] for r in records if r.get("peak_cuda_mb") is not None), default=None)


def _compare(a: Path, b: Path) -> dict:
    import subprocess

    done = subprocess.run([sys.executable, "-m", "ds_capture", "compare", str(a), str(b), "--json"],
                          capture_output=True, text=True, cwd=REPO)
    try:
        keys = json.loads(done.stdout).get("keys", {})
        report = {key: {k: v.get(k) for k in ("max_abs", "max_rel", "ok")} for key, v in keys.items()}
    except (json.JSONDecodeError, AttributeError):
        report = {"error": (done.stdout + done.stderr)[-2000:]}
    return {"equal": done.returncode == 0, "report": report}


def check_layouts(work: Path, num_gpus: int, *, quick: bool) -> list[dict]:
    import torch

    from ds_capture.demo import build_tiny_target, demo_data_path

    results = []
    families = ("qwen3_moe",) if quick else ("qwen3_moe", *EP_ONLY_FAMILIES)
    for family in families:
        target = build_tiny_target(work / "targets" / family, family, dtype=torch.bfloat16)
        single = _recipe(work, f"{family}_single", target, demo_data_path())
        reference = _run(single, 1)
        results.append({"family": family, "layout": "single", "world": 1, "equal": reference["returncode"] == 0,
                        **reference})
        for layout, spec in LAYOUTS.items():
            world, tp, ep, engine = spec
            if world > num_gpus or (family != "qwen3_moe" and (tp > 1 or ep == 1)):
                continue
            recipe = _recipe(work, f"{family}_{layout}", target, demo_data_path(), world_tp_ep_engine=spec)
            run = _run(recipe, world)
            compared = _compare(work / "caches" / f"{family}_{layout}", work / "caches" / f"{family}_single") \
                if run["returncode"] == 0 else {"equal": False, "report": None}
            results.append({"family": family, "layout": layout, "world": world, **run, **compared})
    return results


def _long_conversations(path: Path, num_rows: int, seq_length: int) -> Path:
    """Rows long enough to be truncated at ``seq_length``: every forward computes full-length rows."""
    from ds_capture.demo import demo_data_path

    texts = [m["content"] for line in demo_data_path().read_text().splitlines() for m in json.loads(line)["messages"]
             if isinstance(m.get("content"), str)]
    blob = " ".join(texts)
    blob = blob * (1 + seq_length * 8 // max(1, len(blob)))  # long rows (issue 33's 32K) outgrow the demo's text
    with path.open("w") as out:
        for row in range(num_rows):
            start = (row * 997) % max(1, len(blob) - 1)
            body = (blob[start:] + " " + blob)[: seq_length * 8]
            out.write(json.dumps({"messages": [{"role": "user", "content": body[: len(body) // 2]},
                                               {"role": "assistant", "content": body[len(body) // 2:]}]}) + "\n")
    return path


def _model_flops_per_token(config: dict, seq_length: int) -> float:
    """2 x (non-embedding parameters a token runs through) + causal attention (QK^T and AV over S/2 keys)."""
    H, L, I, E, K = (config[k] for k in ("hidden_size", "num_hidden_layers", "moe_intermediate_size",
                                         "num_experts", "num_experts_per_tok"))
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    attention = H * q + 2 * H * kv + q * H
    experts = K * 3 * H * I + H * E  # the chosen experts + the router
    return 2 * L * (attention + experts) + 2 * 2 * L * q * seq_length / 2


def check_throughput(work: Path, num_gpus: int, peak_tflops: float | None, *, quick: bool) -> list[dict]:
    import torch

    from ds_capture.demo import build_tiny_target

    seq_length, rows = 2048, 256
    target = build_tiny_target(work / "targets" / "throughput", "qwen3_moe", dtype=torch.bfloat16,
                               **THROUGHPUT_MODEL)
    data = _long_conversations(work / "long.jsonl", rows, seq_length)
    flops_per_token = _model_flops_per_token(THROUGHPUT_MODEL, seq_length)
    results = []
    worlds = [1] + ([] if quick or num_gpus < 2 else [min(num_gpus, 8)])
    for world in worlds:
        spec = (world, 1, world, "deepspeed")
        recipe = _recipe(work, f"throughput_w{world}", target, data, world_tp_ep_engine=spec, seq_length=seq_length,
                         micro_batch_size=8, shard_size=64, capture={"pad_to_multiple_of": 0})
        run = _run(recipe, world, timeout_s=900)
        mfu = None
        if run["tokens_per_s"] and peak_tflops:
            mfu = run["tokens_per_s"] * flops_per_token / (world * peak_tflops * 1e12)
        results.append({"layout": "single" if world == 1 else f"ep{world}", "world": world, "seq_length": seq_length,
                        "ok": run["returncode"] == 0, "model_tflops_per_token": flops_per_token / 1e12,
                        "mfu": None if mfu is None else round(mfu, 4), **run})
    return results


def check_memory(work: Path) -> dict:
    """Queued shards hold no device memory, and plan's estimate bounds the measured peak."""
    from ds_capture.recipe.config import load_config
    from ds_capture.sizing.command import plan_capture

    target, data = work / "targets" / "throughput", work / "long.jsonl"
    peaks, estimate = {}, None
    for buffer_mib in (8192, 0):
        recipe = _recipe(work, f"memory_b{buffer_mib}", target, data, seq_length=2048, micro_batch_size=8,
                         shard_size=64, capture={"pad_to_multiple_of": 0, "writer_buffer_mib": buffer_mib})
        run = _run(recipe, 1, timeout_s=900)
        peaks[buffer_mib] = _peak_cuda_mb(work / "caches" / f"memory_b{buffer_mib}")
        if buffer_mib:
            report = plan_capture(load_config(recipe), world_size=1, count_dataset=False)
            estimate = report.worst.peak_bytes - report.worst.reserve_bytes
            micro_batch = 8 * 2048 * (THROUGHPUT_MODEL["hidden_size"] * (len(report.layer_ids) + 1) * 2 + 16)
        if run["returncode"]:
            return {"ok": False, "error": run["log_tail"]}
    measured = peaks[8192] * 2**20 if peaks[8192] else None
    queue_growth = (peaks[8192] - peaks[0]) * 2**20 if peaks[8192] and peaks[0] else None
    queue_ok = queue_growth is not None and queue_growth <= micro_batch + 64 * 2**20
    bound_ok = measured is not None and measured <= estimate
    return {"ok": bool(queue_ok and bound_ok), "peak_cuda_mb_buffer8192": peaks[8192], "peak_cuda_mb_sync": peaks[0],
            "queue_growth_mb": None if queue_growth is None else round(queue_growth / 2**20, 1),
            "one_micro_batch_mb": round(micro_batch / 2**20, 1), "queue_holds_no_device_memory": queue_ok,
            "plan_estimate_mb": round(estimate / 2**20, 1), "plan_bounds_measured": bound_ok,
            "measured_over_estimate": None if measured is None else round(measured / estimate, 3)}


def check_long_rows(work: Path, *, seqs=LONG_ROW_SEQS, chunk: int = LONG_ROW_CHUNK, backend: str = "nccl",
                    dtype: str = "bf16") -> list[dict]:
    """Issue 33 on the GPU: one long row of each NeMo-built family, chunked vs whole, and plan's bound."""
    import importlib

    from chunked_prefill import NEMO_RELEASES  # the tiny releases' writers, as the CPU benchmark builds them

    from ds_capture.demo import demo_tokenizer
    from ds_capture.recipe.config import load_config
    from ds_capture.sizing.command import plan_capture

    results = []
    for model_type in LONG_ROW_TARGETS:
        module, writer = NEMO_RELEASES[model_type]
        target = work / "targets" / model_type
        getattr(importlib.import_module(module), writer)(target, seed=0, tokenizer=demo_tokenizer())
        for seq in seqs:
            data = _long_conversations(work / f"long_{seq}.jsonl", 1, seq)
            runs, caches = {}, {}
            for name, setting in (("chunked", chunk), ("whole", "off")):
                label = f"long_{model_type}_{seq}_{name}"
                caches[name] = work / "caches" / label
                recipe = _recipe(work, label, target, data, seq_length=seq, micro_batch_size=1, shard_size=1,
                                 capture={"chunked_prefill": setting}, backend=backend, dtype=dtype)
                run = _run(recipe, 1, timeout_s=900)
                run["peak_cuda_mb"] = _peak_cuda_mb(caches[name])
                run["out_of_memory"] = "OutOfMemoryError" in run["log_tail"] or "out of memory" in run["log_tail"]
                if name == "chunked":
                    report = plan_capture(load_config(recipe), world_size=1, count_dataset=False)
                    run["plan_chunk"] = report.chunk_tokens
                    run["plan_estimate_mb"] = round((report.worst.peak_bytes - report.worst.reserve_bytes) / 2**20, 1)
                runs[name] = run
            chunked, whole = runs["chunked"], runs["whole"]
            compared = _compare(caches["chunked"], caches["whole"]) \
                if chunked["returncode"] == 0 and whole["returncode"] == 0 else {"equal": None, "report": None}
            bound = None if chunked["peak_cuda_mb"] is None else chunked["peak_cuda_mb"] <= chunked["plan_estimate_mb"]
            ratio = (whole["tokens_per_s"] / chunked["tokens_per_s"]
                     if whole["tokens_per_s"] and chunked["tokens_per_s"] else None)
            results.append({
                "model_type": model_type, "seq_length": seq, "chunk": chunk, "chunked": chunked, "whole": whole,
                "equal": compared["equal"], "compare": compared["report"], "plan_bounds_measured": bound,
                "chunked_time_over_whole": None if ratio is None else round(ratio, 3),
                "ok": bool(chunked["returncode"] == 0 and compared["equal"] is not False
                           and (whole["returncode"] == 0 or whole["out_of_memory"]) and bound is not False)})
    return results


if __name__ == "__main__":
    main()
