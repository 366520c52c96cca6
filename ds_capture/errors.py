"""The one exception type for anything a user controls (config, data, layout, output directory).

The CLI prints a ``CaptureError`` as a message and exits non-zero, never as a traceback; every
message names the file / key / row at fault, the constraint, and the fix.
"""


class CaptureError(Exception):
    """A user-facing error: bad config, bad data row, impossible layout, foreign output dir."""
