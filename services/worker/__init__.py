"""Worker service: engine, adapter pool, lifecycle and gRPC server for one base model."""
