"""random kernels."""
from __future__ import annotations
