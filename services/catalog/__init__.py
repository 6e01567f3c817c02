"""The catalog: the one fold of the adapter log, and every rule two services must agree on.

Serving and rollback (`serving`, `state`), purges, the release rule (`release_rule`),
quality gates (`gates`), regression sets (`regression`) and canary analysis (`canary`).
Registry, workers, router and the canary controller import this package; none keeps a
copy of these rules. It imports only contracts and the event log (docs/architecture.md).
"""
