"""Pure-Python scheduling for pipeserve: requests, policies, cost model, KV block manager.

Never imports torch, zmq or hydra; every piece is testable in milliseconds. ``SamplingParams``
(a msgspec struct) lives here, below the wire schema, as the one type from the API to the wire.
"""

from .block_manager import BlockManager
from .config import SchedulerConfig, SchedulerLimits
from .cost_model import CostModel, SlidingLayers, Work
from .request import Request, RequestStatus
from .sampling_params import SamplingParams, StructuredOutputsParams
from .scheduler import ScheduledRequest, Scheduler, SchedulerOutput

__all__ = [
    "BlockManager",
    "CostModel",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerLimits",
    "SchedulerOutput",
    "SlidingLayers",
    "StructuredOutputsParams",
    "Work",
]
