"""The session protocol: one schema (`schema.py`) and the two codecs it drives."""

from . import jsoncodec, postcard, schema
from .schema import EventBody, EventMsg, GenParams, Request, Response

__all__ = ["EventBody", "EventMsg", "GenParams", "Request", "Response", "jsoncodec", "postcard", "schema"]
