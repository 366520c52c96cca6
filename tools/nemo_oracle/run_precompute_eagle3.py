"""Run NeMo AutoModel 0.7.0's ``precompute_eagle3`` on CPU with its loader swapped for transformers'.

In: ``precompute_eagle3``'s own argv. Out: its exit code (its errors as a traceback on stderr). The same
shim as make_eagle3_fixtures.py (NeMo's loader needs CUDA); used to check what NeMo's ``--resume`` makes of a
directory ds_capture wrote:

    PYTHONPATH=$PWD /work/nemo_venv/bin/python tools/nemo_oracle/run_precompute_eagle3.py --target-model T \\
        --input-data D --output-dir O --device cpu ... --resume
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_eagle3_fixtures import _install_loader_shim  # noqa: E402

if __name__ == "__main__":
    _install_loader_shim()
    from nemo_automodel.components.speculative import precompute_eagle3

    sys.exit(precompute_eagle3.main(sys.argv[1:]))
