"""The daemon's middle: the session verbs, generations in flight, the event bus, the loaded models, the cluster."""
