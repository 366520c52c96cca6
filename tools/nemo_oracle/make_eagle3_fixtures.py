"""Regenerate tests/fixtures/eagle3/: EAGLE-3 caches written by NeMo AutoModel 0.7.0's own producer.

In: the tiny-target spec ``tests/fixtures/eagle3/spec.json`` (targets rebuilt deterministically with
``ds_capture.demo.build_tiny_target``; their file hashes are recorded so the tests can prove they rebuild
the same target) and ``tests/fixtures/eagle3/data.jsonl``. Out: one directory per case under
``tests/fixtures/eagle3/`` holding NeMo's manifest, target_embeddings and shards, plus ``<case>.nemo_args.json``
(the exact argv and library versions) and ``targets.json`` (sha256 of every target file).

NeMo's loader (``NeMoAutoModelForCausalLM``) needs CUDA and NeMo-only extras; as NeMo's own CPU test does, it
is swapped for ``transformers.AutoModelForCausalLM`` (sdpa). Nothing else of NeMo is changed. Run it in the
side environment that has NeMo installed ``--no-deps``:

    PYTHONPATH=$PWD /work/nemo_venv/bin/python tools/nemo_oracle/make_eagle3_fixtures.py
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "eagle3"


def _install_loader_shim() -> None:
    """NeMoAutoModelForCausalLM -> transformers' AutoModelForCausalLM (CPU, sdpa); set before the import."""
    import nemo_automodel._transformers as nemo_transformers
    import transformers

    class _HFLoader:
        @staticmethod
        def from_pretrained(path, *, trust_remote_code=False, torch_dtype=None, **_ignored):
            return transformers.AutoModelForCausalLM.from_pretrained(
                path, trust_remote_code=trust_remote_code, dtype=torch_dtype, attn_implementation="sdpa")

    nemo_transformers.NeMoAutoModelForCausalLM = _HFLoader


def build_targets(spec: dict, root: Path) -> dict[str, Path]:
    """Every target of ``spec`` built under ``root``; same spec, same bytes."""
    sys.path.insert(0, str(ROOT))
    from tests.eagle3_support import build_fixture_target  # the tests' own builder

    return {name: build_fixture_target(spec, name, root / name) for name in spec["targets"]}


def _sha256_tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def main() -> int:
    _install_loader_shim()
    from importlib.metadata import version

    import datasets
    import safetensors
    import torch
    import transformers
    from nemo_automodel.components.speculative import precompute_eagle3

    spec = json.loads((FIXTURES / "spec.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        targets = build_targets(spec, Path(tmp) / "targets")
        (FIXTURES / "targets.json").write_text(
            json.dumps({name: _sha256_tree(path) for name, path in targets.items()}, indent=2, sort_keys=True) + "\n")
        for case, settings in spec["cases"].items():
            out = Path(tmp) / case
            argv = ["--target-model", str(targets[settings["target"]]), "--input-data", str(FIXTURES / "data.jsonl"),
                    "--output-dir", str(out), "--device", "cpu", *settings["argv"]]
            torch.manual_seed(0)
            assert precompute_eagle3.main(argv) == 0
            manifest = json.loads((out / "manifest.json").read_text())
            # The two paths are absolute temp paths: recorded as the names the tests pass.
            manifest["target_model"], manifest["input_data"] = settings["target"], "data.jsonl"
            (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
            shutil.rmtree(FIXTURES / case, ignore_errors=True)
            shutil.copytree(out, FIXTURES / case)
            relative = [a.replace(str(targets[settings["target"]]), settings["target"])
                         .replace(str(FIXTURES / "data.jsonl"), "data.jsonl").replace(str(out), case) for a in argv]
            versions = {name: version(name) for name in ("nemo_automodel", "torch", "transformers", "safetensors",
                                                          "datasets")}
            (FIXTURES / f"{case}.nemo_args.json").write_text(
                json.dumps({"argv": relative, "versions": versions}, indent=2, sort_keys=True) + "\n")
            print(f"{case}: {sorted(p.name for p in (FIXTURES / case).iterdir())}")
    del datasets, safetensors, transformers
    return 0


if __name__ == "__main__":
    sys.exit(main())
