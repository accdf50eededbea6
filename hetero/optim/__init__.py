"""Optimizers whose state is placed by the hetero runtime (see :mod:`hetero.optim.adam`)."""

from .adam import Adam, AdamW
from .scaler import GradScaler

__all__ = ["Adam", "AdamW", "GradScaler"]
