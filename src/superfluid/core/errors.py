"""How the daemon refuses a request: the errors every verb raises, and the reply a client reads of them.

Nothing is written when a request is refused.
"""

from __future__ import annotations

from ..protocol.schema import Response
from ..store.errors import StoreError
from ..store.leases import LeaseLost, SessionElsewhere


class DaemonError(Exception):
    """A refused request; the text is what the client reads in `Err`."""


class ContextTooLong(DaemonError):
    """A prompt longer than the model's window."""


# what refuses a request without anything written, as the client is told of it
REFUSED = (DaemonError, SessionElsewhere, LeaseLost, StoreError)


def refusal(e: Exception) -> Response:
    """The reply that tells a client its request was refused, from one of REFUSED."""
    if isinstance(e, SessionElsewhere):
        return Response.Elsewhere(e.session, e.address)
    return Response.Err(str(e))


def check_fits(window: int, length: int) -> None:
    """ContextTooLong unless a prompt of `length` tokens leaves room for a token in a `window`-token context:
    the one refusal of a prompt too long, whichever API it came through."""
    if length >= window:
        raise ContextTooLong(
            f"this model's maximum context length is {window} tokens, but your request has "
            f"{length} tokens; shorten the prompt or drop earlier turns"
        )
