"""flowctl: a declarative runner for dataflow machine learning (TensorFlow whitepaper, 2015).

The Python API (`import flowctl as fc`) builds the same `Graph` the YAML front end builds.
"""
from __future__ import annotations

__version__ = "0.1.0"

from flowctl.engine import ops as _ops  # noqa: F401  (registers every op)
from flowctl.engine.autodiff import gradients
from flowctl.engine.container import ContainerStore, process_store
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
    abs_, add, add_n, cast, div, equal, exp, greater, less, log, maximum, minimum, mul, neg,
    ones_like, pow_, relu, rsqrt, select, sigmoid, sign, sqrt, square, sub, tanh, zeros_like,
)
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
from flowctl.engine.session import Session
from flowctl.engine.runtime import DistributedSession
