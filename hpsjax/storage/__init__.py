"""Storage: a parameter server's checkpoints on disk.

:class:`CheckpointManager` writes orbax checkpoints (tensorstore underneath) of
parameters, optimizer state and metadata, committed atomically and restored with
every array's crc32 checked; :data:`SERVER_CHECKPOINT_FORMAT` marks those of a
parameter server, which :mod:`hpsjax.export` turns into a parameters file. It sits
beside the wire at the bottom of the distributed system and knows nothing of servers
or workers.
"""

from hpsjax.storage._checkpoint import (
    SERVER_CHECKPOINT_FORMAT,
    SERVER_CHECKPOINT_FORMAT_VERSION,
    Checkpoint,
    CheckpointError,
    CheckpointManager,
)

__all__ = [
    "SERVER_CHECKPOINT_FORMAT",
    "SERVER_CHECKPOINT_FORMAT_VERSION",
    "Checkpoint",
    "CheckpointError",
    "CheckpointManager",
]
