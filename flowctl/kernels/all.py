"""Imports every kernel module so their registrations run (loaded on first kernel lookup)."""
from flowctl.kernels import (  # noqa: F401
    array, communication, conv, elementwise, matrix, nn, queues, random, recurrent, reduction, state,
)
