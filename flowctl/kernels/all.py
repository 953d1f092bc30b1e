"""Imports every kernel module so their registrations run (loaded on first kernel lookup)."""
from flowctl.kernels import array, communication, control, conv, elementwise, matrix, nn, queues, random, reduction, state  # noqa: F401
