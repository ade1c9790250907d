"""Block and media verbs: typed blocks, images, and the media pool."""

from __future__ import annotations

import json

from ...model.blocks import BlockError, project_block
from ...protocol.schema import (
    BLOCK_IMAGE,
    MODEL_VISIBILITY_VERSION,
    ROLE_ASSISTANT,
    EventBody,
    Request,
    Response,
)
from ..errors import DaemonError
from .base import DaemonBase

B = EventBody
R = Request


class MediaVerbs(DaemonBase):
    """Blocks, images and the media pool."""

    def _append_block(self, req: R.AppendBlock) -> Response:
        if req.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {req.role}")
        try:
            projection = project_block(req.kind, req.payload)
        except BlockError as e:
            raise DaemonError(str(e)) from None
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            span = self._message_span(bool(s.tokens), s.last_input, req.role, projection)
            block = B.Block(req.role, req.kind, req.payload, span, MODEL_VISIBILITY_VERSION)
            return Response.Committed(self._commit_one(s.id, block))

    def _append_image(self, req: R.AppendImage) -> Response:
        if req.role > ROLE_ASSISTANT:
            raise DaemonError(f"unknown message role {req.role}")
        with self.store.lock:
            s = self._session(req.session)
            self._idle(s)
            if not self.media.has(req.blob):
                raise DaemonError(f"media blob {req.blob} is not in the pool (put it first)")
            raise DaemonError(
                f"{self.model.name} is a text-only model: it has no vision projector, so it cannot take "
                "images; serve a vision GGUF to use AppendImage"
            )

    def _put_media(self, req: R.PutMedia) -> Response:
        try:
            return Response.Media(self.media.put(req.bytes))
        except OSError as e:
            raise DaemonError(f"io: {e}") from None

    def _gc_media(self, req: R.GcMedia) -> Response:
        with self.store.lock:
            referenced = {
                blob
                for s in self.store.live()
                for e in s.events
                if isinstance(e.body, B.Block) and e.body.kind == BLOCK_IMAGE
                for blob in [_image_blob(e.body.payload)]
                if blob
            }
            kept, removed = self.media.gc(referenced)
        return Response.Gc(kept, removed)


def _image_blob(payload: str) -> str | None:
    try:
        blob = json.loads(payload).get("blob")
    except (ValueError, AttributeError):
        return None
    return blob if isinstance(blob, str) else None
