"""The run configuration: :class:`RunConfig` and :class:`WorkerSettings`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from hpsjax._checks import check_int
from hpsjax._config_flags import config_kwargs, to_argv
from hpsjax.ps import RUN_SCHEMES, Scheme, ServerOptions, get_scheme, parse_server
from hpsjax.worker import WorkerCommand, WorkerConfig, parse_worker_args

__all__ = [
    "RUN_SCHEMES",
    "RunConfig",
    "Scheme",
    "WorkerSettings",
    "get_scheme",
    "parse_server",
    "parse_worker",
]


@dataclasses.dataclass(frozen=True)
class WorkerSettings:
    """One worker process's settings: ``hpsjax-worker``'s flags, as fields.

    Attributes:
      command: the command's own settings (server address, model, data, plan
        file, injected heterogeneity, outputs).
      config: the worker's :class:`~hpsjax.worker.WorkerConfig` (its id,
        batch, local steps, compression, stops), checked by its own
        ``__post_init__``.
    """

    command: WorkerCommand = dataclasses.field(default_factory=WorkerCommand)
    config: WorkerConfig = dataclasses.field(default_factory=WorkerConfig)

    def __post_init__(self):
        for name, kind in (("command", WorkerCommand), ("config", WorkerConfig)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(
                    f"WorkerSettings.{name} must be a {kind.__name__}, "
                    f"got {getattr(self, name)!r}"
                )

    def argv(self) -> list[str]:
        """The worker's ``hpsjax-worker`` flags (fields at their defaults left
        out)."""
        return to_argv(self.command) + to_argv(self.config)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """A run: its server's settings and each worker's, checked as a whole.

    Each part is checked by its own class when it is made; the run checks what
    no part can alone: at least one worker, worker ids that tell the workers
    apart (two workers under one id would read to the server as one worker
    reconnecting), and data shards that cover each worker once.

    Attributes:
      workers: each worker's :class:`WorkerSettings`, in order.
      server: the server's :class:`~hpsjax.ps.ServerOptions`, or
        ``None`` where the caller runs the server itself (in its own process).

    Raises:
      ValueError: in one line, naming the workers concerned.

    Examples:
      >>> from hpsjax.worker import WorkerConfig
      >>> one = WorkerSettings(config=WorkerConfig(worker_id=0))
      >>> RunConfig(workers=(one, one))
      Traceback (most recent call last):
      ...
      ValueError: workers 0 and 1 both have worker_id 0: give each its own --worker_id
    """

    workers: tuple[WorkerSettings, ...]
    server: ServerOptions | None = None

    def __post_init__(self):
        workers = tuple(self.workers)
        object.__setattr__(self, "workers", workers)
        if not workers or not all(isinstance(w, WorkerSettings) for w in workers):
            raise ValueError(
                f"workers must be a non-empty sequence of WorkerSettings, "
                f"got {self.workers!r}"
            )
        if self.server is not None and not isinstance(self.server, ServerOptions):
            raise ValueError(f"server must be ServerOptions, got {self.server!r}")
        seen: dict[str | int, int] = {}
        for i, worker in enumerate(workers):
            first = seen.setdefault(worker.config.worker_id, i)
            if first != i:
                raise ValueError(
                    f"workers {first} and {i} both have worker_id "
                    f"{worker.config.worker_id!r}: give each its own --worker_id"
                )
        self._check_shards()

    def _check_shards(self) -> None:
        """Workers that shard the data do it the same way, once each."""
        sharded = [
            (i, w.command) for i, w in enumerate(self.workers)
            if w.command.shard_index is not None
        ]  # fmt: skip
        counts = {command.shard_count for _, command in sharded}
        if len(counts) > 1:
            raise ValueError(
                f"the workers give different --shard_count values: {sorted(counts)}"
            )
        indices: dict[int, int] = {}
        for i, command in sharded:
            check_int(
                f"worker {i}'s --shard_index",
                command.shard_index,
                low=0,
                high=command.shard_count - 1,
            )
            first = indices.setdefault(command.shard_index, i)
            if first != i:
                raise ValueError(
                    f"workers {first} and {i} both read shard {command.shard_index}"
                )

    def server_argv(self) -> list[str]:
        """The server's ``hpsjax-server`` flags.

        Raises:
          ValueError: a run without a server configuration.
        """
        if self.server is None:
            raise ValueError("this run has no server configuration")
        return to_argv(self.server)

    def worker_argv(self, index: int) -> list[str]:
        """Worker ``index``'s ``hpsjax-worker`` flags."""
        return self.workers[index].argv()


def parse_worker(argv: Sequence[str]) -> WorkerSettings:
    """A worker's settings from its ``hpsjax-worker`` flags (checked).

    Raises:
      SystemExit: a flag the command does not take (argparse's message).
      ValueError: a bad setting, in one line.
    """
    args = parse_worker_args(list(argv))
    return WorkerSettings(
        WorkerCommand(**config_kwargs(WorkerCommand, args)),
        WorkerConfig(**config_kwargs(WorkerConfig, args)),
    )
