"""A zerolite server running in a thread of the test process, on a free port of 127.0.0.1.

    with LiveServer(lm, ServeSettings(max_batch=4)) as server:
        httpx.post(server.url + "/v1/completions", json={...})

Leaving stops it as a signal would (drain, then stop) and checks that the decode loop left no row behind.
"""

from __future__ import annotations

import threading
import time

import httpx

from zerolite.serve.server import ServeSettings, bind, build_server

START_TIMEOUT_S = 30


class LiveServer:
    def __init__(self, lm, settings: ServeSettings = ServeSettings()):
        self.sock = bind("127.0.0.1", 0)
        self.server = build_server(lm, settings, None)
        self.decode_loop = self.server.decode_loop
        self.served = self.server.served
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.decode_loop.start()
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            assert time.monotonic() < deadline and self._thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.wait_idle()  # the test's requests all done, or cancelled: no row left behind
        self.server.handle_exit(None, None)
        self._thread.join(timeout=START_TIMEOUT_S)
        self.decode_loop.close()
        self.sock.close()
        assert not self._thread.is_alive(), "the server did not stop"

    def wait_idle(self, timeout_s: float = 30) -> None:
        """Until no sequence runs or waits (cancelled ones leave at the next step boundary)."""
        deadline = time.monotonic() + timeout_s
        while self.metric("zerolite_active_sequences") or self.metric("zerolite_queue_depth"):
            assert time.monotonic() < deadline, "sequences still hold places"
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        """One unlabelled series' value from GET /metrics."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)
