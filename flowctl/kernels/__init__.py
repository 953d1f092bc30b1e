"""The numeric kernels, one per (op, device type), written against an array module (numpy, cupy).
Importing the package imports every kernel module, which fills the table in `registry`."""
from flowctl.kernels import array, communication, conv, elementwise, matrix, nn, queues, random, reduction, state  # noqa: F401,E501
