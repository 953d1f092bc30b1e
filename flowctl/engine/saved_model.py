"""A trained model saved for inference (`flowctl export`): the inference GraphDef (`model.json`),
its Variables' values (`weights.safetensors`) and `signature.json` (the inputs by name with their
tensors, shapes and dtypes, the outputs, and a language model's vocabulary). Loading it needs no
spec: the graph carries every attribute (§2, GraphDef).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from flowctl.engine.container import ContainerStore
from flowctl.engine.errors import CheckpointError
from flowctl.engine.graph import Graph
from flowctl.engine.session import Session

EXPORT_FORMAT = "flowctl-model"
EXPORT_VERSION = 1


class LoadedModel:
    """An exported model (`flowctl export`), runnable without its spec: `predict` feeds inputs by
    name and returns the named outputs (`logits`, `loss`)."""

    def __init__(self, directory: str | Path, device: str = "cpu:0") -> None:
        from safetensors.numpy import load_file

        d = Path(directory)
        try:
            self.signature: dict[str, Any] = json.loads((d / "signature.json").read_text())
            graph = Graph.from_json((d / "model.json").read_text())
            weights = load_file(str(d / "weights.safetensors"))
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{d}: not a flowctl export ({type(e).__name__}: {e})") from None
        if self.signature.get("format") != EXPORT_FORMAT:
            raise CheckpointError(f"{d}: not a flowctl export (format {self.signature.get('format')!r})")
        self.graph = graph
        self.session = Session(graph, device=device, store=ContainerStore())
        self.session.load_variables(weights)

    @property
    def inputs(self) -> dict[str, dict[str, Any]]:
        return dict(self.signature["inputs"])

    def predict(self, feeds: Mapping[str, Any], outputs: tuple[str, ...] = ("logits",)) -> dict[str, np.ndarray]:
        sig = self.signature
        refs = {name: sig["outputs"][name] for name in outputs}
        fed = {sig["inputs"][k]["tensor"]: v for k, v in feeds.items() if k in sig["inputs"]}
        values = self.session.run(list(refs.values()), fed)
        return {name: np.asarray(v) for name, v in zip(refs, values)}


def load_model(directory: str | Path, device: str = "cpu:0") -> LoadedModel:
    """An exported model, ready to `predict` (flowctl.load_model)."""
    return LoadedModel(directory, device)


__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "LoadedModel", "load_model"]
