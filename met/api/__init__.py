"""The HTTP server: FastAPI app with the OpenAI-compatible routes, auth, errors, SSE, metrics."""
