"""``RunningServer``: an ``ApiServer`` on 127.0.0.1 and a free port, in a background thread."""

from __future__ import annotations

import threading

from engine.server.app import Phase, ServerOptions
from engine.server.launcher import ApiServer, LaunchOptions


class RunningServer:
    """An ``ApiServer`` running in a background thread (``with`` starts and stops it)."""

    def __init__(
        self,
        engine_factory,
        options: ServerOptions | None = None,
        launch: LaunchOptions | None = None,
    ) -> None:
        launch = launch or LaunchOptions(port=0, log_stats_interval=0.0, access_log=False)
        self.server = ApiServer(engine_factory, options or ServerOptions(), launch)
        self.thread = threading.Thread(target=self.server.run, name="test-server", daemon=True)
        self.base_url = f"http://127.0.0.1:{self.server.port}"

    @property
    def engine(self):
        """The ``LLMEngine`` being served."""
        return self.server.state.engine.engine

    def __enter__(self) -> RunningServer:
        self.thread.start()
        assert self.server.ready.wait(120), "the server did not become ready"
        assert self.server.state.phase is Phase.READY, self.server.state.startup_error
        return self

    def __exit__(self, *exc) -> None:
        self.server.request_shutdown()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"
