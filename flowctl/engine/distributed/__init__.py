"""The distributed engine on Ray (whitepaper §3.3; ARCHITECTURE "Distribution"): a worker actor per
task, the master in the client's process. Importing this package does not import Ray; starting a
session does."""
from flowctl.engine.distributed.cluster import (TaskSpec, check_resources, connect, task_resources, tasks_of,
                                                worker_cluster)
from flowctl.engine.distributed.recovery import Recovery, Restart
from flowctl.engine.distributed.session import RaySession, WorkerInfo
from flowctl.engine.errors import WorkerLostError

__all__ = ["RaySession", "Recovery", "Restart", "TaskSpec", "WorkerInfo", "WorkerLostError", "check_resources",
           "connect", "task_resources", "tasks_of", "worker_cluster"]
