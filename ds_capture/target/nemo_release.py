"""Where one release-checkpoint tensor goes in a NeMo AutoModel model: the shared vocabulary of the per-family maps.

In:  nothing (a data type).
Out: :class:`Placement`, what a family's ``*_placement(release_key, ...)`` (e.g. :func:`.nemo_k3.k3_placement`)
     returns for one logical release key, so a sliced per-rank loader can fill a model built on ``meta`` one
     tensor at a time, without the whole state dict and without the experts another rank owns.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """One release tensor's destination in the NeMo model's state dict, and the steps that take it there."""

    native: str
    """The NeMo model's state-dict name."""
    expert: int | None = None
    """The global expert index j when the release tensor is one expert's piece of a stacked ``[E, ...]`` tensor."""
    index: tuple = ()
    """Slices saying where inside ``native[expert]`` (or ``native``) the transformed tensor goes; ``()`` = all of it."""
    transpose: bool = False
    """Transpose the release tensor's last two dims before placing it."""
    narrow: tuple[int, int, int] | None = None
    """``(dim, start, length)`` applied to the release tensor before placing it (a zero-padded release tensor)."""
