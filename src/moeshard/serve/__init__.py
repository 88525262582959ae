"""The HTTP server: OpenAI-compatible routes, Prometheus metrics and the RL routes over AsyncLLM."""
