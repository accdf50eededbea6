"""The default: ``hotness`` until a step has been recorded, then ``opt`` for every block whose
future the recording knows and ``hotness`` for the rest (routed experts, branches), except in the
second step, where hotness knows no more than the recording (``Opt._predict``)."""

from __future__ import annotations

from .hotness import Hotness
from .opt import Opt


class Auto(Opt):
    name = "auto"

    def __init__(self) -> None:
        super().__init__(fallback=Hotness())
