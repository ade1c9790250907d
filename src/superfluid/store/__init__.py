"""The durable session log and the state replayed from it."""
