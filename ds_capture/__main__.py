"""``python -m ds_capture ...`` is the same as the ``ds-capture`` console script."""

from ds_capture.cli import entry

if __name__ == "__main__":
    entry()
