"""Continuous-batching scheduler: queues, the scheduling step and its output."""

from tokenloom.core.sched.interface import SchedulerInterface
from tokenloom.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    RequestQueue,
    create_request_queue,
)
from tokenloom.core.sched.scheduler import Scheduler

__all__ = [
    "CachedRequestData",
    "FCFSRequestQueue",
    "NewRequestData",
    "PriorityRequestQueue",
    "RequestQueue",
    "Scheduler",
    "SchedulerInterface",
    "SchedulerOutput",
    "create_request_queue",
]
