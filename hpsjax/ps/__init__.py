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
* :class:`ServerOptions` holds one ``hpsjax-server``'s settings (its flags,
  checked once; :func:`parse_server` reads them from a command line), and
  :data:`RUN_SCHEMES` names each scheme with the policy and worker flags it
  stands for.
"""

from hpsjax.decisions import (
    ADSP,
    ASP,
    BSP,
    DEFAULT_POLICY,
    POLICIES,
    SSP,
    Action,
    Applied,
    Drop,
    ForcePull,
    Hybrid,
    HybridStage,
    NaiveOptimal,
    PlanChanged,
    PlannedHybrid,
    Policy,
    Release,
    Ringleader,
    Ringmaster,
    SaPS,
    SemiAsync,
    SendParams,
    ServerCore,
    StageChanged,
    Verdict,
    Wait,
    WorkerInfo,
    get_policy,
)
from hpsjax.net import (
    Client,
    KeyRangePartition,
    Server,
    ServerInfo,
    ShardedClient,
    ShardedVersion,
    Subscription,
)
from hpsjax.ps._options import (
    RUN_SCHEMES,
    ServerOptions,
    get_scheme,
    parse_server,
    server_options,
)
from hpsjax.ps._options import (
    Scheme as Scheme,  # documented with hpsjax.config
)
from hpsjax.storage import Checkpoint, CheckpointError, CheckpointManager
from hpsjax.wire import (
    AuthError,
    BadMagic,
    ConnectionClosed,
    ForcePullNotice,
    HpsError,
    InvalidUpdate,
    MalformedMetadata,
    NonFiniteUpdate,
    Notice,
    PayloadTooBig,
    PlanNotice,
    ProtocolError,
    PushAck,
    PushMeta,
    ServerError,
    ShuttingDown,
    SpecMismatch,
    StageNotice,
    TooManyLeaves,
    UnexpectedMessage,
    UnsupportedDtype,
    UnsupportedVersion,
    WireLimits,
    WorkerDropped,
)

__all__ = [
    "RUN_SCHEMES",
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
    "NaiveOptimal",
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
    "Ringleader",
    "Ringmaster",
    "SaPS",
    "SemiAsync",
    "SendParams",
    "Server",
    "ServerCore",
    "ServerOptions",
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
    "get_scheme",
    "parse_server",
    "server_options",
]
