"""Pure-Python scheduling for pipeserve: requests, policies, cost model, KV block manager.

Never imports torch, zmq or hydra; every piece is testable in milliseconds.
"""

from .block_manager import BlockManager
from .config import SchedulerConfig
from .cost_model import CostModel, Work
from .request import Request, RequestStatus
from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "BlockManager",
    "CostModel",
    "Request",
    "RequestStatus",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "Work",
]
