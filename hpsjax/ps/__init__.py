"""The parameter server: sans-I/O core, policies, wire, asyncio server and client.

* :class:`ServerCore` makes every decision (versions, staleness, who waits, what is
  applied) as a pure state machine; the asyncio :class:`Server` and the
  virtual-clock simulator (:mod:`hpsjax.sim`) both drive it.
* Policies (:data:`POLICIES`, :func:`get_policy`): BSP, ASP, SSP, SaPS, ADSP,
  Ringmaster, semi-async and hybrid (:class:`PlannedHybrid`: ASHL's stages with each
  worker's planned local steps); subclass :class:`Policy` to write your own.
* :class:`Server` / :class:`Client` exchange pytrees over TCP (see PROTOCOL.md),
  with authentication, optional TLS and compressed pushes; their typed messages
  (:class:`PushMeta`, :class:`PushAck`, notices) are validated once, on arrival;
  :class:`WireLimits` bounds what either side accepts in a frame.
* :class:`CheckpointManager` writes orbax checkpoints, committed atomically.
* :class:`KeyRangePartition` splits a model by key range over several server
  shards (ps-lite, PHub); :class:`ShardedClient` talks to all of them at once.
"""

from hpsjax.decisions._core import (
    Action,
    Applied,
    Drop,
    ForcePull,
    PlanChanged,
    Release,
    SendParams,
    ServerCore,
    StageChanged,
    Wait,
    WorkerInfo,
)
from hpsjax.decisions._policies import (
    ADSP,
    ASP,
    BSP,
    DEFAULT_POLICY,
    POLICIES,
    SSP,
    Hybrid,
    HybridStage,
    PlannedHybrid,
    Policy,
    Ringmaster,
    SaPS,
    SemiAsync,
    Verdict,
    get_policy,
)
from hpsjax.net._client import Client, ServerInfo, Subscription
from hpsjax.net._partition import KeyRangePartition
from hpsjax.net._server import Server
from hpsjax.net._shards import (
    ShardedClient,
    ShardedVersion,
)
from hpsjax.storage._checkpoint import Checkpoint, CheckpointError, CheckpointManager
from hpsjax.wire._errors import (
    AuthError,
    BadMagic,
    ConnectionClosed,
    HpsError,
    InvalidUpdate,
    MalformedMetadata,
    NonFiniteUpdate,
    PayloadTooBig,
    ProtocolError,
    ServerError,
    ShuttingDown,
    SpecMismatch,
    TooManyLeaves,
    UnexpectedMessage,
    UnsupportedDtype,
    UnsupportedVersion,
    WorkerDropped,
)
from hpsjax.wire._frames import WireLimits
from hpsjax.wire._messages import (
    ForcePullNotice,
    Notice,
    PlanNotice,
    PushAck,
    PushMeta,
    StageNotice,
)

__all__ = [
    "ADSP",
    "ASP",
    "BSP",
    "DEFAULT_POLICY",
    "POLICIES",
    "SSP",
    "Action",
    "Applied",
    "AuthError",
    "BadMagic",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
    "Client",
    "ConnectionClosed",
    "Drop",
    "ForcePull",
    "ForcePullNotice",
    "HpsError",
    "Hybrid",
    "HybridStage",
    "InvalidUpdate",
    "KeyRangePartition",
    "MalformedMetadata",
    "NonFiniteUpdate",
    "Notice",
    "PayloadTooBig",
    "PlanChanged",
    "PlanNotice",
    "PlannedHybrid",
    "Policy",
    "ProtocolError",
    "PushAck",
    "PushMeta",
    "Release",
    "Ringmaster",
    "SaPS",
    "SemiAsync",
    "SendParams",
    "Server",
    "ServerCore",
    "ServerError",
    "ServerInfo",
    "ShardedClient",
    "ShardedVersion",
    "ShuttingDown",
    "SpecMismatch",
    "StageChanged",
    "StageNotice",
    "Subscription",
    "TooManyLeaves",
    "UnexpectedMessage",
    "UnsupportedDtype",
    "UnsupportedVersion",
    "Verdict",
    "Wait",
    "WireLimits",
    "WorkerDropped",
    "WorkerInfo",
    "get_policy",
]
