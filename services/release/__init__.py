"""Release safety: quality gates on adapter versions and canary rollouts.

Pure parts (no I/O): `regression` (the JSONL regression set and its checks), `gate`
(a gate run over the engine's outputs, and the verdict the registry recomputes),
`canary` (figures from request traces, a stage's verdict, rollout plans). Wiring:
`gate_runner` (runs a gate through an `Engine`), `controller` and `canary_app` (the
`loraplane serve canary` process). The rule "may this version get traffic" lives in
`services.catalog.release`, where the registry and the serving rule both read it.
"""
