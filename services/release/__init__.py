"""Release safety's processes and operator tools: the canary controller (`canary_app`, the
`loraplane serve canary` process; `controller`, what it asks the registry to do now;
`metrics`), the operator's `deploy` (publish, gate, canary) and the gate `report`.

The rules they apply are shared with the registry and the worker, so they live below both
in `services.catalog`: `gates` (who runs a gate, when a result passes), `regression` (the
JSONL regression set and its checks), `canary` (figures from request traces, a stage's
verdict) and `release_rule` (may this version get traffic). The worker runs gates with
`services.worker.gate_runner`.
"""
