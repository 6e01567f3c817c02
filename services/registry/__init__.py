"""The registry: REST control plane and single writer of the adapter event log."""
