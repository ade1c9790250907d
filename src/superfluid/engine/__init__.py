"""llama.cpp: the model, its context of KV slots, and the sampler."""
