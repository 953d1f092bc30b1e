"""`flowctl bench dataparallel`: data parallel over two Ray workers against one process (issue 33),
measured in one sitting on this machine, as the JSON `flowctl bench scaling` calibrates on
(benchmarks/results/dataparallel-cpu.json, format in `scaling.read_measured`).

Rows, all on specs/lstm_lm.yaml, each process (and each worker) at `threads` intra-op and BLAS
threads (threadpoolctl; the workers set theirs from their device's share of the cores):
  one_process: one process at the spec's batch (20), `threads` threads;
  one_process_all_threads: the same process with every core (the "same cores" comparison);
  two_workers.allreduce / .parameter_device: `sync_data_parallel` over two Ray workers
    (`worker0/cpu:0`, `worker1/cpu:0`), each worker at the spec's batch (global batch 40: weak
    scaling, as data parallel is used to go faster), all-reduce or the parameter device;
  two_processes: the one-process row run in two processes at once (this one and a companion
    started for the sitting), nothing exchanged: the ceiling two workers on this machine could
    reach, its cores, caches and memory shared, with no communication and no Ray at all. Its
    step is the median of both processes' steps, its examples those of both.
The one-process rows are opened once and run with no Ray process on the machine (one process
has none); each Ray row runs every block in a Ray of its own with only its two workers (`_RayRow`:
started, opened, warmed, timed, shut down), as a user's run has it. The rows are timed in blocks,
in turn, `rounds` times (untimed steps, then `steps` timed ones per block); examples/s from the
median step, with the rounds' range. First, in the same sitting, the link between two workers
(`bench.ray.links`: 4 MiB and 64 MiB crossings), which `bench scaling` takes as each scheme's
measured link, and what Ray's own processes take of the cores while two actors sit idle
(`ray_idle`: the raylet, the GCS, the log monitor and the actors' Ray threads; no exchange could
get that back on a machine whose cores the workers fill).
"""
from __future__ import annotations

import multiprocessing
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import yaml

from flowctl.bench.strategies import _measure, timed_block
from flowctl.engine.errors import FlowctlError
from flowctl.spec.loader import load_text

LSTM_LM = Path(__file__).resolve().parents[2] / "specs" / "lstm_lm.yaml"
# Ray's object store for the sitting, kept small as `bench ray` keeps its own, so its pages are reused.
OBJECT_STORE = 512 << 20


def _spec(text: str, batch: int, **sections: Any) -> Any:
    d = yaml.safe_load(text)
    d.setdefault("training", {})["batch_size"] = batch
    d.update(sections)
    return load_text(yaml.safe_dump(d, sort_keys=False), filename="<bench dataparallel>")


def _opened(text: str, batch: int) -> tuple[Any, Any]:
    from flowctl.training.inputs import make_sources
    from flowctl.training.program import open_program

    loaded = _spec(text, batch)
    p = open_program(loaded)
    src = make_sources(loaded, 1, p.step.batch)[0]
    p.session.run(p.step.init)
    return p, src


def _companion(conn: Any, text: str, batch: int, threads: int) -> None:
    """The second process of the two_processes row: builds the one-process row, then runs a block
    each time it is told to (the number of steps), answering with its step times; None ends it."""
    from threadpoolctl import threadpool_limits

    try:
        p, src = _opened(text, batch)
    except Exception as e:  # noqa: BLE001 -- said by the bench, in one line
        conn.send(f"{type(e).__name__}: {e}")
        return
    try:
        conn.send("ready")
        with threadpool_limits(limits=threads, user_api="blas"):
            while (steps := conn.recv()) is not None:
                try:
                    conn.send(timed_block(p, src, steps))
                except Exception as e:  # noqa: BLE001
                    conn.send(f"{type(e).__name__}: {e}")
                    return
    finally:
        p.close()


def _cpu_seconds(pid: int) -> float | None:
    """A process's user + system CPU time from /proc (None once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ray_pids(temp_dir: str, extra: list[int]) -> list[int]:
    """Ray's processes of this session (their command lines name its directory), and `extra`."""
    pids = set(extra)
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if temp_dir.encode() in (d / "cmdline").read_bytes():
                    pids.add(int(d.name))
            except OSError:
                continue
    return sorted(pids)


def ray_idle(temp_dir: str, seconds: float = 5.0) -> dict[str, float]:
    """CPU that Ray's processes take per second with two idle actors (this driver excluded)."""
    import time

    import ray

    @ray.remote(num_cpus=0)
    class Idle:
        def pid(self) -> int:
            return os.getpid()

    actors = [Idle.remote() for _ in range(2)]
    try:
        pids = _ray_pids(temp_dir, ray.get([a.pid.remote() for a in actors]))
        time.sleep(1.0)
        before = {p: _cpu_seconds(p) for p in pids}
        t0 = time.perf_counter()
        time.sleep(seconds)
        after = {p: _cpu_seconds(p) for p in pids}
        wall = time.perf_counter() - t0
    finally:
        for a in actors:
            ray.kill(a)
    used = sum(after[p] - before[p] for p in pids if before[p] is not None and after[p] is not None)
    cores = os.cpu_count() or 1
    return {"ms_per_s": 1e3 * used / wall, "share_of_cores": used / wall / cores, "processes": len(pids)}


class _TwoProcesses:
    """The two_processes row's blocks: this process and a spawned companion each run the
    one-process row's block at the same moment."""

    def __init__(self, text: str, batch: int, threads: int) -> None:
        self.text, self.batch, self.threads = text, batch, threads
        self.local: tuple[Any, Any] | None = None
        ctx = multiprocessing.get_context("spawn")  # not fork: this process holds Ray and threads
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_companion, args=(theirs, text, batch, threads), daemon=True)
        self.proc.start()

    def block(self, steps: int) -> list[float]:
        from threadpoolctl import threadpool_limits

        if self.local is None:
            self.local = _opened(self.text, self.batch)
            said = self._answer(300)
            if said != "ready":
                raise FlowctlError(f"bench dataparallel: the two_processes row's companion did not start: {said}")
        try:
            self.conn.send(steps)
        except OSError:  # a broken pipe: the companion is gone
            raise FlowctlError(f"bench dataparallel: the two_processes row's companion failed: {self._answer(0)}") \
                from None
        with threadpool_limits(limits=self.threads, user_api="blas"):
            mine = timed_block(*self.local, steps)
        theirs = self._answer(None)
        if not isinstance(theirs, list):
            raise FlowctlError(f"bench dataparallel: the two_processes row's companion failed: {theirs}")
        return mine + theirs

    def _answer(self, timeout: float | None) -> Any:
        """The companion's next message, or why there is none (it exited, or said nothing in time)."""
        try:
            if timeout is not None and not self.conn.poll(timeout) and self.proc.is_alive():
                return f"no answer in {timeout:.0f} s"
            return self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            return f"it exited (exit code {self.proc.exitcode})"

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except OSError:
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
        if self.local is not None:
            self.local[0].close()


class _RayRow:
    """A Ray row's blocks: each in a Ray of its own, as a user's run has it -- Ray started, the
    program opened on its two workers, `WARM` + 1 untimed steps, the timed block, then all of it shut
    down -- so no other row's actors idle beside it and no Ray process idles beside the one-process
    rows (their idle share was measured at 1.9-2.4% of the two cores, and the rows' ratios moved
    by as much)."""

    WARM = 3  # untimed steps: the first steps fault in the object store's fresh pages

    def __init__(self, loaded: Any, temp_dir: str) -> None:
        self.loaded, self.temp_dir = loaded, temp_dir

    def block(self, steps: int) -> list[float]:
        import ray
        from threadpoolctl import threadpool_limits

        from flowctl.training.inputs import make_sources
        from flowctl.training.program import open_program

        _ray_up(self.temp_dir)
        p = None
        try:
            p = open_program(self.loaded)
            src = make_sources(self.loaded, 1, p.step.batch)[0]
            p.session.run(p.step.init)
            with threadpool_limits(limits=1, user_api="blas"):  # the master's; each worker sets its own
                timed_block(p, src, self.WARM - 1)  # WARM steps, their times dropped
                return timed_block(p, src, steps)  # one more untimed, then the timed ones
        finally:
            if p is not None:
                p.close()
            ray.shutdown()


def _ray_up(temp_dir: str) -> None:
    import ray

    # 4 logical CPUs: room for a row's two one-core workers and `ray_idle`'s two actors
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, _temp_dir=temp_dir,
             object_store_memory=OBJECT_STORE)


def dataparallel_benchmark(steps: int = 4, rounds: int = 2, threads: int = 1, spec: Path | None = None,
                           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The measured rows (module doc) and their ratios: each scheme over one process at `threads`
    and over one process with every core. `spec`: another spec than lstm_lm's (its `name` is the
    result's `model`)."""
    import ray

    from flowctl.bench.host import describe

    say = progress or (lambda m: None)
    text = (spec or LSTM_LM).read_text()
    batch = int(yaml.safe_load(text)["training"]["batch_size"])
    cores = os.cpu_count() or 1
    ray_cluster = {"type": "ray", "workers": 2}
    workers = ["worker0/cpu:0", "worker1/cpu:0"]

    def two(reduce: str) -> Any:
        return _spec(text, 2 * batch, cluster=ray_cluster, devices=workers,
                     parallelism={"strategy": "sync_data_parallel", "reduce": reduce})

    rows = {"one_process": (_spec(text, batch), threads),
            "one_process_all_threads": (_spec(text, batch), cores)}
    if ray.is_initialized():
        raise FlowctlError("bench dataparallel starts and stops Ray itself, once per Ray block: "
                           "run it where Ray is not initialised")
    tmp = tempfile.mkdtemp(prefix="fcdp", dir="/tmp")
    pair: _TwoProcesses | None = None
    try:
        # The link first, on a quiet Ray: after the rows it measured 2.1-2.3 GB/s for 64 MiB where
        # alone it gives 5.8-5.95 (the rows' workers were still going away).
        _ray_up(tmp)
        try:
            say("the link between two workers (4 MiB and 64 MiB crossings)")
            from flowctl.bench.ray import links

            rates = links(repeat=5)["link_rates"]
            say("Ray's own processes, two actors idle")
            idle = ray_idle(tmp)
        finally:
            ray.shutdown()
        pair = _TwoProcesses(text, batch, threads)
        blocks = {"two_processes": (pair.block, 2 * batch)}
        blocks |= {s: (_RayRow(two(s), tmp).block, 2 * batch) for s in ("allreduce", "parameter_device")}
        measured = _measure({name: loaded for name, (loaded, _) in rows.items()}, steps, say, rounds,
                            limits={name: limit for name, (_, limit) in rows.items()}, blocks=blocks)
    finally:
        if pair is not None:
            pair.close()
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)

    one, all_cores, ceiling = measured["one_process"], measured["one_process_all_threads"], measured["two_processes"]
    two_rows = {s: measured[s] for s in ("allreduce", "parameter_device")}
    # Both schemes move tensors by the same Send/Recv between workers: one measured link for both.
    link = {"bandwidth_Bps": rates["64_MiB"]["GBps"] * 1e9, "latency_s": rates["latency_s"]}
    return {
        "model": str(yaml.safe_load(text).get("name", "lstm_lm")), "batch": batch, "threads": threads,
        "cores": cores, "host": describe(), "steps": steps, "rounds": rounds,
        "one_process": one, "one_process_all_threads": all_cores, "two_processes": ceiling, "two_workers": two_rows,
        "links": {s: dict(link) for s in two_rows}, "link_rates": rates, "ray_idle": idle,
        "ratios": {f"{s}_vs_one_process": two_rows[s]["examples_per_s"] / one["examples_per_s"]
                   for s in two_rows} | {f"{s}_vs_all_threads": two_rows[s]["examples_per_s"] /
                                         all_cores["examples_per_s"] for s in two_rows}
                  | {f"{s}_vs_two_processes": two_rows[s]["examples_per_s"] / ceiling["examples_per_s"]
                     for s in two_rows}
                  | {"two_processes_vs_one_process": ceiling["examples_per_s"] / one["examples_per_s"]},
    }


__all__ = ["dataparallel_benchmark"]
