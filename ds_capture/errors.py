"""The one exception type for anything a user controls (config, data, layout, output directory).

The CLI prints a ``CaptureError`` as a message and exits non-zero, never as a traceback; every
message names the file / key / row at fault, the constraint, and the fix.
"""


class CaptureError(Exception):
    """A user-facing error: bad config, bad data row, impossible layout, foreign output dir."""


# The exit code of a run that stopped before it finished but left everything consistent on disk
# (preempted by SIGTERM, Ctrl-C, or a peer rank that stopped answering): rerun the same command to
# continue. 75 is EX_TEMPFAIL in sysexits.h ("temporary failure; the user is invited to retry").
RERUN_EXIT_CODE = 75
