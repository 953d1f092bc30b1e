"""The Python API, the names of `import flowctl as fc` (the package loads this module on first use):
it builds the same `Graph` the YAML front end builds. Importing it registers every op."""
from __future__ import annotations

from flowctl.engine import ops as _ops  # noqa: F401  (registers every op)
from flowctl.engine.autodiff import gradients
from flowctl.engine.container import ContainerStore, process_store
from flowctl.engine.control_flow import cond, while_loop
from flowctl.engine.errors import (
    CheckpointError,
    ExecutionError,
    FlowctlError,
    GraphError,
    NonFiniteError,
    PlacementError,
    SpecError,
)
from flowctl.engine.executor import RunStats
from flowctl.engine.graph import Graph, Node, Tensor, default_graph, reset_default_graph
from flowctl.engine.ops.api import constant
from flowctl.engine.ops.array import *  # noqa: F401,F403
from flowctl.engine.ops.conv import *  # noqa: F401,F403
from flowctl.engine.ops.control import check_numerics, group, identity, no_op, stop_gradient
from flowctl.engine.ops.elementwise import (
    abs_, add, add_n, cast, ceil, cos, div, equal, erf, exp, floor, floordiv, floormod, gelu, gelu_tanh, greater,
    is_inf, is_nan, less, log, maximum, minimum, mod, mul, neg, ones_like, pow_, relu, round_, round_bf16, rsqrt,
    select, sigmoid, sign, sin, sqrt, square, sub, tanh, truncatemod, zeros_like,
)
from flowctl.engine.ops.indexing import *  # noqa: F401,F403
from flowctl.engine.ops.matrix import *  # noqa: F401,F403
from flowctl.engine.ops.queues import *  # noqa: F401,F403
from flowctl.engine.ops.nn import *  # noqa: F401,F403
from flowctl.engine.ops.random import *  # noqa: F401,F403
from flowctl.engine.ops.recurrent import lstm_block_cell, recurrent_matmul, transpose_copy
from flowctl.engine.ops.reduction import *  # noqa: F401,F403
from flowctl.engine.ops.state import (
    assign, assign_add, assign_sub, global_variables_initializer, placeholder, trainable_variables,
    variable, variables,
)
from flowctl.engine.ops.training import apply_gradient_descent, l2_loss
from flowctl.engine.saved_model import LoadedModel, load_model
from flowctl.engine.session import Session
from flowctl.version import __version__
from flowctl.engine.runtime import DistributedSession
