"""The acceptance pipeline end to end, shortened (``--full``): benchmarks/pipeline.py with fewer rows and epochs.

The trained demo target (built in this session's DS_CAPTURE_HOME, trained on the bundled answers in a style of its
own, gated at a mean greedy top-1 probability of 0.5 on held-out prompts), ``ds-capture regenerate`` against
``transformers serve`` of it, three fp32 EAGLE-3 caches, NeMo's ``train_eagle3`` from each training cache and once
against ``ds-capture serve``. The ordering must hold by both measures of tau: a trained drafter accepts more than
the untrained one, the one trained on regenerated answers more than the one trained on the original answers (by
more than 0.2), and the drafter trained online through ``serve`` as much as the one trained from the cache of the
same rows; and the two measures, the same quantity on the same held-out rows, agree.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.distributed.launchers import REPO_ROOT


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_pipeline_orders_the_drafters(tmp_path):
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "pipeline.py"), "--out-dir", str(tmp_path),
               "--train-rows", "64", "--heldout-rows", "12", "--epochs", "6", "--eval-every", "48"]
    done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=2300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads((tmp_path / "acceptance.json").read_text())
    assert (tmp_path / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["target_top1"] >= 0.5 and report["draft_tokens"] == 3 and report["steps"] == 6 * 16
    tau = report["tau"]
    assert set(tau) == {"untrained", "original", "regenerated", "online"}
    for method in ("nemo", "decoder"):
        assert tau["original"][method] > tau["untrained"][method] + 0.3, (method, tau)
        # The target answers in a style of its own (demo.restyle): training on its regenerated answers beats
        # training on the dataset's by more than the pipeline's goal (0.2), even shortened (+0.36 when written).
        assert tau["regenerated"][method] > tau["original"][method] + 0.2, (method, tau)
        assert abs(tau["online"][method] - tau["regenerated"][method]) <= 0.05, (method, tau)
    for name in ("untrained", "original", "regenerated", "online"):
        assert 1.0 <= tau[name]["decoder"] <= 4.0 and 1.0 <= tau[name]["nemo"] <= 4.0
        # Both methods measure the same quantity on the same rows: they agree.
        assert abs(tau[name]["nemo"] - tau[name]["decoder"]) <= 0.05, (name, tau)
        # The decoder's batched proposals are what a one-anchor decoder call proposes.
        equal, checked = report["decoder"][name]["proposal_checks"]
        assert checked and equal == checked, report["decoder"]
    held_in_cache, rows = report["heldout_rows_in_cache"]
    assert held_in_cache == rows == 12
