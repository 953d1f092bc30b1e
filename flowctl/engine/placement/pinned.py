"""When a placement overflows memory under the spec's device constraints: is it the placer, or do
the rules themselves leave no fit?

A constraint (`encoder/* -> gpu:0`) pins nodes, and colocation pins their group with them; what
it pins is held on that device whatever a placer does. What the rules leave free is tried by
enumeration where it matters most: the largest free groups (by the bytes they hold, memfit's
footprint) are put on each combination of their feasible devices, held there, and memfit moves
everything else that may move to where memory is free. If one of these fits, it is a placement
the failing placer missed, and the caller may return it (with a note saying so). If none does,
the rules are the reason: the verdict names what each constraint pins where (nodes, layers,
resident bytes), where the largest free group can go and how far over each choice leaves a
device, and whether the devices' memory in all would hold the step without the rules.

The enumeration is a bound on what memfit can reach, not a proof over every placement; its
words say so ("after moving everything else that may move"). The verdict is computed once per
Problem (`Problem.memo`): every placer of a benchmark row shares it.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowctl.engine.errors import PlacementError
from flowctl.engine.placement.explain import Placement
from flowctl.engine.placement.memfit import fit_memory, footprint
from flowctl.engine.placement.problem import Problem, finalize
from flowctl.engine.placement.simulator import fmt_bytes, simulate_table

FREE_TRIED = 2  # the largest free groups whose devices are enumerated
COMBINATIONS = 16  # at most this many device combinations of them
RULES_OVERFLOW = "rules_overflow"  # PlacementError.details["kind"] of the verdict


@dataclass
class Pin:
    """What the constraints hold on one device."""

    device: str
    constraints: list[str]
    nodes: int = 0
    resident: int = 0
    layers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "constraints": self.constraints, "nodes": self.nodes,
                "resident": self.resident, "layers": self.layers}


@dataclass
class RulesFit:
    """The outcome: `placement` (a fit the enumeration found) or `error` (the verdict), or
    neither (no constraint pins anything: not a question of rules)."""

    placement: Placement | None = None
    error: PlacementError | None = None


def pins(pb: Problem, layers: Mapping[str, str] | None = None) -> list[Pin]:
    """Per device, the step's nodes a device constraint pins there (through their own constraint
    or their colocation group's), in cluster order."""
    feas, t = pb.feas, pb.table
    by_hard: dict[int, list[str]] = {}
    out: dict[int, Pin] = {}
    for i, name in enumerate(t.names):
        h = feas.group_of[feas.index[name]]
        if len(feas.feasible[h]) != 1:
            continue
        if h not in by_hard:
            by_hard[h] = sorted({r for m in feas.members[h] for r in feas.reasons[m] if r.startswith("constraint")})
        if not by_hard[h]:
            continue  # pinned by where its kernel runs, not by a rule
        d = min(feas.feasible[h])
        pin = out.setdefault(d, Pin(pb.devices[d], []))
        pin.constraints = sorted(set(pin.constraints) | set(by_hard[h]))
        pin.nodes += 1
        if t.resident[i]:
            pin.resident += int(sum(t.out_bytes[i]))
        pin.layers.append(name)
    for pin in out.values():
        pin.layers = _layers_of(pin.layers, layers)
    return [out[d] for d in sorted(out)]


def fit_under_rules(pb: Problem, algorithm: str, layers: Mapping[str, str] | None = None) -> RulesFit:
    """The module docstring's question, answered once per Problem."""
    memo = pb.memo.get(RULES_OVERFLOW)
    if memo is None:
        memo = pb.memo[RULES_OVERFLOW] = _search(pb, layers)
    found, verdict = memo
    if verdict is not None:
        return RulesFit(error=PlacementError(f"{algorithm}: {verdict['message']}", {**verdict, "algorithm": algorithm}))
    if found is None:
        return RulesFit()
    gd, notes = found
    pl = finalize(pb, algorithm, gd, [pb.decision(g, d, "placed by the rules' search (pinned.py)") for g, d in gd.items()
                                      if len(pb.coarse.feasible_idx[g]) > 1], time.perf_counter(), notes)
    return RulesFit(placement=pl)


def _search(pb: Problem, layers: Mapping[str, str] | None) -> tuple[Any, dict[str, Any] | None]:
    """((group -> device, notes) of a fit, None), (None, the verdict), or (None, None)."""
    pinned = pins(pb, layers)
    if not pinned:
        return None, None
    co, started = pb.coarse, time.perf_counter()
    fp = footprint(pb)
    free = sorted((g for g in fp if len(co.feasible_idx[g]) > 1), key=lambda g: (-fp[g][0], g))
    base = {g: min(co.feasible_idx[g]) for g in fp if len(co.feasible_idx[g]) == 1}
    tried: list[int] = []
    combos: list[tuple[int, ...]] = [()]
    for g in free[:FREE_TRIED]:
        more = [c + (d,) for c in combos for d in sorted(co.feasible_idx[g])]
        if len(more) > COMBINATIONS:
            break
        tried.append(g)
        combos = more
    outcomes = []
    for combo in combos:
        gd = {**base, **dict(zip(tried, combo))}
        pl = finalize(pb, "rules", gd, [], started)
        fixed = frozenset(tried) | frozenset(base)
        fit = fit_memory(pb, pl, {g: pl.device_index[i] for i, g in enumerate(pb.step_group)}, "rules", [],
                         started, [], fixed=fixed, search=False)
        if fit.valid:
            gd = {g: fit.device_index[i] for i, g in enumerate(pb.step_group)}
            where = ", ".join(f"'{co.groups[g].members[0]}' on {pb.devices[d]}" for g, d in zip(tried, combo))
            return (gd, [f"memory: the placer's own placement overflowed; a search under the rules ({where}, "
                         f"the rest moved by memfit) fits"]), None
        outcomes.append((combo, fit))
    return None, _verdict(pb, pinned, tried, outcomes, layers)


def _verdict(pb: Problem, pinned: list[Pin], tried: list[int], outcomes: list[tuple[tuple[int, ...], Placement]],
             layers: Mapping[str, str] | None) -> dict[str, Any]:
    co, t = pb.coarse, pb.table
    caps = [pb.cluster.device(d).profile.memory for d in pb.devices]
    need = simulate_table(t, [0] * len(t.names), pb.cluster).devices[0].peak_memory
    pin_text = "; ".join(
        f"{', '.join(p.constraints)} pins {p.nodes} nodes ({_few(p.layers)}; {fmt_bytes(p.resident)} resident) "
        f"to {p.device}" for p in pinned)
    options = []
    for combo, pl in outcomes:
        worst = max(pl.simulation.devices, key=lambda s: s.peak_memory - s.capacity)
        options.append({"devices": [pb.devices[d] for d in combo], "device": worst.device, "peak": worst.peak_memory,
                        "capacity": worst.capacity, "over": worst.peak_memory - worst.capacity})
    least = min(o["over"] for o in options)
    message = f"does not fit under the placement rules: {pin_text}. "
    if tried:
        # Per device of the largest free group, the best of the combinations that put it there.
        first = co.groups[tried[0]]
        best: dict[str, dict[str, Any]] = {}
        for o in options:
            d = o["devices"][0]
            if d not in best or o["over"] < best[d]["over"]:
                best[d] = o
        # "on A, B needs ...": the group on A overflows B; where B is A itself, once: "on A: needs ...".
        tries = "; ".join(f"on {d}{':' if o['device'] == d else ', ' + o['device']} needs {fmt_bytes(o['peak'])} "
                          f"({fmt_bytes(o['over'])} over its {fmt_bytes(o['capacity'])})" for d, o in best.items())
        in_step = set(t.names)
        shown = next((n for n in first.members if n in in_step and not n.endswith("/initial_value")),
                     first.members[0])
        message += (f"The largest group they leave free, '{shown}' and {len(first.members) - 1} more "
                    f"({_few(_layers_of(first.members, layers))}), goes to one of {len(best)} devices: {tries} -- "
                    f"with everything else that may move moved to where memory is free. ")
    else:
        message += f"Nothing they leave free can move: {fmt_bytes(least)} over. "
    total = sum(caps)
    if total >= need:
        message += (f"The devices hold {fmt_bytes(total)} in all, more than the {fmt_bytes(need)} the step needs on "
                    f"one device: the rules, not the memory, keep it from fitting (relax a constraint or colocation).")
    else:
        message += f"The devices hold {fmt_bytes(total)} in all, less than the {fmt_bytes(need)} the step needs."
    return {"kind": RULES_OVERFLOW, "message": message, "pins": [p.to_dict() for p in pinned],
            "free_groups": [co.groups[g].members[0] for g in tried], "options": options, "least_over": least,
            "total_capacity": total, "one_device_need": need}


def _layers_of(names: list[str], layers: Mapping[str, str] | None) -> list[str]:
    """The spec layers that made `names`, most nodes first (name prefixes without a layer map)."""
    count: dict[str, int] = {}
    for n in names:
        layer = layers.get(n) if layers else n.split("/")[0]
        if layer and not n.startswith("gradients/"):
            count[layer] = count.get(layer, 0) + 1
    return sorted(count, key=lambda k: (-count[k], k))


def _few(names: list[str], shown: int = 4) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


__all__ = ["RULES_OVERFLOW", "Pin", "RulesFit", "fit_under_rules", "pins"]
