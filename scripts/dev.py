#!/usr/bin/env python3
"""Set up the project environment (once) and run the demo or the tests. Needs only python3.

    python3 scripts/dev.py demo          # build the demo target, capture, verify the cache (one process)
    python3 scripts/dev.py test [ARGS]   # the test suite CI runs (ARGS go to pytest)
    python3 scripts/dev.py test --full   # every cell of the slow equality matrices too (DS_CAPTURE_FULL=1)
    python3 scripts/dev.py pipeline      # regenerate -> capture / serve -> NeMo trains drafters -> tau (outputs/pipeline)

The environment is a virtualenv in ``.venv`` (override with ``DS_CAPTURE_VENV``). It is created
on first use and reinstalled only when ``pyproject.toml`` changes. torch is pinned to the CPU
build 2.13.0 first, so that resolving the other dependencies never pulls a CUDA build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("DS_CAPTURE_VENV", ROOT / ".venv"))
TORCH_PIN = "torch==2.13.0"
NEMO_PIN = "nemo_automodel==0.7.0"


def venv_python() -> Path:
    return VENV / "bin" / "python"


def ensure_env(extras: tuple[str, ...] = ()) -> Path:
    """Create the venv and install the project (editable) with ``extras``, unless done for this pyproject.

    The demo needs the runtime dependencies only; ``test`` adds the test / bench / mpi extras. The stamp
    records what was installed, so a later ``test`` installs only what the demo left out.
    """
    pyproject = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    stamp = VENV / ".ds_capture_installed"
    recorded = stamp.read_text().split() if stamp.is_file() else []
    if recorded[:1] == [pyproject] and set(extras) <= set(recorded[1:]) and venv_python().exists():
        return venv_python()
    if not venv_python().exists():
        print(f"[dev] creating virtualenv {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    pip = [str(venv_python()), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    print(f"[dev] installing {TORCH_PIN} and the project (first run only, a few minutes)", flush=True)
    subprocess.run(pip + [TORCH_PIN], check=True)
    if recorded[:1] == [pyproject]:
        extras = tuple(sorted(set(extras) | set(recorded[1:])))
    target = f"{ROOT}[{','.join(extras)}]" if extras else str(ROOT)
    subprocess.run(pip + ["-e", target], check=True)
    if "nemo" in extras:
        # NeMo AutoModel pins transformers 5.18 (this project: 5.24), so pip cannot resolve it as a requirement of
        # the extra; its model classes import and run with 5.24 (docs/nemo_families_notes.md). No GPU stack.
        subprocess.run(pip + ["--no-deps", NEMO_PIN], check=True)
    stamp.write_text(" ".join([pyproject, *extras]))
    return venv_python()


def test_extras() -> tuple[str, ...]:
    # nemo: DeepSeek-V4.1 / Kimi K3 are built by NeMo AutoModel's classes; their tests need it in this venv.
    return ("test", "bench", "nemo", "mpi") if shutil.which("mpicc") else ("test", "bench", "nemo")


def ensure_shm_op(python: Path, env: dict) -> None:
    """Build DeepSpeed's CPU shared-memory all-reduce op once, outside any test timeout (minutes on 2 cores).

    It lives in this venv's own extensions dir: a build shared between venvs is rebuilt by each in turn,
    and a build killed halfway leaves a ``lock`` file that makes every later one wait forever.
    """
    stamp = VENV / ".ds_capture_shm_op_built"
    if stamp.is_file():
        return
    lock = Path(env["TORCH_EXTENSIONS_DIR"]).glob("*/deepspeed_shm_comm/lock")
    for path in lock:
        path.unlink()
    print("[dev] building DeepSpeed's CPU comm op (first run only)", flush=True)
    code = ("from deepspeed.accelerator import get_accelerator; "
            "get_accelerator().create_op_builder('ShareMemCommBuilder').load()")
    subprocess.run([str(python), "-c", code], check=True, env=env)
    stamp.write_text("ok")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("demo", "test", "env", "pipeline"):
        print(__doc__)
        return 2
    python = ensure_env(() if argv[0] == "demo" else test_extras())
    env = dict(os.environ, PATH=f"{VENV / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(VENV / "torch_extensions"))
    command, rest = argv[0], argv[1:]
    if command == "test":
        # Only the multi-rank tests need it, but their timeouts must not pay for its first build. The demo runs
        # one process, which never loads it; a multi-rank job builds it (once) when DeepSpeed first needs it.
        ensure_shm_op(python, env)
    if command == "env":
        return 0
    if command == "pipeline":
        # benchmarks/pipeline.py: the demo target trained, regenerated, captured, served, NeMo's drafters, tau.
        return subprocess.run([str(python), str(ROOT / "benchmarks" / "pipeline.py"), *rest], cwd=ROOT,
                              env=env).returncode
    if command == "test":
        if "--full" in rest:
            rest = [arg for arg in rest if arg != "--full"]
            env["DS_CAPTURE_FULL"] = "1"
        # The slowest tests are listed at the end, so a CI log shows where the suite's time goes.
        return subprocess.run([str(python), "-m", "pytest", "-q", "--durations=20", *rest], cwd=ROOT,
                              env=env).returncode
    config = rest[0] if rest else "configs/demo.yaml"
    cli = [str(python), "-m", "ds_capture"]
    run = subprocess.run(cli + ["run", "-c", config], cwd=ROOT, env=env)
    if run.returncode:
        return run.returncode
    return subprocess.run(cli + ["verify", "outputs/demo_cache"], cwd=ROOT, env=env).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
