"""Chunked prefill: time and peak memory of long rows forwarded whole vs in chunks, side by side in one run.

In: tiny targets of real architectures (``ds_capture.demo.build_tiny_target`` through the test suite's family
builder: a GQA MoE (qwen3_moe) and a DSA family (glm_moe_dsa); with ``--targets kimi_k3`` / ``deepseek_v41`` the tiny
Kimi K3 / DeepSeek-V4.1 release of ``tests/nemo_k3_release.py`` / ``tests/nemo_v41_release.py``, NeMo's class with
ds_capture's carriers), one row per length made of the bundled demo conversations joined (cycled) until it fills S.
Out: one JSON object on stdout:

- ``speed``: per target, ``run_capture``'s loop seconds (``capture_seconds``) per row, over ``--speed-rows`` rows of
  S = ``--speed-seq`` tokens in one process, for whole rows, for chunks of S/4 and for ``auto`` (no budget on a CPU:
  whole rows), each the median of ``--repeats`` runs interleaved, and
  ``ratio`` = chunked / whole (goal <= 1.15), ``auto_ratio`` = auto / whole;
- ``memory``: per target and S in ``--seqs``, the peak RSS of a fresh process capturing one row with chunks of
  ``--chunk`` (and whole rows where ``--whole-max`` allows), over the same process's RSS right after the model
  loaded, beside ``ds-capture plan``'s figures for the same recipe (``plan_growth_mb``: activations with the carried
  state, device captures, host captures and writer): the growth with S is the carried state and the captured
  output, not the activations.

With ``--latent-from 0`` GLM-5's MLA attends on the cached latent from the first chunk (as at release sizes past about
12K tokens; ``ds_capture.target.attention_sizes.LATENT_ATTENTION_FROM_BYTES``): on these tiny rows the default keeps
transformers' attention, whose CPU math kernel materialises ``[heads, C, T]`` scores that plan (sized for a GPU's
kernels) does not count. ``--overrides`` widens the tiny target (a transformers family's config keys, e.g. hidden size
1,024): on the 64-wide target a row of 2,048 tokens takes under 0.1 s, so the fixed cost of each chunk's forward
(Python over every layer and expert) weighs more than at any real width. Each measurement is its own process
(``--one``), so peaks do not leak between them. Intra-op threads: ``--threads`` (the recipes' ``capture.cpu_threads``,
default 1; the runs before 2026-12-06 left it at ``auto``, every core, though this said one thread).

    . .venv/bin/activate
    python benchmarks/chunked_prefill.py [--seqs 4096 8192 16384 32768] [--chunk 1024] [--repeats 3] [--latent-from 0]
    python benchmarks/chunked_prefill.py --targets deepseek_v41 > benchmarks/results/chunked_prefill_deepseek_v41.json
    python benchmarks/chunked_prefill.py --targets qwen3_moe --forward-only --speed-seq 8192 --repeats 7 --threads 2
    python benchmarks/chunked_prefill.py --targets qwen3_moe --seqs 2048 --whole-max 0 --speed-seq 2048 --repeats 5 \
        --overrides '{"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 512, "head_dim": 64}'
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Runs from a checkout without `pip install -e .`: the repository root holds the package.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = ("qwen3_moe", "glm_moe_dsa")
NEMO_RELEASES = {  # model_type -> the test suite's tiny release writer (NeMo's class, ds_capture's carriers)
    "kimi_k3": ("tests.nemo_k3_release", "write_tiny_k3_release"),
    "deepseek_v41": ("tests.nemo_v41_release", "write_tiny_v41_release"),
}


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def one(spec: dict) -> dict:
    """One capture of one row in this process: loop seconds, RSS after load, peak RSS."""
    import torch
    import yaml

    torch.set_num_threads(1)
    from ds_capture.target import attention_sizes

    if spec.get("latent_from") is not None:  # GLM-5's attention on the latent from this many expanded bytes on
        attention_sizes.LATENT_ATTENTION_FROM_BYTES = spec["latent_from"]
    from ds_capture.demo import demo_data_path
    from ds_capture.recipe.config import load_config
    from ds_capture.runner import run_capture
    from tests.unit.test_families import family_target_builder

    work = Path(spec["work"])
    target = _target(work / "targets", spec["model_type"], family_target_builder, spec.get("overrides") or {})
    rows = [json.loads(line) for line in demo_data_path().read_text().splitlines()]
    turns = [m for row in rows for m in row["messages"] if m["role"] in ("user", "assistant")]
    per_turn = 12  # demo turns average ~30 tokens: cycle until the row surely fills S
    needed = spec["seq"] // per_turn
    data = Path(tempfile.mkdtemp(dir=work)) / "row.jsonl"
    num_rows = spec.get("rows", 1)  # row r starts r user / assistant pairs further into the cycled turns
    lines = [json.dumps({"messages": [turns[(i + 2 * r) % len(turns)] for i in range(needed - needed % 2)]})
             for r in range(num_rows)]
    data.write_text("".join(line + "\n" for line in lines))
    out = data.parent / "cache"
    recipe = data.parent / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "recipe_args": dict(target_model_name_or_path=str(target), train_data_path=str(data), cache_output_dir=str(out),
                            seq_length=spec["seq"], micro_batch_size=1, cache_shard_size=1, cache_dtype="fp32"),
        "capture": {"chunked_prefill": spec["chunk"], "writer_buffer_mib": 0, "cpu_threads": spec.get("threads", 1)}}))
    cfg = load_config(recipe)
    import ds_capture.runner as runner

    loaded: dict = {}
    build = runner._build_model

    def build_and_measure(*args, **kwargs):
        model = build(*args, **kwargs)
        loaded["rss_mb"] = _rss_mb()
        return model

    runner._build_model = build_and_measure
    summary = run_capture(cfg, show_progress=False)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": summary.capture_seconds, "rows": num_rows, "tokens": summary.num_tokens,
            "rss_after_load_mb": round(loaded["rss_mb"], 1),
            "peak_mb": round(peak_mb, 1), "growth_mb": round(peak_mb - loaded["rss_mb"], 1), **_planned(cfg)}


def _planned(cfg) -> dict:
    """Plan's figures for the same recipe on this CPU (fp32 compute), MB: what it says grows beyond the loaded
    model (activations incl. the carried state, the captures on the device, and on the host the row's captured
    output and the writer's micro-batch), to read beside the measured growth (no flat runtime reserve on a CPU)."""
    from ds_capture.sizing.command import plan_capture

    report = plan_capture(cfg, world_size=1, gpu_memory_gib=1000, compute_dtype="fp32", suggest=False,
                          count_dataset=False)
    rank = report.ranks[0]
    terms = {term.name: term.bytes for term in report.activation_terms}
    mb = 1 << 20
    return {"plan_chunk": report.chunk_tokens, "plan_activations_mb": round(rank.activation_bytes / mb, 1),
            "plan_carried_mb": round(terms.get("carried state", 0) / mb, 1),
            "plan_largest_block": f"{report.activation_largest.name} {report.activation_largest.bytes / mb:.1f}",
            "plan_capture_device_mb": round(rank.capture_bytes / mb, 1), "plan_host_mb": round(rank.host_bytes / mb, 1),
            "plan_growth_mb": round((rank.activation_bytes + rank.capture_bytes + rank.host_bytes) / mb, 1)}


def _target(root: Path, model_type: str, family_target_builder, overrides: dict) -> Path:
    if overrides:  # a wider tiny target (--overrides): its own directory, built once
        from ds_capture.demo import build_tiny_target

        path = root / (model_type + "-" + "-".join(f"{k}{v}" for k, v in sorted(overrides.items())))
        if not (path / "config.json").is_file():
            build_tiny_target(path, model_type, seed=0, **overrides)
        return path
    if model_type not in NEMO_RELEASES:
        return family_target_builder(root)(model_type)
    import importlib

    from ds_capture.demo import demo_tokenizer

    module, writer = NEMO_RELEASES[model_type]
    path = root / model_type
    if not (path / "config.json").is_file():  # written last by both writers
        getattr(importlib.import_module(module), writer)(path, seed=0, tokenizer=demo_tokenizer())
    return path


def measure(spec: dict) -> dict:
    result = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True,
                            cwd=ROOT, timeout=3600)
    if result.returncode:
        return {"error": result.stderr.strip().splitlines()[-1][:300]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def forward_speed(model_type: str, seq: int, threads: int, repeats: int, overrides: dict) -> dict:
    """The model's forward alone, in this process: a whole row of ``seq`` demo tokens against
    :func:`~ds_capture.capture.chunked.forward_in_chunks` in chunks of ``seq // 4``, ``repeats`` times interleaved
    after a warm-up of each (no loading, hooks or writer): seconds per row, medians, ratio."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ds_capture.capture.chunked import forward_in_chunks
    from ds_capture.demo import demo_data_path
    from tests.unit.test_families import family_target_builder

    torch.set_num_threads(threads)
    path = _target(Path(tempfile.mkdtemp(prefix="chunked_forward_")), model_type, family_target_builder, overrides)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = demo_data_path().read_text()
    ids = AutoTokenizer.from_pretrained(path)(text * (1 + seq // 2000), return_tensors="pt")["input_ids"][:, :seq]
    assert ids.shape[1] == seq, "the demo text is shorter than the row"
    forwards = {"whole": lambda: model(input_ids=ids, use_cache=False, logits_to_keep=1),
                "chunked": lambda: forward_in_chunks(model, {"input_ids": ids}, seq // 4, {"logits_to_keep": 1})}
    seconds: dict[str, list[float]] = {name: [] for name in forwards}
    with torch.no_grad():
        for name, forward in [*forwards.items()] * (repeats + 1):
            started = time.perf_counter()
            forward()
            seconds[name].append(time.perf_counter() - started)
    whole, chunked = (statistics.median(seconds[name][1:]) for name in forwards)  # the first of each: warm-up
    return {"model_type": model_type, "seq": seq, "threads": threads, "overrides": overrides,
            "whole_s": seconds["whole"], "chunked_s": seconds["chunked"], "median_whole_s": whole,
            "median_chunked_s": chunked, "ratio": round(chunked / whole, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--seqs", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--whole-max", type=int, default=8192, help="largest S also captured as whole rows")
    parser.add_argument("--speed-seq", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="capture.cpu_threads of every run (its intra-op threads; the recipe's auto would take "
                             "every core)")
    parser.add_argument("--forward-only", action="store_true",
                        help="time the model's forward alone in one process (transformers families), whole vs chunks "
                             "of S/4 at --speed-seq, --repeats times interleaved; no capture, no memory rows")
    parser.add_argument("--speed-rows", type=int, default=4,
                        help="rows per speed run (one process): its start-up (first-call allocations) weighs on each "
                             "mode once, as in a capture of many rows; seconds are per row")
    parser.add_argument("--targets", nargs="+", default=list(TARGETS))
    parser.add_argument("--overrides", type=json.loads, default={},
                        help='JSON config overrides of the tiny target (transformers families), e.g. '
                             '\'{"hidden_size": 1024, "moe_intermediate_size": 512, "head_dim": 64}\'')
    parser.add_argument("--latent-from", type=int, default=None,
                        help="LATENT_ATTENTION_FROM_BYTES for the run (0: GLM-5's MLA on the latent from the first "
                             "chunk, as at release sizes past 12K tokens; default: the package's)")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    if args.forward_only:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the JSON alone (DeepSpeed logs there on import)
            rows = [forward_speed(model_type, args.speed_seq, args.threads, args.repeats, args.overrides)
                    for model_type in args.targets]
        print(json.dumps(rows, indent=2))
        return
    work = Path(tempfile.mkdtemp(prefix="chunked_prefill_"))
    report: dict = {"chunk": args.chunk, "speed_seq": args.speed_seq, "speed_rows": args.speed_rows,
                    "threads": args.threads, "latent_from": args.latent_from, "overrides": args.overrides,
                    "speed": {}, "memory": {}}
    for model_type in args.targets:
        runs: dict[str, list[float]] = {"whole": [], "chunked": [], "auto": []}
        for _ in range(args.repeats):  # interleaved, so load on the box hits all alike
            for name, chunk in (("whole", "off"), ("chunked", args.speed_seq // 4), ("auto", "auto")):
                got = measure({"work": str(work), "model_type": model_type, "seq": args.speed_seq, "chunk": chunk,
                               "latent_from": args.latent_from, "overrides": args.overrides, "rows": args.speed_rows,
                               "threads": args.threads})
                runs[name].append(got.get("seconds", float("nan")) / args.speed_rows)
        if not args.repeats:
            report["speed"][model_type] = "not measured (--repeats 0)"
        else:
            whole, chunked, auto = (statistics.median(runs[name]) for name in ("whole", "chunked", "auto"))
            report["speed"][model_type] = {"whole_s": runs["whole"], "chunked_s": runs["chunked"], "auto_s": runs["auto"],
                                           "median_whole_s": whole, "median_chunked_s": chunked,
                                           "median_auto_s": auto, "ratio": round(chunked / whole, 3),
                                           "auto_ratio": round(auto / whole, 3)}
        rows = []
        for seq in args.seqs:
            spec = {"work": str(work), "model_type": model_type, "seq": seq, "latent_from": args.latent_from,
                    "overrides": args.overrides, "threads": args.threads}
            row = {"seq": seq, "chunked": measure({**spec, "chunk": args.chunk})}
            if seq <= args.whole_max:
                row["whole"] = measure({**spec, "chunk": "off"})
            rows.append(row)
            print(json.dumps({model_type: row}), file=sys.stderr, flush=True)
        report["memory"][model_type] = rows
    report["started"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
