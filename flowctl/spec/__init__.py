"""The YAML front end: spec schema, loading with file:line:col errors, block expansion, and the
layer library that emits engine graph nodes. Imports only the engine's public API."""
from __future__ import annotations

from flowctl.spec.check import LayerInfo, LoadedSpec
from flowctl.spec.loader import load_spec, load_text
from flowctl.spec.schema import Spec, json_schema

__all__ = ["LayerInfo", "LoadedSpec", "Spec", "json_schema", "load_spec", "load_text"]
