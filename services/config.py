"""One settings class for every loraplane process.

Every process (registry, worker, router, audit projector, the embedded stack) reads the
same class so an environment variable means the same thing everywhere; docker-compose
configures services only through these `LORAPLANE_*` variables, and a test checks that
each variable it names is a field here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from services.contracts.capacity import ENGINE_DTYPES
from services.contracts.events import MERGE_PATTERN, BaseWeights

BrokerKind = Literal["auto", "apache", "tansu"]
TierName = Literal["platinum", "gold", "silver", "bronze"]


REMOVED = {
    "max_lora_rank": "the registry refuses ranks above LORAPLANE_WORKER_MAX_LORA_RANK, the "
                     "rank a worker's adapter pool holds; set that one (for every process)",
    "blob_erasure_grace_s": "a purge erases every file of the tenant's purged versions at "
                            "once; a publish racing it stores its own files again",
}
"""Settings that existed once, each with what replaced it: set, they stop the process."""

class Settings(BaseSettings):
    """Process configuration, from `LORAPLANE_*` environment variables or keyword args."""

    model_config = SettingsConfigDict(env_prefix="LORAPLANE_", extra="ignore", frozen=True)

    # --- where things live -------------------------------------------------------------
    state_dir: Path = Field(
        Path(".loraplane"), description="Runtime state of `loraplane up`: data, logs, lock."
    )
    cache_dir: Path = Field(
        Path(".loraplane/cache"),
        description="Downloads kept across runs (the Apache Kafka jars). Safe to share.",
    )

    # --- Kafka ---------------------------------------------------------------------------
    kafka_bootstrap: str | None = Field(
        None, description="An existing broker; when unset, `loraplane up` starts one."
    )
    kafka_broker: BrokerKind = Field(
        "auto", description="Embedded broker: apache (KRaft jars), tansu, or auto (apache if Java)."
    )
    kafka_version: str = Field("4.1.1", description="Apache Kafka version fetched for KRaft.")
    kafka_heap: str = Field("512m", description="JVM heap of the embedded Apache Kafka broker.")
    adapter_events_topic: str = Field(
        "loraplane.adapter-events",
        description="The registry's commands: the system of record, chained by the audit store.")
    worker_events_topic: str = Field(
        "loraplane.worker-events",
        description="Worker acknowledgements and request traces.")
    dead_letter_topic: str = Field(
        "loraplane.dead-letter", description="Records that failed validation, with the reason.")
    liveness_topic: str = Field(
        "loraplane.liveness",
        description="Registry leases and worker heartbeats: compacted by stream and deleted "
                    "after `liveness_retention_ms`; never part of the audit record.")
    topic_partitions: int = Field(8, ge=1, le=1024, description="Partitions of each event topic.")
    topic_replication: int = Field(1, ge=1, description="Replicas of each event topic.")
    adapter_events_retention_ms: int = Field(
        -1, description="The adapter log is the system of record: kept forever by default."
    )
    worker_events_retention_ms: int = Field(
        30 * 24 * 3600 * 1000, description="Worker events are projected into Postgres."
    )
    dead_letter_retention_ms: int = Field(
        30 * 24 * 3600 * 1000, description="How long dead letters stay on their topic.")
    liveness_retention_ms: int = Field(
        3600 * 1000, ge=60_000,
        description="How long leases and heartbeats stay on the liveness topic (the newest "
                    "per stream is kept until then, older ones go at compaction).")

    # --- readers: snapshots of the fold ------------------------------------------------
    snapshot_dir: Path | None = Field(
        None, description="Where log followers keep snapshots of their fold; default "
                          "STATE_DIR/snapshots.")
    snapshot_every_events: int = Field(
        20_000, ge=1, description="A follower writes a snapshot once it has read this many "
                                  "records since the last one.")
    snapshot_every_s: float = Field(
        60.0, gt=0, description="A follower that read anything writes a snapshot at least this "
                                "often (and on a clean stop).")
    fold_skip_events: list[str] = Field(
        default_factory=list,
        description="Event ids (UUIDs) that readers skip instead of halting on them: the "
                    "operator's way past an event the fold cannot take (see /readyz).")

    # --- PostgreSQL ----------------------------------------------------------------------
    database_url: str | None = Field(
        None, description="SQLAlchemy URL; when unset, `loraplane up` starts embedded PostgreSQL."
    )

    # --- registry ------------------------------------------------------------------------
    registry_host: str = Field("127.0.0.1", description="Registry REST listener address.")
    registry_port: int = Field(8780, description="Registry REST listener port.")
    registry_url: str | None = Field(
        None, description="How other processes reach the registry (default from host/port); "
        "several URLs separated by commas for an active registry and its standbys: clients "
        "send each request to the one that answered last and move on to the next when it "
        "does not answer or is a standby.")
    registry_transactional_id: str = Field(
        "loraplane-registry", description="Fixed so a second registry instance fences the first."
    )
    registry_id: str | None = Field(
        None, description="Names this registry instance in leases and logs (default: "
        "registry- and a random suffix).")
    registry_election: Literal["start", "lease"] = Field(
        "start", description="Who writes the adapter log. start: an instance takes the "
        "writer role when it starts, fencing any other (one registry). lease: an instance "
        "starts as a standby serving reads and takes over, fencing the old writer, once "
        "nothing from the writer was read for `lease_ttl_s` (an active and standbys).")
    lease_interval_s: float = Field(
        2.0, gt=0, description="The writing registry leases every interval.")
    lease_ttl_s: float = Field(
        5.0, gt=0, description="A lease's validity; under lease election, how long a standby "
        "waits for a sign of the writer before it takes over.")
    registry_write_timeout_s: float = Field(
        10.0, gt=0, description="The most a registry write request takes, waiting behind "
                                "other writes included, before it answers 503.")
    blob_dir: Path | None = Field(
        None, description="Content-addressed blob store (sha256/ab/abcd…); default STATE_DIR/blobs."
    )
    max_upload_bytes: int = Field(
        512 * 1024 * 1024, ge=1, description="Largest adapter upload the registry accepts.")
    allowed_dtypes: list[str] = Field(
        default_factory=lambda: list(ENGINE_DTYPES), min_length=1,
        description="Adapter dtypes the registry accepts and workers load (one capacity "
        "rule, services/contracts/capacity.py): some of float16, bfloat16, float32.")
    auth_tokens: str | None = Field(
        None,
        description='JSON list of {"sha256": hex of the token, "role": admin|publisher|reader|'
        'worker|inference|canary (what each may do: services/contracts/roles.py), "tenant": '
        '"org/team/project" for publishers and inference callers (a "*" segment matches '
        'any), optional "qos_tier" of an inference caller}. Tokens are stored hashed.',
    )

    # --- worker ----------------------------------------------------------------------------
    base_model: Path | None = Field(
        None, description="The worker's base model: a Hugging Face directory (config.json, "
        "safetensors, tokenizer.json). Its digest must be registered before the worker serves.")
    worker_id: str | None = Field(
        None, description="Stable name of this worker in events; default worker-HOST-PORT.")
    worker_host: str = Field("127.0.0.1", description="Worker gRPC listener address.")
    worker_port: int = Field(8781, description="Worker gRPC listener port.")
    worker_address: str | None = Field(
        None, description="host:port the router dials (default WORKER_HOST:WORKER_PORT).")
    worker_token: str | None = Field(
        None, description="Bearer token with the worker role, for the registry's blob store.")
    worker_metrics_port: int = Field(8785, ge=0, description="Prometheus metrics; 0 = off.")
    worker_device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when present, else CPU.")
    worker_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bf16 where the hardware runs it natively (CUDA, CPUs with "
        "AVX512-BF16 or AMX), else float32 (the engine's serving_dtype).")
    worker_weights: BaseWeights = Field(
        "dense", description="Base projections: dense (in WORKER_DTYPE) or int8 (per-channel "
        "symmetric int8 weights, activations and the LoRA pass in WORKER_DTYPE: half the "
        "bytes of bf16 per decode step). Heartbeats and request traces name it; merged mode "
        "needs dense.")
    worker_row_weights_bytes: int = Field(
        1 << 30, ge=0, description="bf16 on the CPU: most bytes of plain base projections "
        "kept beside oneDNN's packed ones, so that decode steps of one or two streams read "
        "them with the compiled few-row kernel (about 20% less time a token on SmolLM2-135M, for "
        "its 214 MB). A bigger model keeps one copy and decodes through oneDNN; 0 keeps "
        "none. int8 weights need no copy: the kernel reads them whatever this is.")
    worker_adapter_slots: int = Field(8, ge=1, description="Device tier: adapter slots.")
    worker_max_lora_rank: int = Field(
        64, ge=1, description="The largest LoRA rank a worker's adapter pool holds; the "
        "registry refuses a higher one at publish (it shares this setting).")
    worker_kv_blocks: int = Field(2048, ge=1, description="Paged KV cache: blocks.")
    worker_block_size: int = Field(16, ge=1, description="Paged KV cache: tokens per block.")
    worker_max_running: int = Field(64, ge=1, description="Sequences batched at once.")
    worker_max_tokens_per_step: int = Field(
        2048, ge=1, description="Tokens one engine step computes at most.")
    worker_max_model_len: int | None = Field(
        None, ge=1, description="Prompt + completion tokens per request (default: the "
        "model's max_position_embeddings).")
    worker_default_max_tokens: int = Field(256, ge=1, description="When a request says 0.")
    worker_host_cache_bytes: int = Field(
        4 * 1024**3, ge=0, description="Host tier: parsed adapters in memory (pinned on CUDA).")
    worker_disk_cache_bytes: int = Field(
        32 * 1024**3, ge=0, description="Disk tier under STATE_DIR/adapter-cache.")
    worker_page_in_timeout_host_s: float = Field(
        2.0, gt=0, description="How long a request waits for its adapter to page in from host.")
    worker_page_in_timeout_disk_s: float = Field(
        10.0, gt=0, description="How long a request waits for its adapter from the disk tier.")
    worker_page_in_timeout_blob_s: float = Field(
        60.0, gt=0, description="How long a request waits for its adapter from the registry.")
    worker_merge: str | None = Field(
        None, pattern=MERGE_PATTERN, description="Merged mode (`serve worker --merge`): "
        "ADAPTER_ID@VERSION serves that version merged into the base weights while it is "
        "servable; ADAPTER_ID follows the adapter's active version (a switch or rollback "
        "re-merges). The worker then serves only that adapter and refuses every other "
        "request with FAILED_PRECONDITION.")
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="How often workers emit WorkerHeartbeat (the router's clock "
        "for liveness: a worker that misses `router_missed_heartbeats` of them leaves the ring).")
    worker_trace_flush_s: float = Field(
        0.5, gt=0, description="RequestServed batches: at most this old before they are sent "
        "(when `worker_trace_durable` is off; with it on, traces are sent at once).")
    worker_trace_durable: bool = Field(
        True, description="Hold each request's final message (FinalUsage) until its trace is "
        "acknowledged by the broker, so every client that got a complete answer has a durable "
        "trace even if the worker dies right after. Traces finishing while one write is in "
        "flight go out together in the next (group commit); the engine never waits. Off: "
        "traces are batched every `worker_trace_flush_s` and a kill -9 loses the last batch.")
    worker_drain_s: float = Field(
        30.0, ge=0, description="On SIGTERM a worker leaves the ring (a draining heartbeat), "
        "stops admitting once routers had time to see it, and gives its streams this long "
        "(seconds, all of it) to finish before it exits; compose and Kubernetes give it "
        "this much grace and some more.")
    stale_lease_threshold_s: float = Field(
        30.0, gt=0, description="Version wall: a worker whose last registry lease is older "
        "refuses requests (UNAVAILABLE) rather than serve a possibly stale version.")

    # --- router / audit -----------------------------------------------------------------
    router_host: str = Field("127.0.0.1", description="Router listener address (gRPC and HTTP).")
    router_port: int = Field(8782, description="gRPC loraplane.v1.Inference (and health).")
    router_http_port: int = Field(
        8784, description="OpenAI-compatible HTTP API, /metrics, /healthz and /readyz.")
    router_id: str | None = Field(None, description="Names this router in logs and to Kafka.")
    router_addresses: str | None = Field(
        None, description="host:port of routers a client may use, separated by commas "
        "(default ROUTER_HOST:ROUTER_PORT): any router serves any request, and a client "
        "moves on to the next when one does not answer.")
    router_missed_heartbeats: int = Field(
        3, ge=1, description="Heartbeats a worker may miss before it leaves the ring.")
    router_heartbeat_stall_grace_s: float = Field(
        15.0, ge=0, description="A worker whose heartbeats stop while nothing at all is read "
        "from the partition carrying them (its leader failing over) stays in the ring this "
        "much longer than `router_missed_heartbeats` intervals.")
    router_ring_vnodes: int = Field(160, ge=1, description="Ring points per worker.")
    router_load_epsilon: float = Field(
        0.25, gt=0, description="Bounded load: no worker above (1+eps) x mean in-flight.")
    router_affinity_window: int = Field(
        3, ge=1, description="How many ring workers (under the load bound) a request may go "
        "to instead of its cold home because they hold its adapter; 1 = plain ring.")
    router_prewarm: bool = Field(
        True, description="Prefetch recently used adapters into the workers that gain key "
        "ranges on a ring change, and hint a cold home while a warm neighbour serves.")
    router_recent_adapters: int = Field(
        4, ge=0, description="Adapters remembered per tenant signature for pre-warming.")
    router_tenant_rate: dict[TierName, float] = Field(
        default_factory=lambda: {"platinum": 400.0, "gold": 200.0, "silver": 100.0,
                                 "bronze": 20.0},
        description="Requests/s per tenant, by the tenant's QoS tier (token bucket).")
    router_adapter_rate: dict[TierName, float] = Field(
        default_factory=lambda: {"platinum": 200.0, "gold": 100.0, "silver": 50.0,
                                 "bronze": 10.0},
        description="Requests/s per adapter, by the adapter version's QoS tier.")
    router_cold_load_rate: dict[TierName, float] = Field(
        default_factory=lambda: {"platinum": 4.0, "gold": 2.0, "silver": 1.0, "bronze": 0.2},
        description="Requests/s per tenant that force a worker to load an adapter from disk.")
    router_burst_s: float = Field(
        2.0, gt=0, description="Bucket depth in seconds of its rate (burst = rate x this).")
    router_rate_overrides: dict[str, float] = Field(
        default_factory=dict,
        description='Requests/s for one tenant or adapter instead of its tier default: '
        '{"tenant:org/team/project": 5, "adapter:acme-support": 50}.')
    router_gc_freeze: bool = Field(
        True, description="Once the log is replayed, move everything folded so far out of "
        "the garbage collector's reach (gc.freeze), so a full collection walks only what "
        "came later: without it one took 120-150 ms over a 10,000-tenant catalog.")
    router_drain_s: float = Field(
        30.0, ge=0, description="On SIGTERM a router reports NOT_SERVING, refuses new "
        "requests on both fronts and gives those in flight this long (seconds) to finish.")
    router_request_timeout_s: float = Field(
        300.0, gt=0, description="Deadline of a request whose client set none (HTTP).")
    audit_metrics_port: int = Field(
        8783, ge=0, le=65535, description="Port of the projector's /metrics and /checkpoints "
        "(0: any free port).")
    audit_batch_size: int = Field(
        4000, ge=1, description="Most events per projector transaction; 4000 measured best "
        "(bench/audit.py on 2 cores: 2000 and 8000 were slower)."
    )
    audit_signing_key: str | None = Field(
        None, description="Ed25519 private key (32-byte seed, hex) that signs Merkle checkpoints."
    )
    audit_checkpoint_every: int = Field(
        1000, ge=1, description="Events per partition between signed Merkle checkpoints."
    )
    audit_checkpoint_every_s: float = Field(
        60.0, ge=0, description="A partition with events no checkpoint covers gets one "
        "signed at least this often (seconds), however few events came; 0: only by count.")
    audit_origin: str = Field(
        "loraplane.local/audit", pattern=r"^[^\s+]+$",
        description="Prefix of every partition log's checkpoint origin (and note key name): "
        "<origin>/<topic>/<partition>. Set it to a name you own, e.g. audit.example.com/lp.",
    )
    audit_kek: str | None = Field(
        None, description="Key-encryption key (32 bytes, hex) that wraps the tenants' data "
        "keys sealing personal fields; default: generated into STATE_DIR/audit-kek.",
    )
    audit_checkpoint_dir: Path | None = Field(
        None, description="Where the projector publishes every checkpoint as a signed note "
        "file; default STATE_DIR/checkpoints.",
    )
    audit_http_host: str = Field(
        "127.0.0.1", description="Listener of the projector's /metrics and /checkpoints."
    )

    # --- release safety: quality gates, canary rollouts (services/release) -------------
    release_ungated: Literal["block", "allow"] = Field(
        "block", description="Versions published without a regression set: block = no "
        "traffic until a regression set passes or an admin overrides with a reason; allow = "
        "they serve as before (migration aid). Decided per version at publish and written "
        "into its event, so every reader agrees and a later change does not reach back.")
    gate_timeout_s: float = Field(
        600.0, gt=0, le=86400, description="A gate with no result by then is FAILED (expired).")
    gate_max_cases: int = Field(256, ge=1, le=4096, description="Cases per regression set.")
    gate_max_set_bytes: int = Field(4 * 1024 * 1024, ge=1, description="Regression set size.")
    gate_sweep_interval_s: float = Field(
        1.0, gt=0, description="How often the registry looks for gates that cannot complete.")
    canary_stages: list[int] = Field(
        default_factory=lambda: [5, 25, 50, 100],
        description="Default canary traffic stages in percent (a rollout may give its own).")
    canary_min_stage_s: float = Field(
        900.0, gt=0, description="Default least time at a stage before advancing (15 min).")
    canary_window_s: float | None = Field(
        None, gt=0, description="Traces judged: the stage's last window_s (default: the "
        "stage's minimum time).")
    canary_max_error_ratio: float = Field(
        1.5, gt=0, description="Roll back when the canary's error rate is above this times the "
                                "baseline's (or the floor).")
    canary_error_rate_floor: float = Field(
        0.0, ge=0, le=1, description="A canary error rate up to this never fails the ratio.")
    canary_min_requests: int = Field(50, ge=1, description="Per arm and window, to judge.")
    canary_max_p95_ms: float = Field(5000.0, gt=0, description="Canary p95 latency bound.")
    canary_max_p95_ratio: float | None = Field(
        None, gt=0, description="Optional bound on canary p95 / baseline p95.")
    canary_interval_s: float = Field(1.0, gt=0, description="Controller evaluation period.")
    canary_settle_s: float = Field(
        3.0, ge=0, description="Judgement windows end this long ago: traces arrive in batches.")
    canary_lookback_s: float = Field(
        7200.0, gt=0, description="How far back the controller reads request traces at start.")
    canary_id: str | None = Field(None, description="Names the controller in logs and events.")
    canary_token: str | None = Field(
        None, description="Bearer token (role canary or admin) the controller sends the registry.")
    canary_metrics_host: str = Field(
        "127.0.0.1", description="Listener of the canary controller's /metrics.")
    canary_metrics_port: int = Field(
        8786, ge=0, le=65535, description="Port of the canary controller's /metrics (0: any "
        "free port).")
    api_token: str | None = Field(
        None, description="Bearer token the loraplane CLI sends the registry (default: the "
        "admin token `loraplane up` wrote to STATE_DIR/admin.token).")

    # --- TLS (services/tls.py) ----------------------------------------------------------
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate chain of this process: every listener it has "
        "serves TLS with it (router gRPC and HTTP, worker gRPC, registry, the projector's "
        "checkpoints), and its clients present it where a peer asks for a client "
        "certificate. Re-read when the file changes (no restart). Unset: plaintext.")
    tls_key_file: Path | None = Field(None, description="The private key of tls_cert_file.")
    tls_ca_file: Path | None = Field(
        None, description="PEM CA bundle this process trusts: its clients dial TLS and "
        "verify servers against it, and listeners verify client certificates against it.")
    tls_client_auth: list[Literal["router", "worker", "registry", "audit"]] = Field(
        default_factory=list, description="Listeners that require a client certificate "
        "signed by tls_ca_file (mutual TLS, per hop), e.g. [\"worker\"] so only routers "
        "holding a certificate reach workers.")
    tls_server_name: str | None = Field(
        None, description="Name gRPC clients check server certificates against instead of "
        "the host they dial (one certificate for workers at changing addresses).")

    # --- Kafka security (passed to every librdkafka client) -----------------------------
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="librdkafka security.protocol.")
    kafka_ssl_ca_file: Path | None = Field(None, description="ssl.ca.location")
    kafka_ssl_cert_file: Path | None = Field(None, description="ssl.certificate.location")
    kafka_ssl_key_file: Path | None = Field(None, description="ssl.key.location")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        None, description="sasl.mechanism (with a SASL_* protocol)")
    kafka_sasl_username: str | None = Field(None, description="sasl.username")
    kafka_sasl_password: str | None = Field(None, description="sasl.password")

    # --- PostgreSQL TLS (added to database_url's libpq parameters) ----------------------
    database_sslmode: Literal["disable", "allow", "prefer", "require", "verify-ca",
                              "verify-full"] | None = Field(
        None, description="libpq sslmode for every connection to database_url.")
    database_sslrootcert: Path | None = Field(None, description="libpq sslrootcert")
    database_sslcert: Path | None = Field(None, description="libpq sslcert (client certificate)")
    database_sslkey: Path | None = Field(None, description="libpq sslkey")

    log_level: str = Field("INFO", description="Python logging level of every process.")

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed(cls, data: Any) -> Any:
        """A setting that no longer exists is refused by name, not ignored (`REMOVED`)."""
        given = set(data) if isinstance(data, dict) else set()
        for name, why in REMOVED.items():
            if name in given or f"LORAPLANE_{name.upper()}" in os.environ:
                raise ValueError(f"LORAPLANE_{name.upper()} was removed: {why}")
        return data

    @model_validator(mode="after")
    def _database_tls(self) -> Settings:
        """The database_sslmode/-rootcert/-cert/-key settings as libpq parameters of
        database_url, so every engine and migration uses them; a URL that says otherwise
        is refused, not overridden."""
        wanted = {name: getattr(self, f"database_{name}") for name in
                  ("sslmode", "sslrootcert", "sslcert", "sslkey")}
        wanted = {k: str(v) for k, v in wanted.items() if v is not None}
        if not wanted:
            return self
        if not self.database_url:
            raise ValueError("LORAPLANE_DATABASE_SSLMODE (and the other database TLS settings) "
                             "need LORAPLANE_DATABASE_URL")
        from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

        parts = urlsplit(self.database_url)
        query = dict(parse_qsl(parts.query, keep_blank_values=True))
        for name, value in wanted.items():
            if name in query and query[name] != value:
                raise ValueError(f"LORAPLANE_DATABASE_URL says {name}={query[name]}, "
                                 f"LORAPLANE_DATABASE_{name.upper()} says {value}")
            query[name] = value
        object.__setattr__(self, "database_url", urlunsplit(parts._replace(
            query=urlencode(query, safe="/:"))))
        return self

    @model_validator(mode="after")
    def _merge_needs_dense(self) -> Settings:
        """Merged mode folds adapters into dense base weights; an int8 base has none."""
        if self.worker_merge is not None and self.worker_weights != "dense":
            raise ValueError(f"LORAPLANE_WORKER_MERGE needs dense base weights, not "
                             f"LORAPLANE_WORKER_WEIGHTS={self.worker_weights}")
        return self

    @field_validator("allowed_dtypes")
    @classmethod
    def _engine_dtypes(cls, value: list[str]) -> list[str]:
        """Only dtypes a worker's pool holds: accepting another would publish adapters
        that no worker loads."""
        other = sorted(set(value) - set(ENGINE_DTYPES))
        if other:
            raise ValueError(f"{other} are not adapter dtypes a worker holds "
                             f"({', '.join(ENGINE_DTYPES)})")
        return value

    @property
    def registry_urls(self) -> list[str]:
        """Every registry a client may use, in the order given (the first is preferred)."""
        if not self.registry_url:
            scheme = "https" if self.tls_ca_file is not None else "http"
            return [f"{scheme}://{self.registry_host}:{self.registry_port}"]
        return [u.strip().rstrip("/") for u in self.registry_url.split(",") if u.strip()]

    @property
    def registry_base_url(self) -> str:
        return self.registry_urls[0]

    @property
    def router_targets(self) -> list[str]:
        """Every router address (host:port) a client may dial, in order."""
        if self.router_addresses:
            return [a.strip() for a in self.router_addresses.split(",") if a.strip()]
        host = self.router_host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        return [f"{host}:{self.router_port}"]

    @property
    def blob_root(self) -> Path:
        return self.blob_dir or self.state_dir / "blobs"

    @property
    def worker_name(self) -> str:
        import socket

        return self.worker_id or f"worker-{socket.gethostname()}-{self.worker_port}"

    @property
    def worker_advertised(self) -> str:
        return self.worker_address or f"{self.worker_host}:{self.worker_port}"

    @property
    def adapter_cache_dir(self) -> Path:
        return self.state_dir / "adapter-cache"

    @property
    def snapshot_root(self) -> Path:
        return self.snapshot_dir or self.state_dir / "snapshots"

    @property
    def checkpoint_root(self) -> Path:
        return self.audit_checkpoint_dir or self.state_dir / "checkpoints"

    @property
    def topics(self) -> tuple[str, str, str]:
        """Every topic a full reader folds, in a fixed order: the adapter log, the worker
        log and the liveness topic."""
        return (self.adapter_events_topic, self.worker_events_topic, self.liveness_topic)
