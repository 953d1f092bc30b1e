"""The dataflow engine: graph IR, ops, autodiff, passes, sessions and executors."""
