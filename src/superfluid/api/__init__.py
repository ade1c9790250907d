"""The HTTP APIs' shapes: OpenAI, Anthropic, Ollama and Responses, and the stateless chat layer they share."""
