"""The learned placer (Mirhoseini et al. 2017; placement-notes.md): a policy (policy.py) over
placement units (grouping.py) trained by REINFORCE on the simulator's step times.

Training, one update per step:
- Sample `batch` placements (a device per unit) from the policy; each is simulated once
  (simulator.simulate_table, the exact schedule; repeated placements come from a cache).
- Reward -sqrt(step time in ms). A placement that overflows a device's memory is given the step
  time PENALTY x the reference step (the best heuristic's) x (1 + the overflow as a fraction of
  capacity): invalid, and worse the further over.
- Baseline: a moving average of the batch's mean reward (decay `baseline_decay`); advantages are
  reward - baseline. The policy takes one Adam step on W_ud = mean over samples of advantage x
  [sample put u on d] (policy.py's loss), plus `keep_best` x [the best placement seen puts u on
  d] (self-imitation: the search stays near its incumbent) and an entropy bonus. The bonus grows
  x1.5 after every batch that sampled no placement not simulated before (the policy collapsed
  onto what it knows) and shrinks back once new ones come: without it, a run on NMT stopped
  sampling anything new after about 2,400 placements (4 minutes).
- Before REINFORCE, `imitation` steps fit the policy to the best heuristic placement (single,
  expert where rules exist, greedy, heft, mincut), projected onto the units: the policy starts
  where the heuristics end and searches around it.

Rewards from measured steps (`reward="measured"`, the paper's setting): `measure` maps an
assignment (node -> device) to seconds per step run on the devices; the caller builds it (the
engine runs no training step of its own). Each distinct placement is measured once (sampled
placements repeat: the cache above); one the simulator says overflows a device is penalised
without running; the seed's own assignment is measured too, so the comparison below is between
measured figures, and the result carries its measured step (`Placement.measured_step`).

After training, a local search (`Trainer.polish`: one unit moved at a time while the step
shortens, from the best placement seen and from the seed on units, within `polish_sims`
simulations; skipped under measured rewards) takes the best the rest of the way to a local
optimum. What `place` returns is the best placement seen: a sampled or polished one, or the
seed itself when none beat it (a note says which). The seed is the best of every other placer
(single, expert where rules exist, greedy, heft, mincut), so the learned placer is never slower
than the best other placer by the simulator. The run is determined by (problem, seed, options, number of steps): `budget_s` (the
training's seconds, after the heuristics have run) only decides when it stops. A checkpoint
(`checkpoint`) holds the policy's and Adam's variables, the sampling generator's state, the
step, the baseline, the placements simulated so far, the best one and the learning curve;
resuming from it continues the run exactly. `warm_start` loads only the policy's weights from a
checkpoint made on another graph or cluster.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from flowctl.engine.errors import CheckpointError, PlacementError
from flowctl.engine.placement.explain import Placement
from flowctl.engine.placement.grouping import MAX_DEVICES, Units, build_units, climb, describe, device_mask, features
from flowctl.engine.placement.problem import Problem, build_placement
from flowctl.engine.placement.simulator import simulate_table

PENALTY = 3.0
HEURISTICS = "valid_heuristics"  # Problem.memo: the other placers' valid placements (placers.heuristic_seed)
EXPLORE_MAX = 30.0
Progress = Callable[[int, float, float], None]  # (step, best step time s, seconds elapsed)
Measure = Callable[[dict[str, str]], float]  # an assignment (node -> device) -> measured seconds per step
REWARDS = ("simulated", "measured")


@dataclass
class LearnedOptions:
    seed: int = 0
    steps: int | None = None  # updates to run (None: until the budget is spent)
    budget_s: float = 60.0
    batch: int = 8
    lr: float = 0.005
    entropy: float = 0.03
    baseline_decay: float = 0.9
    imitation: int = 20
    keep_best: float = 0.05  # self-imitation: weight pulling the policy toward the best placement seen
    max_units: int = 24
    polish_sims: int = 600  # simulations for the local search after training (0: none)
    checkpoint: str | None = None  # a .npz path: saved every `checkpoint_every` steps and at the end
    checkpoint_every: int = 10
    resume: bool = False  # continue from `checkpoint` when it exists
    warm_start: str | None = None  # a checkpoint from another graph or cluster: its policy weights
    progress: Progress | None = field(default=None, repr=False)
    reward: str = "simulated"  # or "measured": step times from `measure` (module docstring)
    measure: Measure | None = field(default=None, repr=False)

    def key(self) -> dict[str, Any]:
        """What must match for a checkpoint to be resumed."""
        return {"seed": self.seed, "batch": self.batch, "lr": self.lr, "entropy": self.entropy,
                "baseline_decay": self.baseline_decay, "imitation": self.imitation, "keep_best": self.keep_best,
                "max_units": self.max_units, "reward": self.reward}


@dataclass
class LearnedRun:
    units: Units
    step: int = 0
    baseline: float | None = None
    best_step: float = float("inf")
    best_units: list[int] = field(default_factory=list)
    best_at: int = -1  # the step that first sampled it (-1: the heuristic seed)
    seed_algorithm: str = ""
    seed_step: float = float("inf")
    seed_units_step: float = float("inf")  # the seed projected onto units
    simulated: int = 0
    measured: int = 0  # placements run on the devices (measured reward)
    history: list[dict[str, float]] = field(default_factory=list)  # per step: mean, best, valid share
    explore: float = 1.0  # the entropy bonus's current multiple of `entropy` (see Trainer.step)
    seconds: float = 0.0

    def curve(self) -> list[dict[str, float]]:
        return list(self.history)


class Trainer:
    """REINFORCE over one Problem (module docstring)."""

    def __init__(self, pb: Problem, opts: LearnedOptions, seed_placement: Placement,
                 layers: Mapping[str, str] | None = None) -> None:
        from flowctl.engine.placement.policy import Policy

        if opts.reward not in REWARDS:
            raise PlacementError(f"unknown reward '{opts.reward}' for the learned placer (known: {', '.join(REWARDS)})")
        if opts.reward == "measured" and opts.measure is None:
            raise PlacementError("the learned placer's measured reward needs a way to run a placement "
                                 "(LearnedOptions.measure); `flowctl place --reward measured` builds one")
        if len(pb.devices) > MAX_DEVICES:
            raise PlacementError(f"the learned placer handles up to {MAX_DEVICES} devices; this cluster has "
                                 f"{len(pb.devices)}")
        self.pb, self.opts = pb, opts
        units = build_units(pb, layers, opts.max_units, seed_placement.device_index)
        self.layers, self.seed_dev = layers, list(seed_placement.device_index)
        ops, shp, adj = features(pb, units)
        self.policy = Policy(len(units), opts.seed, lr=opts.lr)
        self.feeds = self.policy.feeds(ops, shp, adj, device_mask(pb, units))
        self.rng = np.random.default_rng(opts.seed)
        self.run = LearnedRun(units)
        self.cache: dict[bytes, float] = {}
        self.ref = seed_placement.step_time  # an invalid seed's step still sets the penalty's scale
        self.seed_measured: float | None = None
        if self.measuring and seed_placement.valid:
            self.seed_measured = self.ref = self._measure(seed_placement.assignment)
        self.run.seed_algorithm, self.run.seed_step = seed_placement.algorithm, seed_placement.step_time
        self.target = units.project(pb, seed_placement.device_index)
        self.run.seed_units_step = self.evaluate(self.target)
        self.run.best_step, self.run.best_units, self.run.best_at = self.run.seed_units_step, self.target.tolist(), -1
        self.warm: list[str] = []
        if opts.warm_start:
            self.warm = self.policy.load({k: v for k, v in _read(opts.warm_start)[0].items()
                                          if not k.startswith("__")}, warm=True)

    # ------------------------------------------------------------------ rewards
    @property
    def measuring(self) -> bool:
        return self.opts.reward == "measured"

    def _measure(self, assignment: dict[str, str]) -> float:
        assert self.opts.measure is not None
        self.run.measured += 1
        return float(self.opts.measure(assignment))

    def evaluate(self, unit_dev: np.ndarray) -> float:
        """Step time in seconds, simulated or measured (once per distinct placement); a placement
        the simulator says overflows a device gets the penalty step."""
        key = unit_dev.astype(np.int8).tobytes()
        got = self.cache.get(key)
        if got is not None:
            return got
        sim = simulate_table(self.pb.table, self.run.units.node_devices(unit_dev).tolist(), self.pb.cluster)
        self.run.simulated += 1
        if sim.valid:
            t = self._measure(self.run.units.assignment(self.pb, unit_dev)) if self.measuring else sim.step_time
        else:
            over = sum(max(0, s.peak_memory - s.capacity) / max(s.capacity, 1) for s in sim.devices)
            t = PENALTY * self.ref * (1.0 + over)
        self.cache[key] = t
        return t

    @staticmethod
    def reward(step_time: float) -> float:
        return -float(np.sqrt(step_time * 1e3))

    # ------------------------------------------------------------------ training
    def train(self) -> LearnedRun:
        o, r = self.opts, self.run
        started = time.perf_counter()
        spent = r.seconds
        while o.steps is None or r.step < o.steps:
            if o.steps is None and spent + time.perf_counter() - started >= o.budget_s:
                break
            self.step()
            r.seconds = spent + time.perf_counter() - started
            if o.progress is not None:
                o.progress(r.step, r.best_step, r.seconds)
            if o.checkpoint and r.step % o.checkpoint_every == 0:
                self.save(o.checkpoint)
        r.seconds = spent + time.perf_counter() - started
        if o.checkpoint:
            self.save(o.checkpoint)
        return r

    def step(self) -> None:
        o, r = self.opts, self.run
        U = len(r.units)
        if r.step < o.imitation:  # fit the heuristic seed first (cross-entropy)
            w = np.zeros((U, MAX_DEVICES))
            w[np.arange(U), self.target] = 1.0
            self.policy.update(self.feeds, w, o.entropy)
            r.history.append({"step": r.step, "mean": r.seed_units_step, "best": r.best_step, "valid": 1.0})
            r.step += 1
            return
        probs = self.policy.distribution(self.feeds)
        samples = np.stack([_sample(self.rng, probs) for _ in range(o.batch)])
        seen = len(self.cache)
        steps = np.array([self.evaluate(s) for s in samples])
        # A batch with no placement never seen before teaches nothing new: the policy has
        # collapsed onto a few placements. Raise the entropy bonus until it samples new ones,
        # and let it decay back once it does.
        r.explore = min(EXPLORE_MAX, r.explore * 1.5) if len(self.cache) == seen else max(1.0, r.explore / 1.5)
        rewards = np.array([self.reward(t) for t in steps])
        for s, t in zip(samples, steps):
            if t < r.best_step:
                r.best_step, r.best_units, r.best_at = float(t), s.tolist(), r.step
        mean = float(rewards.mean())
        base = mean if r.baseline is None else r.baseline
        adv = rewards - base
        r.baseline = o.baseline_decay * base + (1.0 - o.baseline_decay) * mean
        w = np.zeros((U, MAX_DEVICES))
        for s, a in zip(samples, adv):
            w[np.arange(U), s] += a / o.batch
        w[np.arange(U), np.asarray(r.best_units)] += o.keep_best
        self.policy.update(self.feeds, w, o.entropy * r.explore)
        valid = float(np.mean(steps < PENALTY * self.ref))
        r.history.append({"step": r.step, "mean": float(steps.mean()), "best": r.best_step, "valid": valid,
                          "new": len(self.cache) - seen})
        r.step += 1

    # ------------------------------------------------------------------ local search
    def polish(self) -> tuple[dict[str, str], float, str]:
        """Hill climbing after training, one unit moved at a time (the first move that shortens
        the step is kept; passes repeat while one does), over units twice as fine as the
        policy's, from the best placement seen, the seed, and every other placer's valid
        placement, within `polish_sims` new simulations. REINFORCE leaves its best a move or
        two from a local optimum (NMT without constraints over 4 K40s: 184 -> 175 ms in ~70
        simulations); under a memory cap the policy collapses early on the few valid
        placements it found, and finer units reach cuts the policy's cannot (lstm_lm on two
        capped K40s: 17.34 ms from heft's placement over 48 units; the policy's best, 17.70),
        while a policy over that many units learns slower (lstm_lm on two H100s: 3.52 ms over
        40 units, 3.04 over 24). Deterministic: starts and moves in a fixed order. Returns the
        best assignment, its step, and how it was found ("" where nothing beat the policy's)."""
        r, pb = self.run, self.pb
        best_units = np.asarray(r.best_units, dtype=np.int64)
        best_t, how = r.best_step, ""
        assignment = r.units.assignment(pb, best_units)
        if self.measuring or self.opts.polish_sims <= 0:
            return assignment, best_t, how  # under measured rewards each move would be a run
        fine = build_units(pb, self.layers, 2 * self.opts.max_units, self.seed_dev)
        left = self.opts.polish_sims

        def step_of(u: np.ndarray) -> float:
            sim = simulate_table(pb.table, fine.node_devices(u).tolist(), pb.cluster)
            r.simulated += 1
            return sim.step_time if sim.valid else float("inf")

        starts = [("the best placement seen", r.units.node_devices(best_units).tolist()),
                  (f"the seed ({r.seed_algorithm})", self.seed_dev)]
        starts += [(pl.algorithm, list(pl.device_index)) for pl in pb.memo.get(HEURISTICS, [])
                   if pl.algorithm != r.seed_algorithm]
        for name, start in starts:
            if left <= 0:
                break
            cur = fine.project(pb, start)
            cur_t = step_of(cur)
            left -= 1
            cur, cur_t, used = climb(fine, cur, cur_t, step_of, left)
            left -= used
            if cur_t < best_t:
                best_t, how = cur_t, f"local search from {name}"
                assignment = fine.assignment(pb, cur)
        return assignment, best_t, how

    # ------------------------------------------------------------------ checkpoints
    def fingerprint(self) -> dict[str, Any]:
        return {"devices": list(self.pb.devices), "nodes": len(self.pb.table.names), "units": len(self.run.units),
                "options": self.opts.key()}

    def save(self, path: str) -> None:
        r = self.run
        meta = {"fingerprint": self.fingerprint(), "step": r.step, "baseline": r.baseline,
                "best_step": r.best_step, "best_units": r.best_units, "best_at": r.best_at,
                "simulated": r.simulated, "measured": r.measured, "history": r.history, "seconds": r.seconds, "explore": r.explore,
                "rng": self.rng.bit_generator.state}
        tmp = path + ".tmp"
        U = len(r.units)
        # The simulated placements: which are new decides the exploration bonus, so a resumed
        # run needs them to continue exactly (they also spare it re-simulating them).
        seen = np.frombuffer(b"".join(self.cache), dtype=np.int8).reshape(-1, U)
        steps = np.asarray(list(self.cache.values()), dtype=np.float64)
        arrays: dict[str, Any] = {"__meta__": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                                  "__seen__": seen, "__steps__": steps, **self.policy.state()}
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)  # atomic: a crash leaves the previous checkpoint whole

    def restore(self, path: str) -> None:
        values, meta = _read(path)
        if meta.get("fingerprint") != self.fingerprint():
            raise CheckpointError(f"{path}: made for another problem or other options "
                                  f"({meta.get('fingerprint')}); use warm_start to reuse its policy")
        seen, steps = values.pop("__seen__"), values.pop("__steps__")
        self.policy.load(values)
        self.cache = {row.astype(np.int8).tobytes(): float(t) for row, t in zip(seen, steps)}
        r = self.run
        r.step, r.baseline, r.best_step = meta["step"], meta["baseline"], meta["best_step"]
        r.best_units, r.best_at, r.simulated = meta["best_units"], meta["best_at"], meta["simulated"]
        r.measured = meta.get("measured", 0)
        r.history, r.seconds, r.explore = meta["history"], meta["seconds"], meta["explore"]
        self.rng.bit_generator.state = meta["rng"]


def _sample(rng: np.random.Generator, probs: np.ndarray) -> np.ndarray:
    """One device per unit; inverse-CDF draws, so a generator state gives the same placement."""
    cdf = np.cumsum(probs, axis=1)
    u = rng.random(probs.shape[0]) * cdf[:, -1]
    return np.minimum((cdf < u[:, None]).sum(axis=1), probs.shape[1] - 1).astype(np.int64)


def _read(path: str) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    try:
        with np.load(path) as z:
            values = {k: np.array(z[k]) for k in z.files if k != "__meta__"}
            values.setdefault("__seen__", np.zeros((0, 0), dtype=np.int8))
            values.setdefault("__steps__", np.zeros(0))
            meta = json.loads(bytes(z["__meta__"]).decode())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such placer checkpoint") from None
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: not a learned-placer checkpoint ({e})") from None
    return values, meta


def place_learned(pb: Problem, seed: Placement, alternatives: dict[str, Any],
                  layers: Mapping[str, str] | None = None, opts: LearnedOptions | None = None) -> Placement:
    """Train the policy from `seed` (the best heuristic placement, placers.heuristic_seed, with
    `alternatives`: each heuristic's step or why it failed) and return the best placement seen."""
    started = time.perf_counter()
    opts = opts or LearnedOptions()
    tr = Trainer(pb, opts, seed, layers)
    if opts.resume and opts.checkpoint and os.path.exists(opts.checkpoint):
        tr.restore(opts.checkpoint)
    run = tr.train()
    units = run.units
    probs = tr.policy.distribution(tr.feeds)
    assignment, best_step, polished = tr.polish()
    best = np.asarray(run.best_units, dtype=np.int64)
    if polished:
        run.best_step = best_step
    notes = [f"learned: {run.step} updates ({min(run.step, opts.imitation)} imitating {seed.algorithm}), "
             f"{run.simulated} placements simulated over {len(units)} units in {run.seconds:.1f} s"]
    if tr.measuring:
        notes.append(f"rewards measured: {run.measured} distinct placements run on the devices "
                     f"(repeats from the cache)")
    if tr.warm:
        notes.append(f"warm-started from {opts.warm_start} ({len(tr.warm)} policy variables)")
    # Measured against measured: the seed's own assignment was run too (Trainer.__init__).
    seed_step = tr.seed_measured if tr.seed_measured is not None else seed.step_time
    kind = "measured" if tr.measuring else "simulated"
    if run.best_step >= seed_step:
        notes.insert(0, f"no sampled placement beat {seed.algorithm}'s {seed_step * 1e3:.2f} ms {kind} "
                        f"(best sample {min((h['best'] for h in run.history), default=run.best_step) * 1e3:.2f} ms): "
                        f"returning {seed.algorithm}'s placement")
        pl = seed
        pl.notes = notes + pl.notes
        pl.measured_step = tr.seed_measured
    else:
        at = f"by {polished}" if polished else \
            "as the seed projected onto units" if run.best_at < 0 else f"at step {run.best_at}"
        notes.insert(0, f"best placement found {at}: {run.best_step * 1e3:.2f} ms {kind} "
                        f"({seed.algorithm}: {seed_step * 1e3:.2f} ms)")
        decisions = []
        for u, atoms in enumerate(units.groups):
            d = int(best[u])
            for g in dict.fromkeys(units.atoms[a][0] for a in atoms):
                where = pb.devices.index(assignment[pb.coarse.groups[g].members[0]])
                why = f"policy unit {u} ({units.names[u]}): p={probs[u, d]:.2f}" if where == d else polished
                decisions.append(pb.decision(g, where, why))
        pl = build_placement(pb, "learned", assignment, decisions, started, notes)
        pl.measured_step = run.best_step if tr.measuring else None
    pl.algorithm = "learned"
    pl.alternatives = {**alternatives, "learned_curve": run.curve(), "units": describe(units)}
    pl.seconds = time.perf_counter() - started
    return pl


__all__ = ["REWARDS", "LearnedOptions", "LearnedRun", "Measure", "Trainer", "place_learned"]
