"""What the daemon knows of a model: references, chat template, channels and tools."""
