"""``hpsjax-worker`` without ``--worker_id``: the id its server assigns.

Before it builds anything that depends on its id (its data shard, which is
``--worker_id`` by default, its log and metrics names), a worker started
without one connects to its server (the first of ``--servers``) without an id,
takes the lowest free id the server assigns in its handshake (PROTOCOL.md,
HELLO), and says goodbye; the server never assigns that id again, so the
worker then joins under it as one started with ``--worker_id`` would.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from hpsjax._config_flags import config_kwargs
from hpsjax.worker._build import (
    connect,
    load_dataset,
    make_client,
    model_structure,
    server_address,
)
from hpsjax.worker._command import WorkerCommand
from hpsjax.worker._config import WorkerConfig

__all__ = ["given_or_assigned_id"]

logger = logging.getLogger("hpsjax.worker")


def given_or_assigned_id(args: argparse.Namespace) -> str | int | None:
    """``--worker_id``, else the id the server assigns (see the module
    docstring); ``None`` without a server address (building then says so).

    Raises:
      ValueError: a bad flag value, or ``--work_plan`` without
        ``--worker_id`` (a plan is a given worker's).
      JoinError: no server answered within ``--connect_timeout``, or it
        refused the secret.
    """
    if args.worker_id is not None:
        return args.worker_id
    if args.work_plan is not None:
        raise ValueError("--work_plan needs --worker_id: it is a given worker's")
    # The flags are checked before the server is asked: their values, the
    # data and the model (built again once the id is known).
    WorkerCommand(**config_kwargs(WorkerCommand, args))
    WorkerConfig(**config_kwargs(WorkerConfig, args))
    model_structure(args, load_dataset(args))
    if args.servers is not None:
        address = args.servers[0]
    elif args.port is not None:
        address = (args.host, args.port)
    else:
        return None
    client = make_client(args, address)
    where = server_address(args)

    async def ask() -> None:
        await connect(client, None, connect_timeout=args.connect_timeout, where=where)
        await client.close()

    asyncio.run(ask())
    logger.info("the server at %s assigned worker id %s", where, client.worker_id)
    return client.worker_id
