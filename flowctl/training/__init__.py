"""Training runs: the loop, learning-rate schedules, and the run directory (whitepaper §3.3).

This package joins the spec front end, the data sources and the engine, so it sits beside the CLI
in the import order: it may import spec, data and engine; the engine never imports it.
"""
