"""The op library. Importing this package registers every op (OpDef) in the registry."""
from flowctl.engine.ops import (  # noqa: F401
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
