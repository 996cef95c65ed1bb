"""The tables, shared by every SQL backend (SQLAlchemy Core keeps SQLite and PostgreSQL on one schema).

Times are epoch seconds in floating point columns: cheap to compare in SQL on both backends.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()
# Python None is SQL NULL (not the JSON text 'null'), so `IS NULL` finds tasks without overrides
Json = sa.JSON(none_as_null=True)

tasks = sa.Table(
    "tasks",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("capability", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("gpu_mode", sa.String(16), nullable=False),
    sa.Column("gpu_wait_s", sa.Float, nullable=False),
    sa.Column("resources", Json),  # the task's own overrides, as given
    sa.Column("priority", sa.Integer, nullable=False, default=0),
    sa.Column("timeout_s", sa.Float),
    sa.Column("placement_timeout_s", sa.Float, nullable=False),
    sa.Column("max_retries", sa.Integer, nullable=False),
    sa.Column("idempotency_key", sa.String(200)),
    sa.Column("labels", Json),
    sa.Column("attempts", sa.Integer, nullable=False, default=0),
    sa.Column("worker_id", sa.String(40)),
    sa.Column("device", sa.String(8)),
    sa.Column("gpus", Json),
    sa.Column("gpu_model", sa.String(128)),
    sa.Column("alloc", Json),  # resources held while leased/running: cpu, memory
    sa.Column("routing", Json),
    sa.Column("isolation", Json),  # what held the last attempt's processes (containment, sandbox)
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("queued_at", sa.Float),
    sa.Column("leased_at", sa.Float),
    sa.Column("started_at", sa.Float),
    sa.Column("finished_at", sa.Float),
    sa.Column("run_s", sa.Float),
    sa.Column("cost_usd", sa.Float),
    sa.Column("unservable_since", sa.Float),
    sa.Column("pipeline_run_id", sa.String(40)),
    sa.Column("cold_start_s", sa.Float),  # process start and setup this task paid for
    sa.Column("usage", Json),  # peak_rss_bytes, peak_gpu_memory_bytes, batch_size
    # last, largest last: SQLite stores a row's columns in this order, and a value too large for the row's page
    # goes on a chain of overflow pages, which a read of any column stored after it walks. So the lease's read of
    # what a worker holds (every column but the input) never touches a 100 kB input's pages (migration 10).
    sa.Column("error", Json),
    sa.Column("output", Json),
    sa.Column("input", Json),
    sa.Index("ix_tasks_queue", "state", "capability", "priority", "created_at"),
    sa.Index("ix_tasks_worker", "worker_id", "state"),
    sa.Index("ix_tasks_tenant", "tenant", "id"),
    sa.Index("ux_tasks_idempotency", "tenant", "idempotency_key", unique=True),
)

# the lease order: served by an index, so a deep queue is not sorted on every lease
queue_order = sa.Index(
    "ix_tasks_queue_order", tasks.c.state, tasks.c.priority.desc(), tasks.c.created_at, tasks.c.id
)

# the lease order within one tenant: a worker serving one tenant, and round-robin across tenants, seek here
queue_by_tenant = sa.Index(
    "ix_tasks_queue_tenant",
    tasks.c.state,
    tasks.c.tenant,
    tasks.c.priority.desc(),
    tasks.c.created_at,
    tasks.c.id,
)

# a run's tasks, found from the run
pipeline_run_index = sa.Index("ix_tasks_pipeline_run", tasks.c.pipeline_run_id)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("host", sa.String(256), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("variants", Json, nullable=False),
    sa.Column("cpu", sa.Float, nullable=False),
    sa.Column("memory_bytes", sa.BigInteger, nullable=False),
    sa.Column("gpus", Json, nullable=False),
    sa.Column("strategy", sa.String(16), nullable=False),
    sa.Column("registered_at", sa.Float, nullable=False),
    sa.Column("last_heartbeat", sa.Float, nullable=False),
    sa.Column("heartbeat_s", sa.Float, nullable=False),
    sa.Column("metrics", Json),
    sa.Column("quarantined", Json),
)

# who a worker is: the hash of the secret it got at registration, the token that registered it, and the
# tenant it serves ("*": every tenant, a shared pool). Written once per worker id, never changed.
worker_credentials = sa.Table(
    "worker_credentials",
    metadata,
    sa.Column("worker_id", sa.String(40), primary_key=True),
    sa.Column("secret_hash", sa.String(64), nullable=False),
    sa.Column("token_id", sa.String(40), nullable=False),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)

tokens = sa.Table(
    "tokens",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("hash", sa.String(64), nullable=False, unique=True),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
)

events = sa.Table(
    "events",
    metadata,
    sa.Column("task_id", sa.String(40), primary_key=True),
    sa.Column("seq", sa.Integer, primary_key=True),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("body", Json, nullable=False),
)

audit = sa.Table(
    "audit",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("ts", sa.Float, nullable=False),
    sa.Column("kind", sa.String(32), nullable=False),
    sa.Column("tenant", sa.String(64)),
    sa.Column("body", Json, nullable=False),
)
audit_by_tenant = sa.Index("ix_audit_tenant", audit.c.tenant, audit.c.id)

# every capability a worker ever registered: a submit of any other is refused at once (a typo), while a pool
# scaled to zero keeps its name known
capabilities = sa.Table(
    "capabilities",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("first_seen_at", sa.Float, nullable=False),
)

# files for task inputs and outputs (store/files.py): the bytes live in the storage directory, named by id
files = sa.Table(
    "files",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("name", sa.String(255)),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("sha256", sa.String(64), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float),
    sa.Column("task_id", sa.String(40)),  # the task whose handler wrote it, for outputs
    sa.Index("ix_files_expiry", "expires_at"),
)

# one row per periodic sweep: which replica ran it last, and when (store/replicas.py: one replica per round)
sweeps = sa.Table(
    "sweeps",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("holder", sa.String(64), nullable=False),
    sa.Column("swept_at", sa.Float, nullable=False),
)

# a pipeline run: its stages as they were when it started (a config change never alters a run in flight), and
# the task of each stage started so far, in order
pipeline_runs = sa.Table(
    "pipeline_runs",
    metadata,
    sa.Column("id", sa.String(40), primary_key=True),
    sa.Column("tenant", sa.String(64), nullable=False),
    sa.Column("pipeline", sa.String(64), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("input", Json),
    sa.Column("gpu_mode", sa.String(16)),
    sa.Column("stages", Json, nullable=False),
    sa.Column("task_ids", Json, nullable=False),
    sa.Column("output", Json),
    sa.Column("error", Json),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("finished_at", sa.Float),
    sa.Index("ix_pipeline_runs_state", "state"),
    sa.Index("ix_pipeline_runs_tenant", "tenant", "id"),
)

# what finished tasks taught about each (capability, device class, GPU model): `auto` routes on it
profiles = sa.Table(
    "profiles",
    metadata,
    sa.Column("capability", sa.String(64), primary_key=True),
    sa.Column("device", sa.String(8), primary_key=True),
    sa.Column("gpu_model", sa.String(128), primary_key=True),  # "" for the CPU
    sa.Column("samples", sa.Integer, nullable=False),
    sa.Column("run_s", sa.Float, nullable=False),  # moving average
    sa.Column("cold_start_s", sa.Float),  # moving average over tasks that paid one
    sa.Column("peak_gpu_memory_bytes", sa.BigInteger),
    sa.Column("peak_rss_bytes", sa.BigInteger),
    sa.Column("updated_at", sa.Float, nullable=False),
)

schema_migrations = sa.Table(
    "schema_migrations",
    metadata,
    sa.Column("version", sa.Integer, primary_key=True),
    sa.Column("name", sa.String(128), nullable=False),
    sa.Column("applied_at", sa.Float, nullable=False),
)
