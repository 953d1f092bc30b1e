"""Checkpoints (whitepaper §3.3, issue 4): the on-disk layout, lossless state, bitwise-exact RNG
continuation through a session, pruning, one-line errors for each damaged file with fallback to
the previous checkpoint, failed saves that leave the last good checkpoint alone, and a SIGKILL at
every phase of a save in a real child process."""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import flowctl as fc
from flowctl.engine import checkpoint as ck
from flowctl.engine.checkpoint import (
    SAVE_PHASES, CheckpointDir, CheckpointWarning, apply, capture, decode_state, encode_state,
)
from flowctl.engine.optimizers import Momentum

HERE = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("crash_child", HERE / "crash_child.py")
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)


def tensor_ranges(path: Path) -> dict[str, tuple[int, int]]:
    """Absolute byte ranges of each tensor's data, read from the safetensors header by hand
    (8-byte little-endian header length, JSON header, then the data), not through the library."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def assert_same(a: Any, b: Any) -> None:
    """Equal values AND equal types all the way down (a tuple is not a list, int32 is not int64)."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, float) and np.isnan(a):
        assert np.isnan(b)
    else:
        assert a == b


def collect() -> tuple[list[str], Any]:
    seen: list[str] = []
    return seen, seen.append


# ---------------------------------------------------------------------------- layout and round trip
def test_save_writes_the_committed_layout_and_loads_back_exactly(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "dense/w": rng.standard_normal((5, 3)).astype(np.float32),
        "dense/w/Momentum/momentum": rng.standard_normal((5, 3)).astype(np.float32),
        "count": np.asarray(np.int64(7)),                       # 0-d
        "mask": rng.random(6) > 0.5,                            # bool
        "t": np.arange(12.0).reshape(3, 4).T,                   # not C-contiguous
        "be": np.arange(4, dtype=">i4"),                        # big-endian input
        "empty": np.zeros((0, 2), np.float64),
    }
    state = {"data_cursor": {"epoch": 2, "index": 17}, "lr_step": 40, "names": ("a", "b")}
    m = CheckpointDir(tmp_path, keep=5, spec_hash="abc123")
    path = m.save(40, tensors, state)
    assert path == tmp_path / "ckpt-00000040"
    assert sorted(os.listdir(path)) == ["COMMIT", "manifest.json", "tensors.safetensors"]
    assert (tmp_path / "latest").read_text() == "ckpt-00000040\n"
    raw = (path / "manifest.json").read_bytes()
    assert (path / "COMMIT").read_text().strip() == hashlib.sha256(raw).hexdigest()
    man = json.loads(raw)
    assert man["step"] == 40 and man["spec_hash"] == "abc123" and man["flowctl_version"] == fc.__version__
    w = man["tensors"]["dense/w"]
    assert w["dtype"] == "float32" and w["shape"] == [5, 3]
    assert w["sha256"] == hashlib.sha256(tensors["dense/w"].tobytes()).hexdigest()
    assert man["tensors"]["be"]["sha256"] == hashlib.sha256(np.arange(4, dtype="<i4").tobytes()).hexdigest()
    # Safetensors: a length-prefixed JSON header, no pickle opcodes (0x80 PROTO) at the start.
    data = (path / "tensors.safetensors").read_bytes()
    assert data[0] != 0x80 and set(tensor_ranges(path / "tensors.safetensors")) == set(tensors)

    got = m.restore_latest()
    assert got.step == 40 and got.path == path and got.warnings == []
    for k, v in tensors.items():
        want = np.asarray(v, dtype=v.dtype.newbyteorder("="), order="C")
        assert_same(got.tensors[k], want)
    assert_same(got.state, state)
    assert m.latest() == path and m.list() == [path]


def test_state_codec_is_lossless():
    pcg = np.random.Generator(np.random.PCG64(7))
    pcg.random(3)
    state = {
        "tuple": (1, 2.5, "x", None, True), "int_keys": {0: "a", 3: [1, 2]}, "tuple_keys": {(1, 2): 3},
        "nan": float("nan"), "inf": float("-inf"), "big": 2**100, "f32": np.float32(1.1), "i8": np.int8(-3),
        "arrays": [np.arange(5, dtype=np.uint64) * (2**63 // 5), np.array([[1.5, np.nan]], np.float16),
                   np.array([1 + 2j], np.complex128), np.zeros((2, 0), np.int32)],
        "pcg": pcg.bit_generator.state, "float": 0.1 + 0.2,
    }
    text = json.dumps(encode_state(state), allow_nan=False)  # strict JSON
    back = decode_state(json.loads(text))
    assert_same(back, state)
    with pytest.raises(fc.CheckpointError, match="reserved"):
        encode_state({"__tuple__": 1})
    with pytest.raises(fc.CheckpointError, match=r"state\.cursor: cannot store a set"):
        encode_state({"cursor": {1, 2}})


def test_rng_state_through_json_continues_bitwise():
    # Odd draws leave Philox mid-buffer with a pending 32-bit half: the whole state must survive.
    gen = np.random.Generator(np.random.Philox(key=123))
    gen.standard_normal(5)
    gen.integers(0, 2**31, size=3, dtype=np.uint32)
    st = decode_state(json.loads(json.dumps(encode_state(gen.bit_generator.state))))
    after = np.random.Generator(np.random.Philox(key=1))
    after.bit_generator.state = st
    assert gen.bit_generator.state["has_uint32"] == 1
    for _ in range(3):
        a, b = gen.integers(0, 2**31, size=5, dtype=np.uint32), after.integers(0, 2**31, size=5, dtype=np.uint32)
        assert a.tobytes() == b.tobytes()
        assert gen.standard_normal(7).tobytes() == after.standard_normal(7).tobytes()


def build_noisy_model(seed: int) -> tuple[fc.Graph, Any, Any, Momentum]:
    """w follows a noisy target (a random op each step) under Momentum: variables, a slot and RNG."""
    g = fc.Graph(seed=seed)
    with g.as_default():
        w = fc.variable(np.zeros((4,)), name="w")
        noise = fc.random_normal((4,), dtype="float64", name="noise")
        loss = fc.reduce_sum(fc.square(w - noise), name="loss")
        opt = Momentum(0.1, momentum=0.9)
        train = opt.minimize(loss)
        init = fc.global_variables_initializer()
    return g, loss, (train, init), opt


def test_capture_apply_resumes_a_session_bitwise(tmp_path):
    g, loss, (train, init), opt = build_noisy_model(seed=5)
    s = fc.Session(g, store=fc.ContainerStore())
    s.run(init)
    for _ in range(3):
        s.run([loss, train])
    tensors, state = capture(s, optimizer=opt)
    assert "w/Momentum/momentum" in tensors and state["optimizer"]["variables"] == ["w/Momentum/momentum"]
    CheckpointDir(tmp_path, spec_hash="h").save(3, tensors, {**state, "step": 3})
    straight = [s.run([loss, train])[0] for _ in range(4)]
    final = s.variable_values()

    g2, loss2, (train2, init2), _ = build_noisy_model(seed=5)
    s2 = fc.Session(g2, store=fc.ContainerStore())
    s2.run(init2)
    s2.run([loss2, train2])  # move the fresh session's RNG and variables away first
    got = CheckpointDir(tmp_path, spec_hash="h").restore_latest()
    apply(s2, got.tensors, got.state, origin=got.path)
    resumed = [s2.run([loss2, train2])[0] for _ in range(4)]
    assert [np.asarray(x).tobytes() for x in resumed] == [np.asarray(x).tobytes() for x in straight]
    for k, v in final.items():
        assert s2.variable_values()[k].tobytes() == v.tobytes()


def test_apply_refuses_a_partial_or_misshapen_restore(tmp_path):
    g, loss, (train, init), _ = build_noisy_model(seed=1)
    s = fc.Session(g, store=fc.ContainerStore())
    with pytest.raises(fc.CheckpointError, match="not initialized"):
        capture(s)
    s.run(init)
    tensors, state = capture(s)
    partial = {k: v for k, v in tensors.items() if k != "w"}
    with pytest.raises(fc.CheckpointError, match=r"^ck: missing \(no tensor for variable 'w'\)$"):
        apply(s, partial, state, origin="ck")
    bad = {**tensors, "w": np.zeros((5,))}
    with pytest.raises(fc.CheckpointError, match=r"shape mismatch \(tensor 'w' has shape \(5,\)"):
        apply(s, bad, state)
    with pytest.raises(fc.CheckpointError, match="no random state for op 'noise'"):
        apply(s, tensors, {"rng": {}})
    apply(s, partial, {"rng": {}}, strict=False)  # explicitly partial is allowed


# ---------------------------------------------------------------------------- keep, replace, prune
def test_keep_prunes_the_oldest_and_a_resaved_step_replaces_it(tmp_path):
    m = CheckpointDir(tmp_path, keep=3, on_warning=lambda s: None)
    for step in range(1, 8):
        m.save(step, {"x": np.full(2, step)}, {})
    assert [p.name for p in m.list()] == ["ckpt-00000005", "ckpt-00000006", "ckpt-00000007"]
    m.save(7, {"x": np.full(2, 70)}, {})  # a resume that saves the step it restored
    assert m.restore(7).tensors["x"].tolist() == [70, 70]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_saving_an_older_step_removes_the_abandoned_newer_ones(tmp_path):
    seen, on_warning = collect()
    m = CheckpointDir(tmp_path, keep=5, on_warning=on_warning)
    for step in (1, 2, 3, 4):
        m.save(step, {"x": np.full(2, step)}, {})
    m.save(2, {"x": np.full(2, 20)}, {})
    assert [p.name for p in m.list()] == ["ckpt-00000001", "ckpt-00000002"]
    assert len(seen) == 2 and all("abandoned run" in s for s in seen)
    assert m.restore_latest().tensors["x"].tolist() == [20, 20]


def test_an_interrupted_replacement_is_rolled_back(tmp_path):
    m = CheckpointDir(tmp_path)
    m.save(1, {"x": np.ones(2)}, {})
    m.save(2, {"x": np.full(2, 2.0)}, {})
    # A crash between moving ckpt-2 aside (to be replaced) and renaming its successor in.
    os.rename(tmp_path / "ckpt-00000002", tmp_path / ".tmp-replaced-ckpt-00000002-0badc0de")
    got = m.restore_latest()
    assert got.step == 2 and got.tensors["x"].tolist() == [2.0, 2.0]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


# ---------------------------------------------------------------------------- corruption
def two_checkpoints(tmp_path: Path, on_warning: Any = None) -> tuple[CheckpointDir, Path]:
    m = CheckpointDir(tmp_path, keep=5, spec_hash="s", on_warning=on_warning)
    m.save(1, child.tensors_for(1), child.state_for(1))
    return m, m.save(2, child.tensors_for(2), child.state_for(2))


def flip_in_w(p: Path) -> str:
    tf = p / "tensors.safetensors"
    lo, hi = tensor_ranges(tf)["dense/w"]
    data = bytearray(tf.read_bytes())
    data[(lo + hi) // 2] ^= 0x01
    tf.write_bytes(bytes(data))
    w = child.tensors_for(2)["dense/w"]
    bad = np.frombuffer(bytes(data[lo:hi]), dtype="<f8")
    return (f"{tf}: checksum mismatch (tensor 'dense/w' sha256 {hashlib.sha256(bad.tobytes()).hexdigest()[:12]}, "
            f"expected {hashlib.sha256(w.tobytes()).hexdigest()[:12]})")


def truncate(p: Path) -> str:
    tf = p / "tensors.safetensors"
    n = tf.stat().st_size
    with open(tf, "r+b") as f:
        f.truncate(n - 100)
    return f"{tf}: truncated ({n - 100} of {n} bytes)"


def delete(name: str, message: str) -> Any:
    def damage(p: Path) -> str:
        (p / name).unlink()
        return f"{p / name}: {message}"
    return damage


def flip_header_padding(p: Path) -> str:
    # Bytes that no tensor covers: only the whole-file checksum can see this.
    tf = p / "tensors.safetensors"
    data = bytearray(tf.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    assert data[8 + n - 1:8 + n] == b" "  # safetensors pads the header with spaces
    data[8 + n - 1] = ord("\t")
    tf.write_bytes(bytes(data))
    return f"{tf}: checksum mismatch (file sha256 differs: header damaged)"


def edit_manifest(p: Path) -> str:
    mf = p / "manifest.json"
    mf.write_bytes(mf.read_bytes().replace(b'"step": 2', b'"step": 3'))
    return f"{mf}: checksum mismatch (sha256 differs from the commit marker)"


DAMAGE = {
    "flip_byte": flip_in_w,
    "truncate": truncate,
    "delete_manifest": delete("manifest.json", "missing"),
    "delete_tensors": delete("tensors.safetensors", "missing"),
    "delete_commit": delete("COMMIT", "not committed (commit marker missing)"),
    "header_padding": flip_header_padding,
    "edit_manifest": edit_manifest,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damage_is_one_line_naming_the_file_and_restore_falls_back(tmp_path, damage):
    seen, on_warning = collect()
    m, p2 = two_checkpoints(tmp_path, on_warning)
    expected = DAMAGE[damage](p2)
    with pytest.raises(fc.CheckpointError) as err:
        m.restore(2)
    assert str(err.value) == expected and "\n" not in str(err.value)
    got = m.restore_latest()
    assert got.step == 1
    for k, v in child.tensors_for(1).items():
        assert got.tensors[k].tobytes() == v.tobytes()
    assert_same(got.state, child.state_for(1))
    assert got.warnings == [f"skipping damaged checkpoint: {expected}"]
    assert seen == [f"skipping damaged checkpoint ckpt-00000002: {expected}"]
    assert (tmp_path / "latest").read_text() == "ckpt-00000001\n"


def test_fallback_warns_through_warnings_without_a_callback(tmp_path):
    m, p2 = two_checkpoints(tmp_path)
    truncate(p2)
    with pytest.warns(CheckpointWarning, match="skipping damaged checkpoint ckpt-00000002"):
        assert m.restore_latest().step == 1


def test_no_valid_checkpoint_raises(tmp_path):
    with pytest.raises(fc.CheckpointError, match=r": missing \(no checkpoint in this directory\)$"):
        CheckpointDir(tmp_path / "nowhere").restore_latest()
    m, p2 = two_checkpoints(tmp_path, on_warning=lambda s: None)
    truncate(p2)
    truncate(tmp_path / "ckpt-00000001")
    with pytest.raises(fc.CheckpointError) as err:
        m.restore_latest()
    msg = str(err.value)
    assert msg.startswith(f"{tmp_path}: no valid checkpoint (") and msg.count("truncated") == 2 and "\n" not in msg


def test_a_changed_spec_is_refused_unless_allowed(tmp_path):
    two_checkpoints(tmp_path)
    other = CheckpointDir(tmp_path, spec_hash="t")
    with pytest.raises(fc.CheckpointError) as err:
        other.restore_latest()
    assert str(err.value) == (f"{tmp_path / 'ckpt-00000002' / 'manifest.json'}: spec mismatch (saved with spec s, "
                              f"this run's spec is t; allow a spec change to restore it anyway)")
    assert other.restore_latest(allow_spec_change=True).step == 2


# ---------------------------------------------------------------------------- failed saves
def fail_on_write(monkeypatch: pytest.MonkeyPatch, which: str) -> None:
    real = ck._write_bytes

    def write(path: Path, data: Any, halfway: Any = None) -> None:
        if path.name == which or path.name.startswith(which):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data, halfway)
    monkeypatch.setattr(ck, "_write_bytes", write)


@pytest.mark.parametrize("which", ["tensors.safetensors", "manifest.json", "COMMIT", ".tmp-latest"])
@pytest.mark.parametrize("resave", [False, True], ids=["new_step", "same_step"])
def test_a_full_disk_fails_the_save_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, which, resave):
    m, p2 = two_checkpoints(tmp_path)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    fail_on_write(monkeypatch, which)
    step = 2 if resave else 3
    with pytest.raises(fc.CheckpointError) as err:
        m.save(step, child.tensors_for(9), {})
    msg = str(err.value)
    assert "write failed (no space left on device); the last good checkpoint ckpt-00000002 is untouched" in msg
    assert "\n" not in msg
    after = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert after == before  # nothing added, nothing changed, no debris
    monkeypatch.undo()
    got = m.restore_latest()
    assert got.step == 2 and got.tensors["dense/w"].tobytes() == child.tensors_for(2)["dense/w"].tobytes()


def test_a_failed_rename_puts_the_replaced_checkpoint_back(tmp_path, monkeypatch):
    m, p2 = two_checkpoints(tmp_path)
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".tmp-ckpt-"):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(src))
        real(src, dst)
    monkeypatch.setattr(ck.os, "rename", rename)
    with pytest.raises(fc.CheckpointError, match=r"ckpt-00000002: write failed \(Input/output error\)"):
        m.save(2, child.tensors_for(9), {})
    monkeypatch.undo()
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before


def test_an_unwritable_directory_fails_the_save(tmp_path):
    blocker = tmp_path / "run"
    blocker.write_text("a file where the checkpoint directory should be")  # works as root, unlike chmod
    with pytest.raises(fc.CheckpointError, match=r"run: write failed \(.*\); no earlier checkpoint; [0-9.]+ [KMGT]?i?B free there$"):
        CheckpointDir(blocker).save(1, {"x": np.ones(2)}, {})
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        m = CheckpointDir(ro)
        m.save(1, {"x": np.ones(2)}, {})
        ro.chmod(0o555)
        try:
            with pytest.raises(fc.CheckpointError, match="Permission denied"):
                m.save(2, {"x": np.ones(2)}, {})
        finally:
            ro.chmod(0o755)
        assert m.restore_latest().step == 1


# ---------------------------------------------------------------------------- SIGKILL at every phase
@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """One child per phase, all started at once (process start is the cost of this file)."""
    root = tmp_path_factory.mktemp("crash")
    procs = {}
    for phase in SAVE_PHASES:
        keep = 1 if "prune" in phase else 5
        cmd = [sys.executable, str(HERE / "crash_child.py"), str(root / phase), phase, str(keep)]
        procs[phase] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out = {}
    for phase, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=60)
        out[phase] = (root / phase, subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def tensor_file_bytes(step: int) -> bytes:
    from safetensors.numpy import save

    return save(child.tensors_for(step))


@pytest.mark.parametrize("phase", SAVE_PHASES)
def test_sigkill_at_each_save_phase_leaves_a_valid_checkpoint(crashed, phase):
    directory, proc = crashed[phase]
    assert proc.returncode == -9, proc.stderr  # it really died, at the phase
    assert proc.stdout == "saved 1\n"
    committed = phase in ("before_latest", "before_prune", "mid_prune")
    # What the directory shows proves where the save stopped.
    debris = [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    files = {f.name for f in debris[0].iterdir()} if len(debris) == 1 and debris[0].is_dir() else set()
    full = len(tensor_file_bytes(2))
    if phase == "mid_tensors":
        assert files == {"tensors.safetensors"} and 0 < (debris[0] / "tensors.safetensors").stat().st_size < full
    elif phase == "after_tensors":
        assert files == {"tensors.safetensors"} and (debris[0] / "tensors.safetensors").stat().st_size == full
    elif phase in ("after_manifest", "before_commit_marker"):
        assert files == {"tensors.safetensors", "manifest.json"}
    elif phase == "before_rename":
        assert files == {"tensors.safetensors", "manifest.json", "COMMIT"}
    elif phase == "mid_prune":
        assert [p.name[:len(".tmp-pruned-ckpt-00000001")] for p in debris] == [".tmp-pruned-ckpt-00000001"]
    else:
        assert debris == []
    assert (directory / "ckpt-00000001").is_dir() == (phase != "mid_prune")
    assert (directory / "ckpt-00000002").is_dir() == committed
    assert (directory / "latest").read_text() == f"ckpt-0000000{2 if phase in ('before_prune', 'mid_prune') else 1}\n"

    seen, on_warning = collect()
    m = CheckpointDir(directory, keep=1 if "prune" in phase else 5, spec_hash="spec-1", on_warning=on_warning)
    got = m.restore_latest()
    step = 2 if committed else 1
    assert got.step == step and seen == [] and got.warnings == []
    for k, v in child.tensors_for(step).items():
        assert got.tensors[k].tobytes() == v.tobytes() and got.tensors[k].dtype == v.dtype
    assert_same(got.state, child.state_for(step))
    assert not [p for p in directory.iterdir() if p.name.startswith(".tmp-")]
    assert (directory / "latest").read_text() == f"ckpt-{step:08d}\n"
    # The run goes on from there: the next save commits and prunes normally.
    m.save(step + 1, child.tensors_for(step + 1), child.state_for(step + 1))
    assert m.restore_latest().step == step + 1


def test_a_damaged_checkpoint_does_not_count_toward_keep(tmp_path):
    """keep=2 with checkpoint 2 damaged: saving 3 keeps 3 and 1 (two good ones), and removes the
    damaged 2 with a warning -- before, 2 counted and the good 1 was deleted."""
    warned: list[str] = []
    m = CheckpointDir(tmp_path, keep=2, spec_hash="s", on_warning=warned.append)
    m.save(1, child.tensors_for(1), child.state_for(1))
    p2 = m.save(2, child.tensors_for(2), child.state_for(2))
    flip_in_w(p2)
    m.save(3, child.tensors_for(3), child.state_for(3))
    assert [p.name for p in m.list()] == ["ckpt-00000001", "ckpt-00000003"]
    assert any("ckpt-00000002" in w and "damaged" in w for w in warned), warned
    # With nothing damaged, keep counts as before: 4 pushes 1 out.
    m.save(4, child.tensors_for(4), child.state_for(4))
    assert [p.name for p in m.list()] == ["ckpt-00000003", "ckpt-00000004"]
