"""The numeric kernels, one per (op, device type), written against an array module (numpy, cupy).
Importing the package imports every kernel module, which fills the table in `registry`."""
from flowctl.kernels import (  # noqa: F401
    array, communication, control, conv, elementwise, fused, indexing, matrix, nn, queues, random, recurrent, reduction, state,
    training,
)
from flowctl.kernels.cuda import cudnn  # noqa: F401,E402 -- gpu Conv2D/backprops/FusedBatchNorm via cuDNN, generic fallback
from flowctl.kernels.cuda import kernels as cuda_kernels  # noqa: F401,E402 -- our numba-cuda kernels on gpu (issue 30)
from flowctl.kernels.cuda import state as cuda_state  # noqa: F401,E402 -- gpu state writes under the step's guard
from flowctl.kernels.cuda import fused as cuda_fused  # noqa: F401,E402 -- gpu FusedElementwise: one generated kernel
from flowctl.kernels.cpu import batchnorm as cpu_batchnorm  # noqa: F401,E402 -- numba variants (issue 32)
from flowctl.kernels.cpu import pool as cpu_pool  # noqa: F401,E402
from flowctl.kernels.cpu import winograd as cpu_winograd  # noqa: F401,E402 -- tried before cpu_conv's variant
from flowctl.kernels.cpu import conv as cpu_conv  # noqa: F401,E402
from flowctl.kernels.cpu import recurrent as cpu_recurrent  # noqa: F401,E402
from flowctl.kernels.cpu import lstm_cell as cpu_lstm_cell  # noqa: F401,E402
from flowctl.kernels.cpu import softmax as cpu_softmax  # noqa: F401,E402
from flowctl.kernels.cpu import dropout as cpu_dropout  # noqa: F401,E402
