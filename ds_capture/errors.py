"""The one exception type for anything a user controls (config, data, layout, output directory).

The CLI prints a ``CaptureError`` as a message and exits non-zero, never as a traceback; every
message names the file / key / row at fault, the constraint, and the fix. :func:`parse_json` is the one
place a user's JSON text is parsed into such a message.
"""

from __future__ import annotations

import json
from typing import Any


class CaptureError(Exception):
    """A user-facing error: bad config, bad data row, impossible layout, foreign output dir."""


# The exit code of a run that stopped before it finished but left everything consistent on disk
# (preempted by SIGTERM, Ctrl-C, or a peer rank that stopped answering): rerun the same command to
# continue. 75 is EX_TEMPFAIL in sysexits.h ("temporary failure; the user is invited to retry").
RERUN_EXIT_CODE = 75


class RerunError(CaptureError):
    """A stop that left everything consistent on disk and that rerunning the same command continues (a peer rank
    died): printed as a message, exit :data:`RERUN_EXIT_CODE`, so a scheduler's requeue (launch/slurm.sbatch)
    takes it as it takes a preemption."""


def parse_json(text: str | bytes, where: str, fix: str, *, what: str = "") -> Any:
    """``json.loads(text)``; text that does not parse is a CaptureError ``{where}: {what}not valid JSON ({reason}).
    {fix}``, ``reason`` being the parser's message and its place (the column alone where the text is one line)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        at = "" if error.msg.endswith(" at") else " at"  # "Unterminated string starting at" names its own place
        line = f"line {error.lineno} " if "\n" in error.doc.strip() else ""
        raise CaptureError(f"{where}: {what}not valid JSON ({error.msg}{at} {line}column {error.colno}). {fix}") from None
