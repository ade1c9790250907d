"""Admin verbs: QoS class, pins, the background rate, the log level and metrics."""

from __future__ import annotations

import logging

from ...logsetup import set_log_directive
from ...protocol.schema import (
    QOS_NAMES,
    EventBody,
    Request,
    Response,
)
from ...store.sessions import now_ms
from ..errors import DaemonError
from .base import DaemonBase

log = logging.getLogger("superfluid.core")
B = EventBody
R = Request


class AdminVerbs(DaemonBase):
    """Scheduling and observability settings."""

    def _set_qos(self, req: R.SetQos) -> Response:
        if req.class_ > 3:
            raise DaemonError(f"unknown QoS class {req.class_} (0 interactive .. 3 background)")
        with self.store.lock:
            s = self._session(req.session)
            event = self._commit_one(s.id, B.QosSet(req.class_, req.batch_invariant))
        log.debug("session %d qos %s", s.id, QOS_NAMES[req.class_])
        return Response.Committed(event)

    def _pin(self, req: R.Pin) -> Response:
        with self.store.lock:
            s = self._session(req.session)
            deadline = now_ms() + req.ttl_ms if req.ttl_ms else 0
            self._commit_one(s.id, B.Pinned(deadline))
            self.scheduler.pin(s.tokens, deadline)
            return Response.Pinned(deadline)

    def _set_background_rate(self, req: R.SetBackgroundRate) -> Response:
        self.scheduler.background_divisor = max(req.divisor, 1)
        return Response.Ack()

    def _set_log_level(self, req: R.SetLogLevel) -> Response:
        try:
            set_log_directive(req.directive)
        except ValueError as e:
            raise DaemonError(str(e)) from None  # what was wrong and what is accepted
        return Response.Ack()

    def _metrics(self, req: R.Metrics) -> Response:
        return Response.Text(self.metrics.exposition())
