"""The op library. Importing this package registers every op (an OpDef in `flowctl.engine.opdef`)
and installs Tensor's operators (`api`). The graph imports none of it: whoever builds a graph by
op name imports this package first (`import flowctl` does)."""
from flowctl.engine.ops import (  # noqa: F401
    api,
    array,
    communication,
    control,
    conv,
    elementwise,
    fused,
    indexing,
    matrix,
    nn,
    queues,
    random,
    recurrent,
    reduction,
    state,
    training,
)
