"""NeMo AutoModel 0.7.0's own DSpark precompute vs ``ds-capture run``, whole process, side by side.

In: the issue-16 workload (``write_path_workload.py``: Qwen3-MoE hidden 256, 4 layers, 192 rows of at
most 1024 tokens, ~46% real; bf16 cache, micro-batch 4, shards of 32) and a Python environment with
``nemo_automodel`` 0.7.0 (``--nemo-python``, default ``/work/nemo_venv/bin/python``). Out: one JSON
object: each side's wall-clock seconds per repeat (process start to exit, imports included), medians,
``ratio`` = NeMo / ds_capture (goal >= 2.0), both caches' sizes (logical and on disk), and the equality
check. Without NeMo it prints ``{"skipped": reason}`` and exits 0.

NeMo side: ``python -m nemo_automodel.components.speculative.precompute_dspark --device cpu ...`` with
one change, the one NeMo's own CPU functional test makes: its model loader (``NeMoAutoModelForCausalLM``,
CUDA-only) is swapped for ``transformers.AutoModelForCausalLM``. NeMo computes in fp32 on CPU, as
ds_capture's ``compute_dtype: auto`` does. Repeats are interleaved (NeMo, ds_capture, NeMo, ...) into
fresh directories, so machine-load drift hits both alike.

Equality is checked inside NeMo's environment with NeMo's own reader (``CachedDSparkDataset``, lazy
``safe_open`` slices over mmap, which is what training uses), reading both caches: ``input_ids`` and
``loss_mask`` must be equal, hidden states equal at content positions within one bf16 ulp (both sides cast
an fp32 forward; ds_capture computes each micro-batch at its own trimmed length, so the fp32 sums can
differ in their last bits: per token and captured layer, ``max |a - b|`` is at most one bf16 ulp of that
feature vector's largest element), and every manifest identity field and the target weights must be equal.

    python benchmarks/vs_nemo.py [--repeats 3] [--root /tmp/ds_capture_vs_nemo] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from write_path_workload import CACHE_DTYPE, MICRO_BATCH_SIZE, SEQ_LENGTH, SHARD_SIZE, build_workload

CHECKOUT = Path(__file__).resolve().parents[1]

NEMO_RUNNER = '''
import sys
import transformers
import nemo_automodel.components.speculative.precompute_dspark as precompute


class _TransformersLoader:
    """NeMo's CPU functional test does the same: NeMoAutoModelForCausalLM needs CUDA."""

    @staticmethod
    def from_pretrained(path, *, trust_remote_code=False, torch_dtype=None, force_hf=False, **kwargs):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, trust_remote_code=trust_remote_code, dtype=torch_dtype, **kwargs)


precompute.NeMoAutoModelForCausalLM = _TransformersLoader
sys.exit(precompute.main(sys.argv[1:]))
'''

NEMO_COMPARE = '''
import json, sys
import torch
from safetensors.torch import load_file
from nemo_automodel.components.datasets.llm.dspark_cache import CachedDSparkDataset, read_manifest

ours_dir, nemo_dir, pad_id = sys.argv[1], sys.argv[2], int(sys.argv[3])
hidden = int(read_manifest(nemo_dir)["hidden_size"])
ours, nemo = CachedDSparkDataset(ours_dir), CachedDSparkDataset(nemo_dir)
identity = [k for k in read_manifest(nemo_dir) if k not in ("complete", "format_version")]
m_ours, m_nemo = read_manifest(ours_dir), read_manifest(nemo_dir)
report = {"samples": len(nemo), "manifest_fields_differing": [k for k in identity if m_ours.get(k) != m_nemo.get(k)]}
w_ours, w_nemo = (load_file(d + "/target_weights.safetensors") for d in (ours_dir, nemo_dir))
report["target_weights_equal"] = all(torch.equal(w_ours[k], w_nemo[k]) for k in w_nemo)
ints_equal, max_ulps, equal_elements, elements = True, 0.0, 0, 0
for i in range(len(nemo)):
    a, b = ours[i], nemo[i]
    ints_equal &= torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    ids = b["input_ids"]
    pad_run = int((ids.flip(0) == pad_id).long().cumprod(0).sum())
    content = ids.shape[0] - pad_run
    for key in ("target_hidden_states", "target_last_hidden_states"):
        # [T, k, H]: per token and captured layer, the difference in ulps of that feature vector's largest
        # element (fp32 noise from a different matmul blocking is relative to the vector's scale).
        x, y = (t[key][:content].float().unflatten(-1, (-1, hidden)) for t in (a, b))
        scale = y.abs().amax(dim=-1).clamp_min(2.0 ** -126)
        ulp = torch.exp2(torch.floor(torch.log2(scale)) - 7)
        max_ulps = max(max_ulps, float(((x - y).abs().amax(dim=-1) / ulp).max()) if content else 0.0)
        equal_elements += int((x == y).sum())
        elements += x.numel()
report.update(input_ids_and_loss_mask_equal=bool(ints_equal), hidden_max_diff_in_bf16_ulps_of_vector_max=max_ulps,
              hidden_bitwise_equal_fraction=round(equal_elements / max(elements, 1), 6))
report["equal"] = (ints_equal and report["target_weights_equal"] and not report["manifest_fields_differing"]
                   and max_ulps <= 1.0)
print(json.dumps(report))
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--root", type=Path, default=Path("/tmp/ds_capture_vs_nemo"))
    parser.add_argument("--nemo-python", default="/work/nemo_venv/bin/python")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both sides (default: unset)")
    parser.add_argument("--compare-only", action="store_true", help="only compare the caches of an earlier run")
    args = parser.parse_args()

    reason = _nemo_missing(args.nemo_python)
    if reason:
        print(json.dumps({"benchmark": "vs_nemo", "skipped": reason}))
        return
    work = build_workload(args.root)
    env = dict(os.environ, PYTHONPATH=str(CHECKOUT), TOKENIZERS_PARALLELISM="false")
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    runner = args.root / "nemo_precompute.py"
    runner.write_text(NEMO_RUNNER)

    def nemo(out: Path) -> list[str]:
        return [args.nemo_python, str(runner), "--target-model", str(work.target), "--input-data", str(work.data),
                "--output-dir", str(out), "--seq-length", str(SEQ_LENGTH), "--batch-size", str(MICRO_BATCH_SIZE),
                "--shard-size", str(SHARD_SIZE), "--dtype", CACHE_DTYPE, "--device", "cpu", "--log-level", "WARNING"]

    def ours(out: Path) -> list[str]:
        return [sys.executable, "-m", "ds_capture", "run", "-c", str(work.recipe(out)), "--no-progress"]

    seconds: dict[str, list[float]] = {"nemo": [], "ds_capture": []}
    for repeat in range(0 if args.compare_only else args.repeats):
        for name, command in (("nemo", nemo), ("ds_capture", ours)):
            out = args.root / f"{name}_{repeat}"
            shutil.rmtree(out, ignore_errors=True)
            started = time.perf_counter()
            done = subprocess.run(command(out), env=env, capture_output=True, text=True)
            seconds[name].append(time.perf_counter() - started)
            if done.returncode:
                raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    last = args.repeats - 1
    ours_dir, nemo_dir = args.root / f"ds_capture_{last}", args.root / f"nemo_{last}"
    pad_id = _pad_id(work.target)
    compared = subprocess.run([args.nemo_python, "-c", NEMO_COMPARE, str(ours_dir), str(nemo_dir), str(pad_id)],
                              capture_output=True, text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    if compared.returncode:
        raise SystemExit(f"comparison failed:\n{compared.stderr[-3000:]}")
    if args.compare_only:
        print(compared.stdout)
        return
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    ratio = medians["nemo"] / medians["ds_capture"]
    print(json.dumps({
        "benchmark": "vs_nemo",
        **work.describe(),
        "threads": args.threads,
        "seconds": {name: [round(v, 2) for v in values] for name, values in seconds.items()},
        "median_seconds": {name: round(v, 2) for name, v in medians.items()},
        "ratio_nemo_over_ds_capture": round(ratio, 3),
        "goal_ratio_min": 2.0,
        "goal_met": ratio >= 2.0,
        "cache_bytes": {"ds_capture": _sizes(ours_dir), "nemo": _sizes(nemo_dir)},
        "equality_through_nemo_reader": json.loads(compared.stdout),
    }, indent=2))


def _nemo_missing(python: str) -> str | None:
    if not Path(python).exists():
        return f"{python} not found (NeMo AutoModel 0.7.0 is installed --no-deps in a side environment)"
    probe = subprocess.run([python, "-c", "import nemo_automodel, sys; print(nemo_automodel.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"nemo_automodel is not importable with {python}"
    return None


def _pad_id(target: Path) -> int:
    from transformers import AutoTokenizer

    from ds_capture.data.tokenization import pad_token_id

    return pad_token_id(AutoTokenizer.from_pretrained(str(target)))


def _sizes(cache: Path) -> dict:
    shards = sorted(cache.glob("shard-*.safetensors"))
    return {"logical": sum(p.stat().st_size for p in shards), "on_disk": sum(p.stat().st_blocks * 512 for p in shards)}


if __name__ == "__main__":
    main()
