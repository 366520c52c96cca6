"""What both kinds' verify, inspect and compare share: the verify report, the manifest's text, the shard set and
the loop over it, a shard loaded and layout-checked, the kind's whole file, the checksum pass, and the per-tensor
difference report of ``ds-capture compare``.

In: a cache directory and its manifest. Out: reports (problems named by file and key, each with the command
that repairs it, built from the ``ds-capture run`` command the cache's run recorded in
``.ds_capture/run_command.json``). Imports no kind.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ds_capture.cache.common.files import (
    checksum_matches,
    describe_numerics,
    file_checksum,
    read_numerics,
    read_recorded_checksum,
)
from ds_capture.cache.common.names import (
    BOOKKEEPING_DIR,
    CHECKSUMS_DIR,
    MANIFEST_NAME,
    RUN_COMMAND_NAME,
    SHARD_RE,
    checksum_name,
    shard_name,
)
from ds_capture.cache.common.shard_file import read_tensors
from ds_capture.errors import CaptureError

_MAX_LISTED = 10


# How a problem is repaired (VerifyReport.add renders each as a command line with the cache's recorded command):
RERUN = "rerun"
"""A plain rerun recomputes it (missing or truncated shard, damaged header, no sidecar; unfinished run)."""
RERUN_CHECKSUMS = "rerun --verify-checksums"
"""A shard's bytes changed after it was written: a plain rerun over a complete cache checks sizes and headers
only, so only ``--verify-checksums`` finds and recomputes it."""
RECOMPUTE = "recompute"
"""A shard holds wrong values yet its header and size are right: delete it, and a rerun recomputes it."""
RESTART = "restart"
"""The weights file: a rerun over a complete cache keeps it, ``--restart`` rewrites it (and every shard)."""
REMOVE = "remove"
"""Files that do not belong (shards beyond num_shards): delete them."""
NEW_CACHE = "new cache"
"""The manifest itself is damaged: nothing in the directory can be tied to a run; recompute it from scratch."""
UNKNOWN_COMMAND = "ds-capture run -c <the recipe that wrote it>"


def recorded_run_command(cache_dir: Path) -> str:
    """The ``ds-capture run`` command line recorded in ``.ds_capture/run_command.json`` by the run that wrote
    the cache (pointed at ``cache_dir`` where the cache was moved or copied since), or a placeholder (a cache of
    an earlier version, or one NeMo wrote)."""
    try:
        record = json.loads((Path(cache_dir) / BOOKKEEPING_DIR / RUN_COMMAND_NAME).read_text(encoding="utf-8"))
        argv = [str(arg) for arg in record["argv"]]
        if Path(record["cache_output_dir"]) != Path(cache_dir).resolve():
            argv += ["--set", f"recipe_args.cache_output_dir={Path(cache_dir).resolve()}"]
        return shlex.join(argv)
    except (OSError, ValueError, KeyError, TypeError):
        return UNKNOWN_COMMAND


@dataclass
class VerifyReport:
    """What ``verify_cache`` found; ``ok`` is true exactly when ``problems`` is empty."""

    cache_dir: Path
    ok: bool = False
    problems: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)
    """``repairs[i]`` is the command line that repairs ``problems[i]``."""
    run_command: str = UNKNOWN_COMMAND
    """The command that wrote the cache (:func:`recorded_run_command`); repairs are built from it."""
    num_samples: int = 0
    num_shards: int = 0
    num_shards_checked: int = 0
    num_tokens: int = 0
    """Non-padding positions, by the module's padding rule."""
    num_supervised_tokens: int = 0
    """loss_mask.sum() over all shards."""
    pad_id: int | None = None
    """The inferred pad id (None: no row looks padded)."""
    checksums: bool = False
    """Whether shards were re-hashed against their recorded sha256."""
    numerics: dict | None = None
    """What the shards were computed with (``.ds_capture/numerics.json``: compute dtype, device, engine, CPU threads
    per rank); None for a cache without the record (an earlier version, NeMo's own)."""

    def add(self, problem: str, repair: str, names: tuple[str, ...] = ()) -> None:
        """Record ``problem`` and the command that repairs it (``repair``: one of the kinds above; ``names``:
        the files it deletes)."""
        run = self.run_command
        paths = " ".join(shlex.quote(str(self.cache_dir / name)) for name in names)
        command = {RERUN: run, RERUN_CHECKSUMS: f"{run} --verify-checksums", RECOMPUTE: f"rm {paths} && {run}",
                   RESTART: f"{run} --restart", REMOVE: f"rm {paths}",
                   NEW_CACHE: f"rm -r {shlex.quote(str(self.cache_dir))} && {run}"}[repair]
        self.problems.append(problem)
        self.repairs.append(command)

    def lines(self) -> list[str]:
        """What ``ds-capture verify`` prints for an invalid cache: each problem, then the command that repairs it."""
        return [f"{self.cache_dir}: INVALID cache, {len(self.problems)} problem(s):"] + [
            f"  - {problem}; repair: {repair}" for problem, repair in zip(self.problems, self.repairs)]

    def summary(self) -> str:
        status = "OK" if self.ok else f"FAILED ({len(self.problems)} problem{'s' * (len(self.problems) != 1)})"
        return (
            f"{self.cache_dir}: {status}: {self.num_samples} samples in {self.num_shards_checked}/{self.num_shards} "
            f"shards checked, {self.num_tokens} tokens, {self.num_supervised_tokens} supervised"
            + (", checksums verified" if self.checksums else "")
            + (f"; numerics: {describe_numerics(self.numerics)}" if self.numerics else "")
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["cache_dir"] = str(self.cache_dir)
        return out


def new_report(cache_dir: Path, *, checksums: bool) -> VerifyReport:
    """An empty report for ``cache_dir`` with what its run recorded: the command (repairs) and the numerics."""
    return VerifyReport(cache_dir=cache_dir, checksums=checksums, run_command=recorded_run_command(cache_dir),
                        numerics=read_numerics(cache_dir))


def finish_report(report: VerifyReport) -> VerifyReport:
    report.ok = not report.problems
    return report


def read_manifest_text(cache_dir: Path, missing: str) -> tuple[str, str]:
    """``(text, path)`` of ``cache_dir/manifest.json``; a CaptureError naming the path where it does not exist
    (``{path} does not exist: {missing}``) or cannot be read."""
    path = Path(cache_dir) / MANIFEST_NAME
    if not path.is_file():
        raise CaptureError(f"{path} does not exist: {missing}")
    try:
        return path.read_text(encoding="utf-8"), str(path)
    except (OSError, UnicodeDecodeError) as err:
        raise CaptureError(f"{path} cannot be read ({err}); check its permissions or re-create the cache.") from None


def shard_indices(cache_dir: Path) -> set[int]:
    """The indices of the shard files in ``cache_dir``."""
    return {int(m.group(1)) for e in Path(cache_dir).iterdir() if (m := SHARD_RE.match(e.name))}


def verify_shards(cache_dir: Path, num_shards: int, report: VerifyReport, verify_shard: Callable[[int], None], *,
                  checksums: bool, before: Callable[[list[int]], None] = lambda indices: None) -> None:
    """The shard set against ``num_shards`` (missing ones a rerun writes, extra ones to delete), then each shard
    present that the manifest expects: ``verify_shard(index)`` (the kind's value rules) and, with ``checksums``,
    its recorded checksum. ``before(indices)`` runs once the shards to check are known (DSpark infers its pad id)."""
    present, expected = shard_indices(cache_dir), set(range(num_shards))
    if missing := sorted(expected - present):
        report.add(f"missing shards: {list_names(missing)} (expected shard-000000 .. {shard_name(num_shards - 1)})",
                   RERUN)
    if extra := sorted(present - expected):
        report.add(f"extra shards beyond num_shards {num_shards}: {list_names(extra)}", REMOVE,
                   tuple(shard_name(i) for i in extra))
    indices = sorted(expected & present)
    before(indices)
    for index in indices:
        verify_shard(index)
        if checksums:
            verify_checksum(cache_dir, index, report)
        report.num_shards_checked += 1


def load_whole_file(cache_dir: Path, name: str, report: VerifyReport, repair: str,
                    why: str = "") -> dict[str, torch.Tensor] | None:
    """The tensors of the kind's one whole file (DSpark's target weights, EAGLE-3's embeddings); None, with the
    problem reported, where it is missing (``why``: what needs it) or unreadable."""
    path = Path(cache_dir) / name
    if not path.is_file():
        report.add(f"{name} is missing{why}", repair)
        return None
    try:
        return load_tensors(path)
    except (OSError, ValueError) as err:
        report.add(f"{name}: unreadable safetensors file ({err})", repair)
        return None


def list_names(indices: list[int]) -> str:
    names = ", ".join(shard_name(i) for i in indices[:_MAX_LISTED])
    return names + (f" (and {len(indices) - _MAX_LISTED} more)" if len(indices) > _MAX_LISTED else "")


def padding_lengths(input_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """[n] length of each row's trailing run of ``pad_id`` (0 where the row does not end in it)."""
    if pad_id is None:
        return torch.zeros(input_ids.shape[0], dtype=torch.int64)
    # Count pads from the end until the first non-pad: cumprod of the reversed "is pad" mask.
    is_pad_reversed = (input_ids.flip(-1) == pad_id).to(torch.int64)
    return is_pad_reversed.cumprod(dim=-1).sum(dim=-1)


def load_tensors(path: Path, names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file (or those in ``names``), read without a memory map
    (:func:`~ds_capture.cache.common.shard_file.read_tensors`: a full tmpfs cannot kill the reader)."""
    return read_tensors(path, names)


def load_checked_shard(cache_dir: Path, index: int, manifest: Any, report: VerifyReport) -> dict[str, torch.Tensor] | None:
    """Shard ``index``'s tensors when the file reads and holds exactly ``manifest.expected_shard_tensors(index)``
    (names, shapes, dtypes); otherwise each problem is reported and None returned. Both cache kinds verify this
    way. Each of these a rerun's shard check (header, size) finds too: a plain rerun repairs it."""
    name = shard_name(index)
    try:
        tensors = load_tensors(Path(cache_dir) / name)
    except (OSError, ValueError) as err:  # a damaged file, or one the filesystem cannot read
        report.add(f"{name}: unreadable safetensors file ({err})", RERUN)
        return None
    expected = manifest.expected_shard_tensors(index)
    if set(tensors) != set(expected):
        report.add(f"{name}: holds tensors {sorted(tensors)}, expected exactly {sorted(expected)}", RERUN)
        return None
    layout = [f"{name}: {layout_mismatch(key, tensors[key], shape, dtype)}" for key, (shape, dtype) in expected.items()
              if tuple(tensors[key].shape) != shape or tensors[key].dtype != dtype]
    for problem in layout:
        report.add(problem, RERUN)
    return None if layout else tensors


def value_problem_repair(cache_dir: Path, index: int) -> str:
    """The repair of a shard that breaks a value rule with a valid header and size: where its bytes changed
    after it was written (its checksum no longer matches), ``--verify-checksums`` finds and recomputes it; where
    they did not, the run wrote it so, and it must be deleted for a rerun to recompute it."""
    recorded = read_recorded_checksum(cache_dir, index)
    if recorded is not None and not checksum_matches(Path(cache_dir) / shard_name(index), recorded):
        return RERUN_CHECKSUMS
    return RECOMPUTE


def verify_checksum(cache_dir: Path, index: int, report: VerifyReport) -> None:
    name = shard_name(index)
    recorded = read_recorded_checksum(cache_dir, index)
    if recorded is None:
        record = f"{BOOKKEEPING_DIR}/{CHECKSUMS_DIR}/{checksum_name(index)}"
        report.add(f"{name}: no recorded checksum ({record}) to check against", RERUN)
        return
    algorithm = recorded.partition(":")[0]
    try:
        actual = file_checksum(cache_dir / name, algorithm)
    except (OSError, ValueError) as error:
        report.add(f"{name}: its {algorithm} checksum cannot be computed ({error})", RERUN)
        return
    if actual != recorded:
        report.add(
            f"{name}: {algorithm} {actual.partition(':')[2]} differs from the recorded {recorded.partition(':')[2]}: "
            "the file changed after it was written", RERUN_CHECKSUMS
        )


def layout_mismatch(key: str, t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> str:
    def dtype_name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    return f"{key} is {list(t.shape)} {dtype_name(t.dtype)}, expected {list(shape)} {dtype_name(dtype)}"


def human_bytes(num_bytes: int) -> str:
    size = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{num_bytes} B"
        size /= 1024
    raise AssertionError("unreachable")


# dtype -> (atol, rtol); see the module docstring for the reasoning.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (1e-5, 1.3e-6),
    "bf16": (1e-5, 1.6e-2),
    "fp16": (1e-5, 1e-3),
}


@dataclass
class KeyDiff:
    """Differences of one tensor key (over one shard, or accumulated over all of them)."""

    max_abs: float = 0.0
    max_rel: float = 0.0
    """max |a - b| / max(|a|, |b|) (0 where both are 0)."""
    num_mismatched: int = 0
    """Elements outside the tolerance (for integers: elements that differ at all)."""
    numel: int = 0

    @property
    def ok(self) -> bool:
        return self.num_mismatched == 0

    def add(self, other: KeyDiff) -> None:
        self.max_abs = max(self.max_abs, other.max_abs)
        self.max_rel = max(self.max_rel, other.max_rel)
        self.num_mismatched += other.num_mismatched
        self.numel += other.numel


@dataclass
class ShardDiff:
    """One shard (or ``target_weights``) of the two caches, key by key."""

    name: str
    keys: dict[str, KeyDiff]

    @property
    def ok(self) -> bool:
        return all(diff.ok for diff in self.keys.values())


@dataclass
class CompareReport:
    """Everything ``ds-capture compare`` prints; ``equal`` is the verdict."""

    a: str
    b: str
    identity: dict[str, tuple[Any, Any]]
    """Every identity field, (value in A, value in B)."""
    bookkeeping: dict[str, tuple[Any, Any]]
    """Non-identity manifest fields (producer, layout) and the recorded numerics, shown, never compared."""
    identity_diff: list[str]
    atol: float
    rtol: float
    keys: dict[str, KeyDiff] = field(default_factory=dict)
    shards: list[ShardDiff] = field(default_factory=list)
    compared_tensors: bool = False
    """False when a shape-defining identity field differs (nothing tensor-wise to compare)."""

    @property
    def equal(self) -> bool:
        return not self.identity_diff and self.compared_tensors and all(d.ok for d in self.keys.values())

    @property
    def failing_shards(self) -> list[str]:
        return [shard.name for shard in self.shards if not shard.ok]

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a, "b": self.b, "equal": self.equal, "atol": self.atol, "rtol": self.rtol,
            "identity": {k: list(v) for k, v in self.identity.items()},
            "bookkeeping": {k: list(v) for k, v in self.bookkeeping.items()},
            "identity_diff": self.identity_diff, "compared_tensors": self.compared_tensors,
            "keys": {k: {**asdict(v), "ok": v.ok} for k, v in self.keys.items()},
            "shards": [{"name": s.name, "ok": s.ok, "keys": {k: asdict(v) for k, v in s.keys.items()}}
                       for s in self.shards],
            "failing_shards": self.failing_shards,
        }

    def format(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}"]
        for name, (a, b) in self.bookkeeping.items():
            lines.append(f"  {name}: A {a!r} | B {b!r}")
        if self.identity_diff:
            lines.append(f"identity: {len(self.identity_diff)} field(s) differ:")
            lines += [f"  {name}: A {self.identity[name][0]!r} | B {self.identity[name][1]!r}"
                      for name in self.identity_diff]
        else:
            lines.append(f"identity: all {len(self.identity)} fields equal")
        if not self.compared_tensors:
            lines.append("tensors: not compared (the caches have different shapes)")
        else:
            lines.append(f"tolerance: |a-b| <= {self.atol:g}*max(1, max|b|) + {self.rtol:g}*|b| (floats); "
                         "integers exact")
            lines.append(f"  {'key':<30} {'max_abs':>11} {'max_rel':>11} {'mismatched':>14}")
            for key, diff in self.keys.items():
                lines.append(f"  {key:<30} {diff.max_abs:>11.3e} {diff.max_rel:>11.3e} "
                             f"{diff.num_mismatched:>6}/{diff.numel:<7} {'ok' if diff.ok else 'DIFFERENT'}")
            num_ok = sum(shard.ok for shard in self.shards)
            lines.append(f"shards: {num_ok}/{len(self.shards)} within tolerance")
            for shard in self.shards:
                if not shard.ok:
                    bad = ", ".join(f"{k} (max_abs {d.max_abs:.3e}, {d.num_mismatched} elements)"
                                    for k, d in shard.keys.items() if not d.ok)
                    lines.append(f"  {shard.name}: {bad}")
        lines.append("verdict: EQUAL within tolerance" if self.equal else "verdict: DIFFERENT")
        return "\n".join(lines)


def default_tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for a cache dtype (``fp32``, ``bf16``, ``fp16``)."""
    return DEFAULT_TOLERANCES[dtype]


def diff_tensors(x: torch.Tensor, y: torch.Tensor, atol: float, rtol: float) -> KeyDiff:
    """Element-wise comparison of two same-shape tensors (``y`` the reference)."""
    if x.numel() == 0:
        return KeyDiff()
    if not x.is_floating_point():
        diff = (x - y).abs()
        scale = torch.maximum(x.abs(), y.abs()).clamp_min(1)
        return KeyDiff(max_abs=float(diff.max()), max_rel=float((diff.double() / scale).max()),
                       num_mismatched=int((diff != 0).sum()), numel=x.numel())
    x, y = x.float(), y.float()  # bf16 / fp16 -> fp32 is exact
    magnitude = float(torch.nan_to_num(y.abs(), nan=0.0, posinf=0.0).max())
    close = torch.isclose(x, y, atol=atol * max(1.0, magnitude), rtol=rtol, equal_nan=True)
    diff = (x - y).abs()
    both_nan = x.isnan() & y.isnan()
    diff = torch.where(both_nan, torch.zeros_like(diff), torch.nan_to_num(diff, nan=float("inf")))
    scale = torch.nan_to_num(torch.maximum(x.abs(), y.abs()), nan=0.0)  # NaN vs number: rel inf
    rel = torch.where(diff == 0, torch.zeros_like(diff), diff / scale.clamp_min(torch.finfo(torch.float32).tiny))
    return KeyDiff(max_abs=float(diff.max()), max_rel=float(rel.max()), num_mismatched=int((~close).sum()),
                   numel=x.numel())
