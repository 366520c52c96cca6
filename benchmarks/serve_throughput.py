"""The capture service's throughput: tokens/s served vs ``run``'s loop, and NeMo's trainer steps/s remote vs colocated.

In: the demo target (``ds_capture.demo.ensure_demo_target``) and the bundled demo conversations. Out: one JSON object
on stdout, every figure side by side from one run (medians of ``--repeats``, interleaved so drift hits both):

- ``run``: ``run_capture`` (``cache_kind: eagle3``, the full vocabulary as the draft vocabulary) over the first
  ``--samples`` rows: its capture loop's tokens/s (forwards, supervision, asynchronous shard writes).
- ``serve``: one ``ds-capture serve`` process over the same target, sent exactly the micro-batches ``run`` forwards
  (``capture.micro_batches.plan_micro_batches``: the same rows, lengths and order) as ``generate`` requests over HTTP, by one
  client with one request in flight (NeMo's client: one per server) and by two clients at once; tokens/s from the
  first request to the last answer. ``ratio`` = serve (one client) / run (goal >= 0.95).
- ``trainer``: NeMo 0.7.0's ``TrainEagle3Recipe`` (tools/nemo_oracle/train_eagle3.py, one epoch over
  ``--trainer-rows`` rows) steps/s with ``colocated`` and with ``remote`` (``target_prefetch_depth`` 1) against the
  service, and two remote trainers at once (their steps/s summed) vs one: both against one service, and each
  against a service of its own (one URL per data-parallel replica, what docs/serve.md recommends).

Tokens are the rows' non-padding tokens. CPU, fp32; the service, the client and the trainers share this host's
cores, as they would share a node. Run it with:

    DS_CAPTURE_HOME=/tmp/ds_capture_home python benchmarks/serve_throughput.py [--samples 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # runs from a checkout without `pip install -e .`


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-rows", type=int, default=64)
    parser.add_argument("--trainer-seq-length", type=int, default=256)
    parser.add_argument("--trainer-repeats", type=int, default=3, help="0: no trainer figures")
    parser.add_argument("--port", type=int, default=18611)
    args = parser.parse_args()

    import httpx

    from ds_capture.data.tokenization import read_conversations
    from ds_capture.demo import demo_data_path, ensure_demo_target
    from ds_capture.recipe.config import load_config
    from ds_capture.capture.micro_batches import plan_micro_batches
    from ds_capture.runner import run_capture
    from ds_capture.serve.wire import encode

    target_dir = ensure_demo_target()
    split = f"train[:{args.samples}]"
    work = Path(tempfile.mkdtemp(prefix="serve_throughput-"))

    def recipe(path: Path, out: str) -> Path:
        path.write_text(yaml.safe_dump({"cache_kind": "eagle3", "recipe_args": dict(
            target_model_name_or_path=str(target_dir), train_data_path=str(demo_data_path()), train_split=split,
            cache_output_dir=out, seq_length=args.seq_length, micro_batch_size=args.micro_batch_size,
            cache_shard_size=args.shard_size, cache_dtype="fp32", aux_layer_ids=[1, 2, 3]),
            "capture": {"compute_dtype": "fp32"}}))
        return path

    # run's own micro-batches of these rows (the runner's tokenisation, length sorting and padding).
    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import resolve_chat_template, tokenize_conversations

    cfg = load_config(recipe(work / "plan.yaml", str(work / "unused")))
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    rows = tokenize_conversations(read_conversations(str(demo_data_path()), split=split, shuffle_seed=42), tokenizer,
                                  chat_template=resolve_chat_template(tokenizer, None), seq_length=args.seq_length,
                                  mask_reasoning_content=False, mask_generation_prompt=False)
    num_tokens = int(rows.num_tokens.sum())
    bodies = []
    for lo in range(0, len(rows.input_ids), args.shard_size):
        shard = tuple(t[lo:lo + args.shard_size] for t in (rows.input_ids, rows.loss_mask, rows.num_tokens))
        for batch in plan_micro_batches(lo // args.shard_size, shard, args.micro_batch_size, args.seq_length,
                                        cfg.capture):
            ids = batch.input_ids[:, :batch.length]
            content = (torch.arange(batch.length)[None, :] < batch.num_tokens[:, None]).to(torch.int64)
            bodies.append(encode({"input_ids": ids, "attention_mask": content,
                                  "loss_mask": batch.loss_mask[:, :batch.length].to(torch.int64)}))
    vocab_size = int(json.loads((Path(target_dir) / "config.json").read_text())["vocab_size"])
    mapping = encode({"selected_token_ids": torch.arange(vocab_size),
                      "selected_token_mask": torch.ones(vocab_size, dtype=torch.bool)})

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(work / "serve.log", "wb")
    service = subprocess.Popen([sys.executable, "-m", "ds_capture", "serve", "-c", str(work / "plan.yaml"),
                                "--port", str(args.port), "--log-interval", "0"], env=env, stdout=log,
                               stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{args.port}"
    try:
        _wait_healthy(url, service)

        def serve_once(clients: int) -> float:
            sessions = [httpx.Client(base_url=url, timeout=300) for _ in range(clients)]
            for client in sessions:
                assert client.post("/set_vocab_mapping", content=mapping).status_code == 200
            started = time.perf_counter()

            def send(index: int) -> None:
                for body in bodies[index::clients]:
                    response = sessions[index].post("/generate", content=body)
                    assert response.status_code == 200, response.text

            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(send, range(clients)))
            seconds = time.perf_counter() - started
            for client in sessions:
                client.close()
            return seconds

        def run_once(repeat: int) -> float:
            summary = run_capture(load_config(recipe(work / f"run{repeat}.yaml", str(work / f"cache{repeat}"))),
                                  show_progress=False)
            assert summary.num_tokens == num_tokens, (summary.num_tokens, num_tokens)
            # The cache (~0.5 GB of fp32 target_probs) goes, and its writeback ends, before anything else is timed:
            # measured, a service timed right after a run lost 3-5x to the kernel flushing the run's pages.
            shutil.rmtree(work / f"cache{repeat}")
            os.sync()
            return summary.capture_seconds

        serve_once(1)  # warm-up
        run_s, serve1_s, serve2_s = [], [], []
        for repeat in range(args.repeats):  # interleaved, the order alternating, so drift hits every path alike
            if repeat % 2:
                serve1_s.append(serve_once(1))
                serve2_s.append(serve_once(2))
                run_s.append(run_once(repeat))
            else:
                run_s.append(run_once(repeat))
                serve2_s.append(serve_once(2))
                serve1_s.append(serve_once(1))

        trainer = None
        if args.trainer_repeats:
            # A second service for the one-URL-per-replica figure (NeMo's remote_urls: one service per replica).
            second_log = open(work / "serve2.log", "wb")
            second = subprocess.Popen([sys.executable, "-m", "ds_capture", "serve", "-c", str(work / "plan.yaml"),
                                       "--port", str(args.port + 1), "--log-interval", "0"], env=env,
                                      stdout=second_log, stderr=subprocess.STDOUT)
            try:
                _wait_healthy(f"http://127.0.0.1:{args.port + 1}", second)
                trainer = _trainer_figures(args, target_dir, url, f"http://127.0.0.1:{args.port + 1}", work, env)
            finally:
                second.terminate()
                second.wait(30)
                second_log.close()
    finally:
        service.terminate()
        service.wait(30)
        log.close()

    run_tps = num_tokens / statistics.median(run_s)
    serve_tps = num_tokens / statistics.median(serve1_s)
    print(json.dumps({
        "target": str(target_dir), "model_type": "qwen3_moe", "samples": len(rows.input_ids),
        "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size, "requests": len(bodies),
        "tokens": num_tokens, "dtype": "fp32", "threads": torch.get_num_threads(), "repeats": args.repeats,
        "run": {"seconds": _r(run_s), "median_tokens_per_s": round(run_tps, 1)},
        "serve_one_client": {"seconds": _r(serve1_s), "median_tokens_per_s": round(serve_tps, 1)},
        "serve_two_clients": {"seconds": _r(serve2_s),
                              "median_tokens_per_s": round(num_tokens / statistics.median(serve2_s), 1)},
        "ratio": round(serve_tps / run_tps, 3), "goal_ratio": 0.95,
        "trainer": trainer,
    }, indent=2))


def _trainer_figures(args, target_dir: Path, url: str, second_url: str, work: Path, env: dict) -> dict:
    from ds_capture.demo import demo_data_path

    data = work / "trainer_rows.jsonl"
    data.write_text("".join(demo_data_path().read_text().splitlines(keepends=True)[:args.trainer_rows]))
    oracle = ROOT / "tools" / "nemo_oracle" / "train_eagle3.py"
    common = ["--target", str(target_dir), "--data", str(data), "--seq-length", str(args.trainer_seq_length),
              "--batch-size", "2", "--aux-layer-ids", "1", "2", "3", "--draft-vocab-size", "1024"]

    def trainer(*extra: str) -> dict:
        result = subprocess.run([sys.executable, str(oracle), *common, *extra], capture_output=True, text=True,
                                env=env, timeout=1800)
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def two_at_once(urls: list[str]) -> float:
        both: list[dict] = []
        threads = [threading.Thread(target=lambda u=u: both.append(trainer("--remote-url", u, "--prefetch", "1")))
                   for u in urls]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return sum(result["steps_per_s"] for result in both)

    colocated, remote, pairs, split = [], [], [], []
    for _ in range(args.trainer_repeats):
        colocated.append(trainer()["steps_per_s"])
        remote.append(trainer("--remote-url", url, "--prefetch", "1")["steps_per_s"])
        pairs.append(two_at_once([url, url]))
        split.append(two_at_once([url, second_url]))
    return {
        "rows": args.trainer_rows, "seq_length": args.trainer_seq_length, "micro_batch_size": 2,
        "steps_per_epoch": args.trainer_rows // 2,
        "colocated_steps_per_s": _r(colocated), "remote_steps_per_s": _r(remote),
        "two_remote_trainers_total_steps_per_s": _r(pairs),
        "two_trainers_two_services_total_steps_per_s": _r(split),
        "two_services_vs_one": round(statistics.median(split) / statistics.median(pairs), 3),
        "remote_vs_colocated": round(statistics.median(remote) / statistics.median(colocated), 3),
        "two_trainers_vs_one": round(statistics.median(pairs) / statistics.median(remote), 3),
    }


def _wait_healthy(url: str, service: subprocess.Popen, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if service.poll() is not None:
            raise RuntimeError(f"the service exited with {service.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the service did not become healthy")


def _r(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


if __name__ == "__main__":
    main()
