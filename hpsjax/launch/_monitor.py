"""The launcher's view of a run: the server's version, polled in the background
(for the progress bar and the result)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from hpsjax.ps import Client, HpsError


class Monitor:
    """Polls the server's version from a background thread (for the bar)."""

    def __init__(
        self, port: int, secret: bytes, interval: float = 0.5, host: str = "127.0.0.1"
    ):
        self._host = host
        self._port = port
        self.secret = secret
        self._interval = interval
        self._stop = threading.Event()
        self.version: int | None = None
        self._thread = threading.Thread(target=self._run, name="monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.run(self._poll())

    async def _poll(self) -> None:
        client = Client(
            self._host,
            self._port,
            worker_id="hpsjax-launch-monitor",
            secret=self.secret,
            timeout=5.0,
        )
        with contextlib.suppress(HpsError, OSError, TimeoutError):
            info = await client.connect()
            self.version = info.version
            while not self._stop.is_set():
                self.version = (await client.refresh_info()).version
                await asyncio.sleep(self._interval)
        with contextlib.suppress(HpsError, OSError, TimeoutError):
            await client.close(timeout=1.0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._interval + 6.0)
