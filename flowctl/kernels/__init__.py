"""The numeric kernels, one per (op, device type), written against an array module (numpy, cupy).
Importing the package imports every kernel module, which fills the table in `registry`."""
from flowctl.kernels import (  # noqa: F401
    array, communication, control, conv, elementwise, fused, indexing, matrix, nn, queues, random, recurrent, reduction, state,
    training,
)
