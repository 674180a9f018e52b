"""The server's decisions: a sans-I/O state machine and the synchronization policies.

:class:`ServerCore` decides everything a parameter server decides (versions and
staleness, who waits and until when, what is applied, refused or dropped, the
stages and the re-planning) and does no I/O: the asyncio server
(:mod:`hpsjax.net`) and the virtual-clock simulator (:mod:`hpsjax.sim`) both hand
it typed events (:class:`WorkerJoined`, :class:`WorkerPushed`, :class:`Tick`, ...)
through :meth:`ServerCore.handle` and carry out the actions it returns through
one :class:`ActionInterpreter`. The
arithmetic sits behind an aggregator (:mod:`hpsjax.apply`). A :class:`Policy`
(BSP, ASP, SSP, SaPS, ADSP, Ringmaster, semi-async, hybrid; :data:`POLICIES`,
:func:`get_policy`) answers the core's questions through a narrow
:class:`PolicyView`. A re-planner is anything with the
:class:`ReplannerProtocol`, so the server never imports planning.
"""

from hpsjax.decisions._core import (
    Action,
    Applied,
    Drop,
    ForcePull,
    Joined,
    PlanChanged,
    PushAck,
    Release,
    SaveCheckpoint,
    SendParams,
    ServerCore,
    StageChanged,
    StartApply,
    Wait,
    WorkerInfo,
)
from hpsjax.decisions._events import (
    PushBegun,
    ServerEvent,
    SpeedMeasured,
    StageSet,
    Tick,
    WorkerJoined,
    WorkerLeft,
    WorkerPulled,
    WorkerPushed,
)
from hpsjax.decisions._interpreter import ActionInterpreter
from hpsjax.decisions._membership import free_worker_id
from hpsjax.decisions._policies import (
    ADSP,
    ASP,
    BSP,
    DEFAULT_POLICY,
    POLICIES,
    SSP,
    Hybrid,
    HybridStage,
    NaiveOptimal,
    PlannedHybrid,
    Policy,
    PolicyView,
    Ringleader,
    Ringmaster,
    SaPS,
    SemiAsync,
    Verdict,
    get_policy,
)
from hpsjax.decisions._replan import (
    ReplannerProtocol,
)

__all__ = [
    "ADSP",
    "ASP",
    "BSP",
    "DEFAULT_POLICY",
    "POLICIES",
    "SSP",
    "Action",
    "ActionInterpreter",
    "Applied",
    "Drop",
    "ForcePull",
    "Hybrid",
    "HybridStage",
    "Joined",
    "NaiveOptimal",
    "PlanChanged",
    "PlannedHybrid",
    "Policy",
    "PolicyView",
    "PushAck",
    "PushBegun",
    "Release",
    "ReplannerProtocol",
    "Ringleader",
    "Ringmaster",
    "SaPS",
    "SaveCheckpoint",
    "SemiAsync",
    "SendParams",
    "ServerCore",
    "ServerEvent",
    "SpeedMeasured",
    "StageChanged",
    "StageSet",
    "StartApply",
    "Tick",
    "Verdict",
    "Wait",
    "WorkerInfo",
    "WorkerJoined",
    "WorkerLeft",
    "WorkerPulled",
    "WorkerPushed",
    "free_worker_id",
    "get_policy",
]
