"""The knowledge base's schema: ordered migrations, each one transaction.

A file records every migration applied to it in ``kopt_schema``; opening it applies the ones it
lacks, in order, inside one ``BEGIN IMMEDIATE`` transaction (two processes opening a new file at
once: the second waits, then finds nothing left to do). A file whose version is newer than
:data:`CURRENT` is refused, never downgraded.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Migration:
    version: int
    description: str
    apply: Callable[[sqlite3.Connection], None]


def _v1(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE kopt_schema (
        version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied_at REAL NOT NULL)""")
    db.execute("""CREATE TABLE kernels (
        id INTEGER PRIMARY KEY,
        template TEXT NOT NULL,         -- kopt's template: gemm_fp8, gemm_bf16, rowwise
        source_hash TEXT NOT NULL,      -- hash of the source kopt generated (never the source)
        config TEXT NOT NULL,           -- JSON object of integers, see kopt/kb/configs.py
        bucket TEXT NOT NULL,           -- the shape bucket of the tuning key
        dtype TEXT NOT NULL,
        device TEXT NOT NULL,
        torch_version TEXT NOT NULL,
        triton_version TEXT NOT NULL,
        created_at REAL NOT NULL,
        UNIQUE (template, source_hash, bucket, dtype, device, torch_version, triton_version,
                config))""")
    db.execute("""CREATE TABLE measurements (
        id INTEGER PRIMARY KEY,
        kind TEXT NOT NULL CHECK (kind IN ('micro', 'e2e')),
        workload TEXT NOT NULL,
        device TEXT NOT NULL,
        baseline_ms REAL,
        candidate_ms REAL NOT NULL,
        kernel_id INTEGER REFERENCES kernels(id) ON DELETE CASCADE,
        rewrite TEXT,
        created_at REAL NOT NULL)""")
    db.execute("""CREATE TABLE verdicts (
        id INTEGER PRIMARY KEY,
        rewrite TEXT NOT NULL,
        workload TEXT NOT NULL,         -- a workload key, or '*' for every workload
        device TEXT NOT NULL,           -- a device name, or '*' for every device
        verdict TEXT NOT NULL CHECK (verdict IN ('accepted', 'rejected', 'dead_end')),
        cause TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL)""")


# v1 kept the root cause as text only; v2 derives tags from the words v1 causes used.
_V1_CAUSE_TAGS = (("verification", "numerics"), ("numerics", "numerics"),
                  ("cuda graph", "slower-under-cuda-graphs"), ("compile", "compile-failure"))


def _v2(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE measurements ADD COLUMN cuda_graphs INTEGER NOT NULL DEFAULT 0")
    db.execute("ALTER TABLE measurements ADD COLUMN note TEXT NOT NULL DEFAULT ''")
    db.execute("ALTER TABLE verdicts ADD COLUMN regime TEXT")  # a named shape regime, or NULL
    db.execute("ALTER TABLE verdicts ADD COLUMN origin TEXT NOT NULL DEFAULT 'human'")
    db.execute("ALTER TABLE verdicts ADD COLUMN rewrite_uuid TEXT")  # NULL: any version
    db.execute("""CREATE TABLE verdict_tags (
        verdict_id INTEGER NOT NULL REFERENCES verdicts(id) ON DELETE CASCADE,
        tag TEXT NOT NULL,
        PRIMARY KEY (verdict_id, tag))""")
    for words, tag in _V1_CAUSE_TAGS:
        db.execute("INSERT OR IGNORE INTO verdict_tags (verdict_id, tag) SELECT id, ? FROM "
                   "verdicts WHERE verdict != 'accepted' AND lower(cause) LIKE ?",
                   (tag, f"%{words}%"))


def _v3(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE lessons (
        id INTEGER PRIMARY KEY,
        text TEXT NOT NULL,
        rewrite TEXT,
        device TEXT,
        created_at REAL NOT NULL)""")
    db.execute("""CREATE TABLE lesson_tags (
        lesson_id INTEGER NOT NULL REFERENCES lessons(id) ON DELETE CASCADE,
        tag TEXT NOT NULL,
        PRIMARY KEY (lesson_id, tag))""")
    db.execute("CREATE INDEX kernels_lookup ON kernels "
               "(template, bucket, device, torch_version, triton_version)")
    db.execute("CREATE INDEX measurements_kernel ON measurements (kernel_id)")
    db.execute("CREATE INDEX verdicts_lookup ON verdicts (rewrite, device)")


def _v4(db: sqlite3.Connection) -> None:
    db.execute("""CREATE TABLE graphs (
        id INTEGER PRIMARY KEY AUTOINCREMENT,  -- an entry id (G<n>) never names two graphs
        key TEXT NOT NULL UNIQUE,       -- kopt.warm.key: model, inputs, device, pipeline, build
        workload TEXT NOT NULL,
        device TEXT NOT NULL,
        kopt_build TEXT NOT NULL,       -- src-<hash of kopt's source> (pruned when it changes)
        nodes INTEGER NOT NULL,         -- call nodes of the optimized graph
        bytes INTEGER NOT NULL,
        payload BLOB NOT NULL,          -- kopt.warm's stored form (no tensors but small ones)
        hits INTEGER NOT NULL DEFAULT 0,
        created_at REAL NOT NULL,
        used_at REAL)""")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "kernels, measurements, verdicts", _v1),
    Migration(2, "verdict tags, regime, origin and pass uuid; CUDA graphs flag and notes on "
                 "measurements", _v2),
    Migration(3, "lessons; lookup indexes", _v3),
    Migration(4, "optimized graphs for a warm start", _v4),
)
CURRENT = MIGRATIONS[-1].version


def stored_version(db: sqlite3.Connection) -> int | None:
    """The schema version of an open file: 0 for an empty one, None when it holds tables but
    no ``kopt_schema`` (not a kopt knowledge base)."""
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    if not tables:
        return 0
    if "kopt_schema" not in tables:
        return None
    row = db.execute("SELECT max(version) FROM kopt_schema").fetchone()
    return int(row[0] or 0)


def migrate(db: sqlite3.Connection, now: float, upto: int = CURRENT) -> list[int]:
    """Apply the migrations ``db`` lacks up to ``upto`` in one write transaction; returns the
    versions applied. ``db`` must be in autocommit mode (``isolation_level=None``)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        have = stored_version(db) or 0
        applied = []
        for m in MIGRATIONS:
            if have < m.version <= upto:
                m.apply(db)
                db.execute("INSERT INTO kopt_schema (version, description, applied_at) "
                           "VALUES (?, ?, ?)", (m.version, m.description, now))
                applied.append(m.version)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return applied
