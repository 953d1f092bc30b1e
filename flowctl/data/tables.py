"""Examples from a table: a CSV or Parquet file read through pyarrow, one example per row.

Named feature columns feed the model's one float input, in the order listed; a label column feeds
its one integer input. What the encoding learns comes from the training split only (the rows
training reads) and is kept by the run as RUN/table.json (flowctl.training.inputs), so resume,
evaluate and predict encode every file as the first start did, even if the file changed since:

- the label's classes, sorted, class i being id i;
- each categorical column's vocabulary, sorted; a value becomes a one-hot block of that width in
  the features, where it stands in `features` (one float input, as an MLP reads it: ids would need
  an integer input and an embedding per column);
- each numeric column's mean and standard deviation (population, float64); a feature is
  (value - mean) / std, std 1 for a constant column.

A value the training split never held (a label, or a categorical value) is an error naming it, never
a silent zero row. Rows are examples in file order; batching, shuffling and the cursor are the
array source's (each epoch a permutation of (seed, epoch), the last partial batch dropped).

pyarrow is an optional dependency (`pip install 'flowctl[tables]'`), imported only when a spec
names a table.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from flowctl.data.arrays import ArraySource, rows_of
from flowctl.data.base import InputSpec
from flowctl.engine.errors import SpecError

NEEDS = "a table source needs the pyarrow package: pip install 'flowctl[tables]'"
FORMATS = {".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
ENCODING_FORMAT = "flowctl-table"
ENCODING_VERSION = 1


def pyarrow_module() -> Any:
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise SpecError(NEEDS) from None
    return pyarrow


def table_format(path: str | Path, fmt: str | None = None) -> str:
    """`csv` or `parquet`: `fmt` when given, else from the file's suffix."""
    if fmt:
        return fmt
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise SpecError(f"{path}: cannot tell a table's format from its name: name it .csv or .parquet, "
                        f"or set data.format")
    return kind


def table_columns(path: str | Path, fmt: str | None = None) -> list[str]:
    """The column names of a table, reading only its schema (Parquet) or its header (CSV's first
    block), so a spec check does not read the data."""
    pa = pyarrow_module()
    kind = table_format(path, fmt)
    try:
        if kind == "parquet":
            return list(pa.parquet.read_schema(path).names)
        with pa.csv.open_csv(path) as reader:
            return list(reader.schema.names)
    except (pa.ArrowException, OSError) as e:
        raise SpecError(f"{path}: cannot read a {kind} table: {e}") from None


def read_table(path: str | Path, columns: Sequence[str], fmt: str | None = None) -> dict[str, np.ndarray]:
    """The named columns of a table as numpy arrays: numbers as int64/float64/bool, text as str."""
    pa = pyarrow_module()
    kind = table_format(path, fmt)
    names = list(dict.fromkeys(columns))
    try:
        if kind == "parquet":
            table = pa.parquet.read_table(path, columns=names)
        else:
            table = pa.csv.read_csv(path, convert_options=pa.csv.ConvertOptions(include_columns=names))
    except (pa.ArrowException, OSError) as e:
        raise SpecError(f"{path}: cannot read the {kind} table: {e}") from None
    out = {}
    for name in names:
        col = table.column(name)
        if col.null_count:
            row = col.to_pylist().index(None)
            raise SpecError(f"{path}: row {row + 1}: column '{name}' is empty (tables may not have missing values)")
        if pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
            out[name] = np.asarray(col.to_pylist(), dtype=str)
        elif pa.types.is_integer(col.type) or pa.types.is_floating(col.type) or pa.types.is_boolean(col.type):
            out[name] = np.asarray(col.to_numpy())
        else:
            raise SpecError(f"{path}: column '{name}' is {col.type}: a table column must hold numbers or text")
    return out


def _ids(vocab: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int | None]:
    """Each value's index in the sorted `vocab`, and the first row whose value is not there."""
    if vocab.dtype.kind != values.dtype.kind and {vocab.dtype.kind, values.dtype.kind} - {"i", "u", "b"}:
        vocab, values = vocab.astype(str), values.astype(str)  # text against numbers: compare as written
    ids = np.minimum(np.searchsorted(vocab, values), len(vocab) - 1)
    bad = np.flatnonzero(vocab[ids] != values)
    return ids, (int(bad[0]) if len(bad) else None)


def _shown(values: np.ndarray, most: int = 12) -> str:
    items = [str(v) for v in values[:most].tolist()]
    return ", ".join(items) + (f", ... ({len(values)} in all)" if len(values) > most else "")


@dataclass(frozen=True)
class TableEncoding:
    """What a run learned from its training split, and how it turns rows into examples."""

    features: tuple[str, ...]
    label: str
    classes: np.ndarray  # the label's values, sorted: id i is classes[i]
    categories: Mapping[str, np.ndarray]  # categorical column -> its sorted vocabulary
    stats: Mapping[str, tuple[float, float]]  # numeric column -> (mean, std)

    @property
    def width(self) -> int:
        """The float input's width: one value per numeric column, a one-hot block per categorical."""
        return sum(len(self.categories[c]) if c in self.categories else 1 for c in self.features)

    @property
    def columns(self) -> list[str]:
        return [*self.features, self.label]

    def layout(self) -> str:
        return ", ".join(f"{c} (one-hot {len(self.categories[c])})" if c in self.categories else c
                         for c in self.features)

    @classmethod
    def learn(cls, columns: Mapping[str, np.ndarray], features: Sequence[str], label: str,
              categorical: Sequence[str] = (), where: str | Path = "the table") -> "TableEncoding":
        stats: dict[str, tuple[float, float]] = {}
        for c in features:
            if c in categorical:
                continue
            v = columns[c]
            if v.dtype.kind not in "iufb":
                raise SpecError(f"{where}: column '{c}' holds text ({v[0]!r}, ...): list it in data.categorical, "
                                f"or give numbers")
            v = v.astype(np.float64)
            std = float(v.std())
            stats[c] = (float(v.mean()), std if std > 0 else 1.0)
        return cls(tuple(features), label, np.unique(columns[label]),
                   {c: np.unique(columns[c]) for c in categorical}, stats)

    def encode(self, columns: Mapping[str, np.ndarray], where: str | Path = "the table",
               first_row: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(features float32 [rows, width], label ids int64 [rows]). `first_row`: the row number
        of the first of these rows in the file, for messages."""
        y = self.labels_of(columns, where, first_row)
        return self.features_of(columns, where, first_row), y

    def labels_of(self, columns: Mapping[str, np.ndarray], where: str | Path = "the table",
                  first_row: int = 0) -> np.ndarray:
        y, bad = _ids(self.classes, columns[self.label])
        if bad is not None:
            raise SpecError(f"{where}: row {first_row + bad + 1}: label '{self.label}' is "
                            f"{columns[self.label][bad].item()!r}, a class the training split does not have "
                            f"(its classes: {_shown(self.classes)})")
        return y.astype(np.int64)

    def features_of(self, columns: Mapping[str, np.ndarray], where: str | Path = "the table",
                    first_row: int = 0) -> np.ndarray:
        n = len(columns[self.features[0]])
        parts = []
        for c in self.features:
            if c in self.categories:
                vocab = self.categories[c]
                ids, bad = _ids(vocab, columns[c])
                if bad is not None:
                    raise SpecError(f"{where}: row {first_row + bad + 1}: categorical column '{c}' is "
                                    f"{columns[c][bad].item()!r}, a value the training split does not have "
                                    f"(its values: {_shown(vocab)})")
                parts.append(np.eye(len(vocab), dtype=np.float32)[ids])
            else:
                v = columns[c]
                if v.dtype.kind not in "iufb":
                    raise SpecError(f"{where}: column '{c}' holds text ({v[0]!r}, ...), the training split numbers")
                mean, std = self.stats[c]
                parts.append(((v.astype(np.float64) - mean) / std).astype(np.float32)[:, None])
        return np.concatenate(parts, axis=1) if parts else np.zeros((n, 0), np.float32)

    def problem(self, inputs: Sequence[InputSpec]) -> str | None:
        """Why the model's inputs cannot take this encoding's examples, or None."""
        x, y = table_inputs(inputs)
        if x.shape != (self.width,):
            return (f"the features encode to {self.width} values ({self.layout()}), but the model's input "
                    f"'{x.name}' has shape {list(x.shape)}: make it [{self.width}]")
        if y.classes is not None and len(self.classes) > y.classes:
            return (f"label '{self.label}' has {len(self.classes)} classes in the training split "
                    f"({_shown(self.classes)}), but the model's input '{y.name}' has classes: {y.classes}")
        return None

    # ------------------------------------------------------------------ RUN/table.json
    def to_json(self) -> str:
        return json.dumps({"format": ENCODING_FORMAT, "version": ENCODING_VERSION, "features": list(self.features),
                           "label": self.label, "classes": self.classes.tolist(),
                           "categorical": {c: v.tolist() for c, v in self.categories.items()},
                           "numeric": {c: {"mean": m, "std": s} for c, (m, s) in self.stats.items()}},
                          indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "TableEncoding":
        try:
            d = json.loads(text)
            if d.get("format") != ENCODING_FORMAT or d.get("version") != ENCODING_VERSION:
                raise ValueError(f"format {d.get('format')!r} version {d.get('version')!r}")
            return cls(tuple(d["features"]), d["label"], np.asarray(d["classes"]),
                       {c: np.asarray(v) for c, v in d["categorical"].items()},
                       {c: (float(s["mean"]), float(s["std"])) for c, s in d["numeric"].items()})
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"{type(e).__name__}: {e}") from None


def table_inputs(inputs: Sequence[InputSpec]) -> tuple[InputSpec, InputSpec]:
    """The model inputs a table feeds: its one float input [width] and one integer input []."""
    floats = [i for i in inputs if not i.is_int]
    ints = [i for i in inputs if i.is_int]
    if len(floats) != 1 or len(floats[0].shape) != 1 or len(ints) != 1 or ints[0].shape != ():
        raise SpecError("a table source feeds two model inputs, a float input of shape [features] and an "
                        "integer label input of shape []; the model has "
                        + ", ".join(f"{i.name} {list(i.shape)} {i.dtype}" for i in inputs))
    return floats[0], ints[0]


def learn_table(config: Mapping[str, Any], base_dir: str | Path = ".") -> TableEncoding:
    """The encoding of a table source, learned on its training split: all of `path` but a held-out
    `validation_fraction`."""
    path = Path(base_dir) / config["path"]
    features, label = list(config["features"]), config["label"]
    columns = read_table(path, [*features, label], config.get("format"))
    lo, hi = rows_of(len(columns[label]), (0.0, 1.0 - (config.get("validation_fraction") or 0.0)))
    return TableEncoding.learn({k: v[lo:hi] for k, v in columns.items()}, features, label,
                               config.get("categorical") or [], where=path)


class TableSource(ArraySource):
    kind = "table"

    def __init__(self, inputs: list[InputSpec], batch_size: int, path: str | Path, encoding: TableEncoding,
                 fmt: str | None = None, shuffle: bool = True, seed: int = 0,
                 part: tuple[float, float] = (0.0, 1.0)) -> None:
        self.encoding = encoding
        self.format = fmt
        super().__init__(inputs, batch_size, path, shuffle=shuffle, seed=seed, part=part)

    def _read(self, inputs: list[InputSpec], features: dict[str, str], part: tuple[float, float]) -> dict[str, np.ndarray]:
        problem = self.encoding.problem(inputs)
        if problem:
            raise SpecError(f"data.features: {problem}")
        x, y = table_inputs(inputs)
        columns = read_table(self.path, self.encoding.columns, self.format)
        lo, hi = rows_of(len(columns[self.encoding.label]), part)
        xs, ys = self.encoding.encode({k: v[lo:hi] for k, v in columns.items()}, self.path, first_row=lo)
        return {x.name: xs, y.name: ys}
