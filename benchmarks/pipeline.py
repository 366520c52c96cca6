"""The whole path on CPU: regenerate, capture (offline, or online through ``serve``), NeMo trains a drafter, tau.

    python3 scripts/dev.py pipeline                  # the figures of README "The pipeline proves its worth"
    python benchmarks/pipeline.py [--out-dir outputs/pipeline] [--train-rows 96] [--heldout-rows 24] [--epochs 10]

1. The target: the demo architecture trained on the bundled conversations, their answers in a style of its own
   (``ds_capture.demo.ensure_trained_demo_target``, ``restyle``: a fixed table of word swaps, so that the bundled
   answers stand for a dataset another model wrote; cached by fingerprint; its gate: mean greedy top-1 probability
   >= 0.5 on held-out prompts). The split is fixed, within ``ds_capture.demo.HELD_OUT_ROWS`` (rows the target never
   saw, so the original answers are not ones it has memorised): the drafters' training rows are its first
   ``--train-rows``, the held-out rows its last ``--heldout-rows``.
2. ``ds-capture regenerate`` (greedy) against one ``transformers serve`` of that target rewrites both, the
   held-out rows first (so that the drafter of the original answers trains while the training rows regenerate).
3. ``ds-capture run`` into three EAGLE-3 caches, fp32, the full vocabulary as the draft vocabulary: the original
   training rows, the regenerated training rows, the regenerated held-out rows. fp32 because NeMo trains from a
   bf16 cache only on CUDA: on CPU its fp32 draft meets the bf16 states and fails with ``expected m1 and m2 to
   have the same dtype``.
4. NeMo's own ``train_eagle3`` (benchmarks/pipeline_nemo.py, one process each, the same seed, epochs and batch
   order) from each training cache; then once more with ``target_model_backend: remote`` against ``ds-capture
   serve`` of the target, on the regenerated training rows.
5. Tau (accepted tokens per verification step, ``--draft-tokens`` drafted) for the untrained drafter and the
   three trained ones, on the same held-out rows (the regenerated ones: the target's own answers), by NeMo's
   ``simulated_accept_length`` over the held-out cache and by an independent greedy speculative decoder verifying
   from every position of those rows (benchmarks/pipeline_nemo.py says how each is computed; ``--free-running``
   adds a free-running decoder's figure, another quantity).

Writes ``acceptance.json`` (target_top1, draft_tokens, tau: {untrained, original, regenerated, online} ->
{nemo, decoder}, steps, seconds: {total, cpu, stages: name -> [seconds, start, end], nemo: per drafter}, the
gaps, per-depth counts and curves) and ``acceptance.png`` (tau against training steps, original beside
regenerated) under ``--out-dir``; the work files go to ``--out-dir``/work.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout: the package, tests/regenerate/server.py, tests/serve_support.py

from ds_capture import demo  # noqa: E402

AUX_LAYER_IDS = [1, 2, 3]  # the demo has 4 layers; NeMo's default [1, L//2-1, L-4] needs L >= 7
SEQ_LENGTH = 256


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "HF_HUB_OFFLINE": "1"}


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def capture_recipe(target: Path, data: Path, cache: Path) -> dict:
    return {
        "cache_kind": "eagle3", "engine": "deepspeed",
        "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": str(data),
                        "cache_output_dir": str(cache), "seq_length": SEQ_LENGTH, "micro_batch_size": 8,
                        "cache_shard_size": 64, "cache_dtype": "fp32", "aux_layer_ids": AUX_LAYER_IDS,
                        "mask_generation_prompt": False, "mask_reasoning_content": False},
        "capture": {"compute_dtype": "fp32"},
        "dist_env": {"timeout_minutes": 5},
    }


def _write_recipe(path: Path, recipe: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(recipe))
    return path


_STARTED: list[subprocess.Popen] = []  # every background process, ended on any way out of run()


class Clock:
    """Seconds since the pipeline started; each stage's start and end, a background one's end stamped by a thread
    waiting on it (so a stage is timed by when it ended, not by when the pipeline looked)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.spans: dict[str, list[float]] = {}

    def now(self) -> float:
        return round(time.perf_counter() - self.started, 1)

    def begin(self, name: str) -> None:
        self.spans[name] = [self.now()]

    def end(self, name: str) -> None:
        self.spans[name].append(self.now())
        print(f"[pipeline] {name}: {self.spans[name][1] - self.spans[name][0]:.1f} s (at {self.now()} s)", flush=True)

    def watch(self, name: str, process: subprocess.Popen) -> subprocess.Popen:
        self.begin(name)
        threading.Thread(target=lambda: (process.wait(), self.end(name)), daemon=True).start()
        return process


def _start(command: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as out:
        _STARTED.append(subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=env or _env()))
    return _STARTED[-1]


def _capture(target: Path, work: Path, name: str, data: str) -> subprocess.Popen:
    """``ds-capture run`` of ``data`` into ``work/cache_NAME`` (fp32, the full vocabulary), in the background."""
    recipe = _write_recipe(work / f"capture_{name}.yaml", capture_recipe(target, work / data, work / f"cache_{name}"))
    return _start([sys.executable, "-m", "ds_capture", "run", "-c", str(recipe), "--no-progress"],
                  work / f"capture_{name}.log")


def _regenerate(args, server, work: Path, name: str) -> subprocess.Popen:
    """``ds-capture regenerate`` (greedy) of ``work/NAME.jsonl`` against ``server``, in the background."""
    return _start([sys.executable, "-m", "ds_capture", "regenerate", "--data", str(work / f"{name}.jsonl"),
                   "--output", str(work / f"{name}.regenerated.jsonl"), "--url", server.url, "--model",
                   str(args.target), "--max-tokens", str(args.max_tokens), "--temperature", "0", "--concurrency",
                   "1", "--no-progress"], work / f"regenerate_{name}.log")


def _finish(process: subprocess.Popen, work: Path, what: str, log: str) -> None:
    if process.wait():
        raise RuntimeError(f"{what} exited {process.returncode}:\n"
                           f"{(work / log).read_text(errors='replace')[-3000:]}")


def _nemo(args, work: Path, name: str, extra: list[str]) -> subprocess.Popen:
    """benchmarks/pipeline_nemo.py for one drafter, in the background (its log and result under ``work``)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "pipeline_nemo.py"), "--target", str(args.target),
               "--heldout-cache", str(work / "cache_heldout"), "--heldout-data", str(work / "heldout.regenerated.jsonl"),
               "--epochs", str(args.epochs), "--eval-every", str(args.eval_every), "--seq-length", str(SEQ_LENGTH),
               "--batch-size", str(args.batch_size), "--draft-tokens", str(args.draft_tokens), "--lr", str(args.lr),
               "--seed", str(args.seed), "--max-new-tokens", str(args.max_tokens), "--aux-layer-ids",
               *map(str, AUX_LAYER_IDS), "--out", str(work / f"{name}.json"), *extra]
    if args.free_running:
        command.append("--free-running")
    # One thread each: the drafters train side by side (and beside regenerate's server) on a few cores.
    return _start(command, work / f"{name}.log", {**_env(), "OMP_NUM_THREADS": "1"})


def _wait(process: subprocess.Popen, work: Path, name: str) -> dict:
    _finish(process, work, f"NeMo's training of the {name} drafter", f"{name}.log")
    return json.loads((work / f"{name}.json").read_text())


def run(args) -> dict:
    try:
        return _run(args)
    finally:
        for process in _STARTED:
            if process.poll() is None:
                process.kill()
                process.wait()
        _STARTED.clear()


def _split(args, work: Path) -> tuple[list[dict], list[dict]]:
    rows = demo.demo_rows()
    unseen = rows[demo.HELD_OUT_ROWS.start: demo.HELD_OUT_ROWS.stop]  # rows the target was never trained on
    if args.train_rows + args.heldout_rows > len(unseen):
        raise SystemExit(f"--train-rows + --heldout-rows: at most {len(unseen)} (ds_capture.demo.HELD_OUT_ROWS)")
    train_rows, heldout_rows = unseen[: args.train_rows], unseen[len(unseen) - args.heldout_rows:]
    _write_jsonl(work / "train.jsonl", train_rows)
    _write_jsonl(work / "heldout.jsonl", heldout_rows)
    return train_rows, heldout_rows


def _run(args) -> dict:
    from tests.regenerate.server import TransformersServe
    from tests.serve_support import ServiceProcess

    clock = Clock()
    out_dir = args.out_dir
    work = out_dir / "work"
    work.mkdir(parents=True, exist_ok=True)
    for stale in work.iterdir():  # every run from scratch (regenerate and run would continue / refuse otherwise)
        subprocess.run(["rm", "-rf", str(stale)], check=True)

    clock.begin("target")
    if args.target is None:
        print("[pipeline] the trained demo target (trained once, then cached: a few minutes the first time)",
              flush=True)
        args.target = demo.ensure_trained_demo_target()
    top1 = demo.trained_target_top1(args.target) if (args.target / "ds_capture_trained.json").is_file() else None
    clock.end("target")
    train_rows, heldout_rows = _split(args, work)

    # The stages overlap where their inputs allow (a few cores): the original rows are captured while the server
    # starts; the held-out rows are regenerated first, so that the drafter trained on the original answers trains
    # while the server regenerates the training rows; each other drafter trains as soon as its cache is written;
    # ds-capture serve starts beside the capture of the regenerated rows.
    capture = {"original": clock.watch("capture_original", _capture(args.target, work, "original", "train.jsonl"))}
    training = {}
    clock.begin("transformers_serve_start")
    with TransformersServe(args.target, work, threads=1) as server:
        clock.end("transformers_serve_start")
        regenerating = clock.watch("regenerate_heldout", _regenerate(args, server, work, "heldout"))
        _finish(regenerating, work, "ds-capture regenerate of the held-out rows", "regenerate_heldout.log")
        regenerating = clock.watch("regenerate_train", _regenerate(args, server, work, "train"))
        capture["heldout"] = clock.watch("capture_heldout", _capture(args.target, work, "heldout",
                                                                     "heldout.regenerated.jsonl"))
        for name in ("heldout", "original"):
            _finish(capture.pop(name), work, f"ds-capture run of the {name} rows", f"capture_{name}.log")
        training["original"] = clock.watch("nemo_original", _nemo(args, work, "original", [
            "--cache", str(work / "cache_original"), "--untrained"]))
        _finish(regenerating, work, "ds-capture regenerate of the training rows", "regenerate_train.log")
    capture["regenerated"] = clock.watch("capture_regenerated", _capture(args.target, work, "regenerated",
                                                                         "train.regenerated.jsonl"))
    clock.begin("serve_start")
    serve_recipe = capture_recipe(args.target, work / "train.regenerated.jsonl", work / "unused")
    serve = ServiceProcess(_write_recipe(work / "serve.yaml", serve_recipe), wait=False)
    try:
        _finish(capture.pop("regenerated"), work, "ds-capture run of the regenerated rows",
                "capture_regenerated.log")
        training["regenerated"] = clock.watch("nemo_regenerated", _nemo(args, work, "regenerated", [
            "--cache", str(work / "cache_regenerated")]))
        serve.wait_healthy(300)
        clock.end("serve_start")
        training["online"] = clock.watch("nemo_online", _nemo(args, work, "online", [
            "--remote-url", serve.url, "--data", str(work / "train.regenerated.jsonl")]))
        results = {name: _wait(process, work, name) for name, process in training.items()}
    finally:
        serve.stop()
        (work / "serve.log").write_text(serve.log())
    report = _report(args, results, top1, len(train_rows), len(heldout_rows))
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = resource.getrusage(resource.RUSAGE_SELF)
    report["seconds"] = {
        "total": clock.now(),
        "cpu": round(children.ru_utime + children.ru_stime + own.ru_utime + own.ru_stime, 1),
        "stages": {name: [round(span[1] - span[0], 1), span[0], span[1]] for name, span in clock.spans.items()},
        "nemo": {name: results[name]["seconds"] for name in results},
        "load_average": [round(load, 2) for load in os.getloadavg()],
    }
    (out_dir / "acceptance.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, out_dir / "acceptance.png")
    return report


def _report(args, results: dict, top1, train_rows: int, heldout_rows: int) -> dict:
    drafters = {"untrained": results["original"]["untrained"],
                **{name: results[name]["trained"] for name in ("original", "regenerated", "online")}}
    tau = {}
    for name, measured in drafters.items():
        tau[name] = {"nemo": round(measured["nemo"]["tau"], 4), "decoder": round(measured["decoder"]["tau"], 4)}
        if "free_running" in measured:
            tau[name]["free_running_decoder"] = measured["free_running"]["tau"]
    return {
        "target_top1": top1,
        "draft_tokens": args.draft_tokens,
        "tau": tau,
        "steps": results["regenerated"]["steps"],
        "seconds": None,  # filled in by _run
        "gaps": {
            method: {"trained_minus_untrained": round(tau["original"][method] - tau["untrained"][method], 4),
                     "regenerated_minus_original": round(tau["regenerated"][method] - tau["original"][method], 4),
                     "online_minus_regenerated": round(tau["online"][method] - tau["regenerated"][method], 4)}
            for method in ("nemo", "decoder")},
        "methods_apart": {name: round(abs(tau[name]["nemo"] - tau[name]["decoder"]), 4) for name in tau},
        "per_depth": {name: {"nemo": {key: measured["nemo"][key] for key in ("hits", "valid")},
                             "decoder": {key: measured["decoder"][key] for key in ("hits", "valid")}}
                      for name, measured in drafters.items()},
        "decoder": {name: {key: measured["decoder"][key] for key in
                           ("anchors", "anchors_off_greedy_path", "proposal_checks")}
                    for name, measured in drafters.items()},
        "heldout_rows_in_cache": results["original"]["heldout_rows_in_cache"],
        "curves": {name: results[name]["curve"] for name in ("original", "regenerated", "online")},
        "loss": {name: [round(results[name]["first_loss"], 4), round(results[name]["last_loss"], 4)]
                 for name in results},
        "settings": {"train_rows": train_rows, "heldout_rows": heldout_rows, "epochs": args.epochs,
                     "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                     "max_tokens": args.max_tokens, "seq_length": SEQ_LENGTH, "cache_dtype": "fp32",
                     "draft_vocab": "full", "aux_layer_ids": AUX_LAYER_IDS, "cpus": os.cpu_count()},
    }


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    styles = {"original": ("trained on the original answers", "tab:gray", "o"),
              "regenerated": ("trained on the regenerated answers", "tab:blue", "s"),
              "online": ("regenerated, online through ds-capture serve", "tab:orange", "")}
    for name, (label, color, marker) in styles.items():
        curve = report["curves"][name]
        ax.plot([p["step"] for p in curve], [p["nemo"] for p in curve], label=label, color=color, marker=marker,
                markersize=3, linestyle="--" if name == "online" else "-", linewidth=1.2)
        final = report["tau"][name]["decoder"]
        ax.scatter([curve[-1]["step"]], [final], color=color, marker="x", s=50, zorder=3)
    ax.set_xlabel("NeMo train_eagle3 optimizer steps")
    ax.set_ylabel(f"tau: tokens per verification ({report['draft_tokens']} drafted)")
    ax.set_title("Held-out acceptance length of the demo's drafter (CPU)\n"
                 "lines: NeMo simulated_accept_length; x: greedy speculative decoder, every position", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "outputs" / "pipeline")
    parser.add_argument("--target", type=Path, default=None,
                        help="another target checkpoint (default: the trained demo target, built once)")
    parser.add_argument("--train-rows", type=int, default=96)
    parser.add_argument("--heldout-rows", type=int, default=24)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64, help="regenerate's --max-tokens (and the decoder's)")
    parser.add_argument("--free-running", action="store_true",
                        help="also measure each trained drafter by free-running decoding (slower; another quantity)")
    args = parser.parse_args(argv)
    report = run(args)
    print(json.dumps({key: report[key] for key in ("target_top1", "draft_tokens", "tau", "steps", "seconds")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
