"""The hpsjax client told twice that its worker was dropped: raised once."""

import asyncio
import time

import numpy as np
import pytest
from test_protocol_conformance import PULL, SECRET, Conn, Running, pulled, push_zero

from hpsjax.ps import Client, WorkerDropped


def test_a_push_in_flight_at_a_drop_raises_once_and_the_pull_rejoins():
    params = {"w": np.zeros(4, np.float32)}
    server = Running(params, "bsp", core_kwargs={"initial_timeout": 0.5})
    try:

        async def main():
            b = Client("127.0.0.1", server.port, worker_id="b", secret=SECRET)
            await b.connect()
            _, vb = await b.pull()
            a = Conn(server.port, "a")
            va, _ = pulled(a)
            push_zero(a, va, params)
            a.send(PULL, {})
            # b's event loop is held (time.sleep), so the drop's ERROR notice
            # waits unread in its socket while b sends its push: the notice
            # and the push's own 42 arrive one after the other.
            deadline = time.monotonic() + 30
            while "b" in server.server.core.live and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "b" not in server.server.core.live
            time.sleep(0.2)
            with pytest.raises(WorkerDropped):
                await b.push({"w": np.ones(4, np.float32)}, version=vb)
            # The notice said what the reply said: the pull rejoins at once.
            _, version = await b.pull()
            assert version == 1 and "b" in server.server.core.live
            await b.close()
            a.bye()

        asyncio.run(main())
    finally:
        server.close()
