"""torchrun that exits with its ranks' code: 75 when every rank of this node stopped with 75 (preemption).

In: torchrun's own arguments. Out: torchrun's exit code, except that a node whose ranks all stopped with
``RERUN_EXIT_CODE`` (75: stopped consistently, rerun to continue) exits 75 with one line and no traceback.

    python -m ds_capture.parallel.torchrun_exit --nproc_per_node 2 -m ds_capture run -c CFG   # launch/torchrun.sh

Why: SIGTERM to the job's process group (Slurm preemption) reaches torchrun too. It raises ``SignalException``,
forwards the signal to its workers, waits for them, and exits 1 with a traceback; ranks that stop by
themselves (a signal to the ranks alone) make it exit 1 with a ``ChildFailedError`` traceback. Either way a
scheduler's "requeue on 75" never fires. torchrun does not report the exit codes of workers it shut down
itself, so each rank records its own: ``ds-capture`` writes ``rank-<RANK>`` (its exit code, and the node's
rank count) into ``$DS_CAPTURE_EXIT_DIR`` as it exits (:func:`record_exit_code`), and this wrapper reads them.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from ds_capture.errors import RERUN_EXIT_CODE

EXIT_DIR_ENV = "DS_CAPTURE_EXIT_DIR"


def record_exit_code(code: int) -> None:
    """A rank started under this wrapper records the code it exits with (nothing elsewhere)."""
    directory = os.environ.get(EXIT_DIR_ENV)
    if not directory or "RANK" not in os.environ:
        return
    try:
        path = Path(directory) / f"rank-{os.environ['RANK']}"
        path.write_text(f"{code} {os.environ.get('LOCAL_WORLD_SIZE', '')}\n", encoding="utf-8")
    except OSError:  # a vanished directory: the wrapper then reports torchrun's own code
        pass


def ranks_stopped_to_rerun(directory: Path) -> bool:
    """Every rank of this node recorded 75 (as many records as the node has ranks)."""
    records = [path.read_text(encoding="utf-8").split() for path in directory.glob("rank-*")]
    return (bool(records) and all(code == str(RERUN_EXIT_CODE) for code, *_ in records)
            and all(rest == [str(len(records))] for _, *rest in records))


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    directory = Path(tempfile.mkdtemp(prefix="ds_capture_exit_"))
    os.environ[EXIT_DIR_ENV] = str(directory)
    try:
        torchrun_main(argv)
        return 0
    except (SignalException, ChildFailedError) as error:
        if not ranks_stopped_to_rerun(directory):
            raise
        reason = f"torchrun got signal {error.sigval.name}" if isinstance(error, SignalException) else "torchrun"
        print(f"ds_capture: every rank on this node stopped with {RERUN_EXIT_CODE} ({reason}); so does torchrun",
              file=sys.stderr)
        return RERUN_EXIT_CODE
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
