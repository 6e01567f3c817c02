"""Audit projection: the event log folded into PostgreSQL for SQL proofs."""
