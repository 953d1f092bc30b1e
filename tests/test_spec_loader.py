"""Loading: marks on every node, safe YAML, duplicate keys, blocks (repeat, each, nesting,
outputs), layer defaults, did-you-mean, cross-section rules with their numbers, and one SpecError
listing every problem."""
from __future__ import annotations

import pytest

import flowctl as fc
from flowctl.spec import load_text
from flowctl.spec.schema import parse_bytes
from flowctl.spec.source import LocDict, load_yaml, locate

HEAD = """version: 1
model:
  layers:
    - {name: x, type: input, shape: [4]}
    - {name: hidden, type: dense, units: 3}
"""


def _error(text: str, filename: str = "s.yaml") -> str:
    with pytest.raises(fc.SpecError) as e:
        load_text(text, filename)
    assert "Traceback" not in str(e.value)
    return str(e.value)


def test_marks_are_recorded_for_keys_and_values():
    tree = load_yaml("a:\n  b: [1, {c: 2}]\n", "f.yaml")
    assert isinstance(tree, LocDict)
    assert str(locate(tree, ("a", "b", 1, "c"))[0]) == "f.yaml:2:14"
    assert str(locate(tree, ("a", "b"), key=True)[0]) == "f.yaml:2:3"


def test_yaml_is_loaded_safely():
    msg = _error("version: 1\nmodel: !!python/object/apply:os.system ['true']\n")
    assert "s.yaml:2:8" in msg and "could not determine a constructor" in msg


def test_duplicate_keys_inside_a_layer():
    msg = _error(HEAD + "    - {name: out, type: dense, units: 2, units: 3}\n")
    assert "s.yaml:6:42: duplicate key 'units' (first given at s.yaml:6:32)" in msg


def test_all_errors_are_listed_at_once():
    msg = _error("version: 1\nmodle: {}\ntraining: {stepz: 3}\n")
    assert msg.startswith("invalid spec (3 errors)")
    assert "unknown key 'modle'; did you mean 'model'?" in msg
    assert "s.yaml:3:12: training.stepz: unknown key 'stepz'; did you mean 'steps'?" in msg
    assert "missing required key 'model'" in msg


def test_unknown_key_without_a_close_match_lists_the_allowed_keys():
    msg = _error(HEAD.replace("units: 3}", "units: 3, zzz: 1}"))
    assert "unknown key 'zzz' (allowed: name, type, inputs, units, activation, use_bias, tie)" in msg


BLOCKS = """version: 1
model:
  blocks:
    inner:
      params: {f: null}
      layers:
        - {name: c, type: conv2d, filters: "${f}", kernel: 1}
    outer:
      params: {f: 2, pool: 2}
      layers:
        - {name: first, block: inner, params: {f: "${f}"}}
        - {name: side, type: conv2d, filters: 1, kernel: 1, inputs: [$input]}
        - {name: join, type: concat, inputs: [first, side]}
        - {name: pooled, type: max_pool, pool: "${pool}"}
      output: join
  layers:
    - {name: image, type: input, shape: [8, 8, 3]}
    - {name: stack, block: outer, repeat: 3, names: [s1, s2, s3], params: {f: 4}, each: [{}, {f: 5}, {pool: 4}]}
    - {name: after, type: flatten}
"""


def test_blocks_expand_with_repeat_each_nesting_and_output():
    loaded = load_text(BLOCKS, "b.yaml")
    names = list(loaded.layers)
    assert names[:5] == ["image", "s1/first/c", "s1/side", "s1/join", "s1/pooled"]
    # Instances chain on the block's declared output (join), not its last layer (pooled).
    assert loaded.layers["s2/first/c"].inputs == ["s1/join"]
    assert loaded.layers["s2/side"].inputs == ["s1/join"]
    assert loaded.layers["after"].inputs == ["s3/join"]
    # Shared params, then per-instance `each` overrides.
    assert [loaded.layers[f"s{i}/first/c"].layer.filters for i in (1, 2, 3)] == [4, 5, 4]
    assert loaded.layers["s3/pooled"].layer.pool == 4
    assert loaded.layers["s1/join"].output.shape == (None, 8, 8, 5)
    assert loaded.resolve("s2") == "s2/join"
    assert [i.name for i in loaded.instances if i.block == "outer"] == ["s1", "s2", "s3"]


def test_block_errors_point_at_the_definition_and_the_use():
    msg = _error(BLOCKS.replace('filters: "${f}", kernel: 1', 'filters: "${f}", kernel: 1, stride: 2'), "b.yaml")
    assert "b.yaml:7:63: model.layers[s1/first/c].stride: unknown key 'stride'; did you mean 'strides'?" in msg
    assert "instance 's1', used at b.yaml:18:7" in msg and "instance 's3', used at b.yaml:18:7" in msg
    msg = _error(BLOCKS.replace("each: [{}, {f: 5}, {pool: 4}]", "each: [{}, {f: 5}]"), "b.yaml")
    assert "b.yaml:18:89: model.layers[stack].each: 2 parameter sets in `each` for repeat 3" in msg
    msg = _error(BLOCKS.replace("{name: first, block: inner", "{name: first, block: outer"), "b.yaml")
    assert "block 'outer' uses itself: outer -> outer" in msg
    msg = _error(BLOCKS.replace("output: join", "output: jion"), "b.yaml")
    assert "block 'outer' has no layer 'jion'; did you mean 'join'?" in msg
    msg = _error(BLOCKS.replace("params: {f: 4}", "params: {ff: 4}"), "b.yaml")
    assert "block 'outer' has no parameter 'ff'; did you mean 'f'?" in msg


def test_missing_block_parameter():
    msg = _error(BLOCKS.replace("params: {f: 2, pool: 2}", "params: {f: null, pool: 2}")
                 .replace("params: {f: 4}, ", ""), "b.yaml")
    assert "b.yaml:18:7: model.layers[stack]: block 'outer' instance 's1' needs parameter(s) f" in msg


def test_layer_defaults_fill_and_point_at_the_defaults_line():
    text = HEAD.replace("model:\n", "model:\n  defaults:\n    dense: {activation: relu}\n")
    assert load_text(text).layers["hidden"].layer.activation == "relu"
    msg = _error(text.replace("activation: relu", "activation: rleu"))
    assert "s.yaml:4:25: model.layers[hidden].activation" in msg
    msg = _error(text.replace("dense: {", "dnese: {"))
    assert "unknown layer type 'dnese'; did you mean 'dense'?" in msg


def test_layers_may_only_read_earlier_layers():
    msg = _error(HEAD.replace("units: 3}", "units: 3, inputs: [later]}")
                 + "    - {name: later, type: dense, units: 2}\n")
    assert "unknown layer 'later' (layers may only read earlier layers)" in msg


def test_devices_are_canonicalised_and_checked():
    text = HEAD + """devices:
  - cpu:0
  - {name: gpu:1, profile: {memory: 16GiB}, links: {cpu:0: {bandwidth: 1.0e10}, gpu:7: {bandwidth: 1.0e9}}}
  - worker1/gpu:0
"""
    msg = _error(text)
    assert "link to unknown device /job:localhost/task:0/device:gpu:7" in msg
    assert "job 'worker', which needs `cluster: {type: ray}`" in msg
    ok = load_text(text.replace(", gpu:7: {bandwidth: 1.0e9}", "") + "cluster: {type: ray, address: auto}\n")
    names = [d.name for d in ok.spec.devices]
    assert names == ["/job:localhost/task:0/device:cpu:0", "/job:localhost/task:0/device:gpu:1",
                     "/job:worker/task:1/device:gpu:0"]
    assert ok.spec.devices[1].profile.memory == 16 * 2**30


def test_ray_cluster_keys_are_checked():
    ok = load_text(HEAD + "devices: [worker0/cpu:0, worker1/cpu:0]\ncluster: {type: ray, workers: 2}\n")
    assert (ok.spec.cluster.workers, ok.spec.cluster.max_failures, ok.spec.cluster.address) == (2, 3, None)
    from flowctl.engine.cluster import LINKS
    from flowctl.training.program import cluster_for, step_config

    planned = cluster_for(step_config(ok))  # place and bench plan a transfer between tasks as a Ray hop
    assert planned.link(*planned.names) == LINKS["ray"]
    ok = load_text(HEAD + "cluster: {type: ray, address: 'ray://head.example:10001', max_failures: 0}\n")
    assert ok.spec.cluster.max_failures == 0
    assert "cannot read Ray address 'http://head'" in _error(HEAD + "cluster: {type: ray, address: 'http://head'}\n")
    assert "a local cluster takes no address, workers, max_failures or resources" in _error(
        HEAD + "cluster: {max_failures: 5}\n")
    pinned = load_text(HEAD + "cluster: {type: ray, resources: {worker1: {gpu_box: 1}}}\n").spec.cluster.resources
    from flowctl.engine.distributed import task_resources

    assert task_resources(pinned) == {1: {"gpu_box": 1.0}}
    assert "resources are keyed by worker task ('worker0', 'worker1', ...), not 'gpu1'" in _error(
        HEAD + "cluster: {type: ray, resources: {gpu1: {x: 1}}}\n")
    msg = _error(HEAD + "devices: [worker0/cpu:0, worker2/cpu:0]\ncluster: {type: ray, workers: 2}\n")
    assert "device /job:worker/task:2/device:cpu:0 is on worker task 2, but the cluster starts 2 worker(s)" in msg


def test_parallelism_and_batch_rules_give_the_numbers():
    assert load_text(HEAD + "parallelism: {strategy: sync_data_parallel, replicas: 4}\n"
                     "training: {per_replica_batch_size: 8}\n").global_batch == 32
    assert load_text(HEAD + "parallelism: {strategy: sync_data_parallel, replicas: 4}\n"
                     "training: {batch_size: 64}\n").per_replica_batch == 16
    msg = _error(HEAD + "parallelism: {strategy: sync_data_parallel, replicas: 4}\ntraining: {batch_size: 30}\n")
    assert "batch_size 30 does not split evenly over 4 replicas (30 / 4 = 7.50)" in msg
    msg = _error(HEAD + "parallelism: {strategy: async_data_parallel, replicas: 3, devices: [cpu:0]}\n")
    assert "async_data_parallel: 1 device(s) listed for 3 replica(s)" in msg
    msg = _error(HEAD + "parallelism: {strategy: model_parallel}\n")
    assert "model_parallel needs `groups` assigning layers to devices" in msg
    msg = _error(HEAD + "parallelism: {strategy: pipeline, groups: [{layers: [hiden], device: cpu:0}]}\n")
    assert "pattern 'hiden' matches no layer; did you mean 'hidden'?" in msg


def test_constraints_match_layers_and_the_nodes_under_them():
    ok = load_text(HEAD + "placement:\n  constraints: [{match: 'hidden/*', device: cpu}]\n"
                   "  colocate: [[x, 'hid*']]\n")
    assert ok.spec.placement.constraints[0].device == "cpu"
    msg = _error(HEAD + "placement:\n  colocate: [[x]]\n")
    assert "a colocation group needs 2 or more patterns, got 1" in msg


def test_text_data_is_checked_against_the_model_inputs(tmp_path):
    (tmp_path / "c.txt").write_text("a b c\n")
    text = """version: 1
model:
  layers:
    - {name: tokens, type: input, shape: [5], dtype: int32, classes: 50}
    - {name: emb, type: embedding, vocab: 50, dim: 8}
    - {name: targets, type: input, shape: [5], dtype: int32, classes: 50}
data: {source: text, path: c.txt, vocab_size: 100, target: targts}
"""
    msg = _error_in(text, tmp_path)
    assert "vocab_size 100 exceeds input 'tokens' classes 50" in msg
    assert "'targts' is not a model input; did you mean 'targets'?" in msg


def _error_in(text: str, base) -> str:
    with pytest.raises(fc.SpecError) as e:
        load_text(text, "t.yaml", base_dir=base)
    return str(e.value)


def test_parse_bytes():
    assert parse_bytes("16GiB") == 16 * 2**30 and parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes(1024) == 1024 and parse_bytes("512 MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="cannot read size"):
        parse_bytes("lots")


def test_spec_must_be_a_mapping_and_files_must_exist(tmp_path):
    assert "a spec is a mapping" in _error("- 1\n- 2\n")
    from flowctl.spec import load_spec

    with pytest.raises(fc.SpecError, match="no such spec file"):
        load_spec(tmp_path / "nope.yaml")


def test_a_block_use_inside_a_block_is_checked_too():
    msg = _error(BLOCKS.replace("{name: first, block: inner, params", "{name: first, block: inner, repaet: 2, params"),
                 "b.yaml")
    assert "b.yaml:11:39: model.blocks.outer.layers[first].repaet: unknown key 'repaet'; did you mean 'repeat'?" in msg


@pytest.mark.parametrize("lr, says", [
    (".nan", "finite and > 0"), (".inf", "finite and > 0"), ("1e400", "finite and > 0"), ("-1", "finite and > 0"),
    ("{initial: .inf}", "finite number"),
    ("{schedule: piecewise, boundaries: [5], values: [.nan, 0.1]}", "finite and > 0"),
    ("{schedule: piecewise, boundaries: [5], values: [-1, 0.1]}", "finite and > 0")])
def test_a_learning_rate_that_is_not_a_finite_positive_number_is_a_spec_error(lr, says):
    import re
    from pathlib import Path

    from flowctl.engine.errors import SpecError

    base = (Path(__file__).resolve().parents[1] / "specs" / "demo.yaml").read_text()
    text = re.sub(r"learning_rate:.*", f"learning_rate: {lr}", base)
    with pytest.raises(SpecError) as e:
        load_text(text, "demo.yaml")
    assert "demo.yaml:" in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("old, new, key", [
    ("units: 650, init_scale: 0.05}\n    - {name: dropout_1", "units: true, init_scale: 0.05}\n    - {name: dropout_1",
     "units: a number, not true"),
    ("batch_size: 20", "batch_size: true", "batch_size: a number, not true"),
    ("rate: 0.5}\n    - {name: lstm_1", "rate: false}\n    - {name: lstm_1", "rate: a number, not false")])
def test_true_or_false_where_a_number_goes_is_a_spec_error(old, new, key):
    from pathlib import Path

    from flowctl.engine.errors import SpecError

    base = (Path(__file__).resolve().parents[1] / "specs" / "lstm_lm.yaml").read_text()
    assert old in base
    with pytest.raises(SpecError, match="lstm_lm.yaml:\\d+:\\d+: .*" + key):
        load_text(base.replace(old, new, 1), "lstm_lm.yaml")
