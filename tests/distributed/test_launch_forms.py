"""The same job through every launcher users use gives byte-identical caches.

One recipe (tiny Qwen3-MoE, fp32, 8 samples in 4 shards of 2, ``distributed.ep_size: 2`` so every forward
does the expert all-to-all between the two ranks) is run as ``python -m ds_capture run -c CFG`` under:

  torchrun           ``torchrun --nproc_per_node 2`` (the reference)
  deepspeed_hostfile ``deepspeed --hostfile H`` with ``localhost slots=2``
  deepspeed_two_nodes two ``deepspeed --no_ssh --num_nodes 2 --node_rank {0,1}`` launchers (LOCAL_SIZE 1)
  deepspeed_module   ``deepspeed --num_accelerators 2 --module ds_capture run -c CFG``
  mpirun             ``mpirun -np 2 python -m ds_capture run -c CFG`` (OpenMPI discovery)

Every shard file and ``target_weights.safetensors`` must have the same sha256 as torchrun's; the manifests
must agree on every identity field and differ, if at all, only in bookkeeping. EP is exact by
construction (no reassociated sums), so bytes, not tolerances, are the right check; TP would route the
all-reduce through DeepSpeed's shm op on one host and through gloo across "nodes", which is ulp-close,
not byte-equal (tests/distributed/test_layouts.py covers TP).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launchers import ensure_shm_op_built, have_mpirun, run_launcher  # noqa: E402
from support import safetensors_digests  # noqa: E402

from ds_capture.cache.dspark.format import IDENTITY_FIELDS  # noqa: E402
from ds_capture.cache.registry import verify_cache

pytestmark = [pytest.mark.distributed]


def _recipe(path: Path, target: Path, out: Path) -> Path:
    path.write_text(yaml.safe_dump({
        "recipe_args": {"target_model_name_or_path": str(target), "train_data_path": "demo:conversations",
                        "train_split": "train[:8]", "cache_output_dir": str(out), "seq_length": 32,
                        "micro_batch_size": 2, "cache_shard_size": 2, "cache_dtype": "fp32"},
        "distributed": {"ep_size": 2},
        "dist_env": {"timeout_minutes": 2},
    }))
    return path


def _launch(kind: str, root: Path, target: Path) -> Path:
    out = root / kind / "cache"
    cfg = _recipe(root / f"{kind}.yaml", target, out)
    result = run_launcher(kind, 2, ["-m", "ds_capture", "run", "-c", str(cfg), "--no-progress"], None, 240)
    assert result.returncode == 0, result.stdout[-6000:]
    assert result.leftover_shm == [], result.leftover_shm
    assert "4 shards written" in result.stdout, result.stdout[-3000:]
    return out


@pytest.fixture(scope="module")
def forms(tiny_target, tmp_path_factory) -> dict:
    ensure_shm_op_built()
    root = tmp_path_factory.mktemp("launch_forms")
    target = tiny_target("qwen3_moe", num_hidden_layers=2)
    return {"root": root, "target": target, "reference": _launch("torchrun", root, target)}


def _check_same_bytes(cache: Path, reference: Path) -> None:
    assert verify_cache(cache).ok
    want = safetensors_digests(reference)
    assert len(want) == 1 + 4  # target weights + 4 shards
    assert safetensors_digests(cache) == want
    got_manifest = json.loads((cache / "manifest.json").read_text())
    want_manifest = json.loads((reference / "manifest.json").read_text())
    assert {k: got_manifest[k] for k in IDENTITY_FIELDS} == {k: want_manifest[k] for k in IDENTITY_FIELDS}
    differing = {k for k in set(got_manifest) | set(want_manifest) if got_manifest.get(k) != want_manifest.get(k)}
    assert differing <= {"producer", "inputs"} and not differing & set(IDENTITY_FIELDS), differing
    assert got_manifest["complete"] is True and got_manifest["producer"]["ep_size"] == 2


@pytest.mark.timeout(300)
def test_mpirun_python_m_ds_capture_gives_byte_identical_cache(forms):
    if not have_mpirun():
        pytest.skip("mpirun / mpi4py not installed")
    _check_same_bytes(_launch("mpirun", forms["root"], forms["target"]), forms["reference"])


@pytest.mark.timeout(300)
# CI cut: two "nodes" through a hostfile; the plain hostfile form and the one-node --module form (the --module form
# also runs in CI in test_dist_launchers.py's TP-group probe) run with --full.
@pytest.mark.parametrize("kind", [pytest.param("deepspeed_hostfile", marks=pytest.mark.slow), "deepspeed_two_nodes",
                                  pytest.param("deepspeed_module", marks=pytest.mark.slow)])
def test_deepspeed_launchers_give_byte_identical_cache(forms, kind):
    """``deepspeed ... --module ds_capture run -c CFG`` exactly as users type it (--local_rank goes first)."""
    _check_same_bytes(_launch(kind, forms["root"], forms["target"]), forms["reference"])
