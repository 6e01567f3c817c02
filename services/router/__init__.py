"""The router: one front door (gRPC and OpenAI-compatible HTTP) over the workers."""
