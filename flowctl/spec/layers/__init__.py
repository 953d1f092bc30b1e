"""The layer library: one registry (`LAYERS`) keyed by layer type. Importing this package
registers every layer type."""
from flowctl.spec.layers import conv, core, norm, recurrent, transformer  # noqa: F401  (registers the layer types)
from flowctl.spec.layers.base import LAYERS, Builder, Layer, LayerError, Strict, Weight, count

__all__ = ["LAYERS", "Builder", "Layer", "LayerError", "Strict", "Weight", "count"]
