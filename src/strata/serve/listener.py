"""Serving the app over HTTP/1.1 with uvicorn: deadlines for slow or idle connections, and a shutdown
that lets in-flight requests finish, then stops the rest cleanly (an error body or event, never a
cut-off response)."""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import threading

from .protocol import error_body

log = logging.getLogger("strata.serve")


def timed_protocol(head_timeout: float):
    """uvicorn's h11 protocol with a deadline for each request's head: a connection that opens (or, kept
    alive, starts another request) and does not finish its headers within head_timeout is closed, so
    slow clients cannot hold connections forever. Idle kept-alive connections close on uvicorn's own
    timeout_keep_alive."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        head_timer = None

        def _waiting_for_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(head_timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _head_timed_out(self) -> None:
            self.head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._waiting_for_head() and not self.transport.is_closing():
                self._arm()
            else:
                self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            """A request h11 cannot parse (a malformed request line, header or Content-Length) answered in
            the API's JSON error body, as every other error is."""
            import h11

            body = json.dumps(error_body("malformed HTTP request (its request line or a header, such as "
                                         "Content-Length, does not follow HTTP/1.1)", code=400)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                       (b"connection", b"close")]
            for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                          h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

    return TimedH11Protocol


def serve_forever(server, host: str, port: int, shutdown_timeout: float, timeout: float) -> None:
    import uvicorn

    from .app import create_app

    class GracefulServer(uvicorn.Server):
        """SIGTERM/SIGINT: stop accepting, let in-flight requests finish for shutdown_timeout seconds,
        then stop the rest within a round (each gets an error body or event), then exit 0 (uvicorn itself
        re-raises the signal after its shutdown, which would end the process with -15)."""

        def handle_exit(self, sig, frame):
            if not server.draining:
                server.draining = True
                log.info("shutting down: in-flight requests have %.0f s to finish", shutdown_timeout)
                timer = threading.Timer(shutdown_timeout, server.cut_all)
                timer.daemon = True
                timer.start()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            saved = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in saved.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(create_app(server), host=host, port=port, log_level="info",
                            http=timed_protocol(timeout), timeout_keep_alive=max(1, int(timeout)),
                            timeout_graceful_shutdown=shutdown_timeout + 10)
    GracefulServer(config).run()
