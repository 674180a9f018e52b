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

from hpsjax.worker._build import (
    build,
    connect,
    make_client,
    server_address,
    training_servers,
)

__all__ = ["given_or_assigned_id"]

logger = logging.getLogger("hpsjax.worker")


def given_or_assigned_id(args: argparse.Namespace) -> str | int:
    """``--worker_id``, else the id the server assigns (see the module
    docstring), asked only once every flag the build checks has passed.

    Raises:
      ValueError: a bad flag value, no server to join, or ``--work_plan``
        without ``--worker_id`` (a plan is a given worker's).
      JoinError: no server answered within ``--connect_timeout``, or it
        refused the secret.
    """
    if args.worker_id is not None:
        return args.worker_id
    if args.work_plan is not None:
        raise ValueError("--work_plan needs --worker_id: it is a given worker's")
    # Every flag is checked before the server is asked: the worker is built
    # once under a provisional id (nothing connects while building) and built
    # again once the id is known.
    build(argparse.Namespace(**{**vars(args), "worker_id": 0}))
    client = make_client(args, training_servers(args)[0])
    where = server_address(args)

    async def ask() -> None:
        await connect(client, None, connect_timeout=args.connect_timeout, where=where)
        await client.close()

    asyncio.run(ask())
    logger.info("the server at %s assigned worker id %s", where, client.worker_id)
    return client.worker_id
