"""The knowledge base: one SQLite file of kernels, measurements, verdicts and lessons.

    kb = KnowledgeBase.open()            # ~/.cache/kopt/kb.sqlite (or $KOPT_CACHE_DIR/kb.sqlite)
    kb.record_kernel_config("gemm_fp8", source_hash, {"BLOCK_M": 128, ...}, bucket, dtype, device)
    kb.best_config("gemm_fp8", bucket, device)          # KernelRecord or None
    kb.record_verdict("fp8", "dead_end", workload="W1", device="NVIDIA H200",
                      cause="slower under CUDA graphs", tags=("slower-under-cuda-graphs",))
    kb.dead_end("fp8", "NVIDIA H200", "W1")             # the reason, or None

Concurrency: WAL journal, a busy timeout, every write one ``BEGIN IMMEDIATE`` transaction, so
processes tuning at once queue for the write lock instead of corrupting the file or failing.
Safety: a file that is corrupt, not a kopt knowledge base, or of a newer schema raises
:class:`KnowledgeBaseError` (``safe_open`` warns and returns None) and is never written to.
Stored configs are integers validated against their template's allowlist on every read
(:mod:`kopt.kb.configs`); the knowledge base holds no source code and executes nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from kopt.errors import KoptError
from kopt.kb import schema
from kopt.kb.configs import ConfigRejected, config_text, format_config, validate_config

log = logging.getLogger("kopt")

SQLITE_MAGIC = b"SQLite format 3\x00"
VERDICTS = ("accepted", "rejected", "dead_end")
ORIGINS = ("pipeline", "human", "ablation")
MEASUREMENT_KINDS = ("micro", "e2e")
# Root-cause tags: the reasons a rewrite loses, as data the next run can filter on.
TAGS = ("numerics", "slower", "slower-under-cuda-graphs", "shape-regime", "compile-failure",
        "memory", "no-gain")
ANY = "*"  # a verdict's workload or device that applies to all of them

VerdictKind = Literal["accepted", "rejected", "dead_end"]


class KnowledgeBaseError(KoptError):
    """The knowledge base file cannot be used (corrupt, not a kopt knowledge base, a newer
    schema, locked for too long, unwritable), or a record is invalid. The message says which
    file and what to do; the file itself is left as it was."""


class InvalidRecord(KnowledgeBaseError, ValueError):
    """A record or query kopt refuses: unknown tag, verdict, origin or entry id, a config
    outside its template's allowlist, a time that is not one."""


class KnowledgeBaseWarning(UserWarning):
    """kopt runs on without its knowledge base (the message says why)."""


@dataclass(frozen=True)
class Versions:
    """The software a kernel config was tuned with: a config is reused only under the same."""

    torch: str
    triton: str

    @staticmethod
    def current() -> Versions:
        import torch

        try:
            import triton

            triton_version = triton.__version__
        except ImportError:
            triton_version = "none"
        return Versions(str(torch.__version__), triton_version)


@dataclass(frozen=True)
class KernelRecord:
    """A tuned kernel: kopt's template + the config that won for one shape bucket and device.
    ``config`` is None when the stored row failed validation (``invalid`` says why)."""

    id: int
    template: str
    source_hash: str
    config: dict[str, int] | None
    bucket: str
    dtype: str
    device: str
    versions: Versions
    created_at: float
    best_ms: float | None = None
    invalid: str | None = None

    @property
    def entry_id(self) -> str:
        return f"K{self.id}"


@dataclass(frozen=True)
class MeasurementRecord:
    """One timing: ``baseline_ms`` without the change (untuned config, unfused graph, model),
    ``candidate_ms`` with it; ``micro`` (one kernel) or ``e2e`` (the whole call)."""

    id: int
    kind: str
    workload: str
    device: str
    baseline_ms: float | None
    candidate_ms: float
    cuda_graphs: bool
    kernel_id: int | None
    rewrite: str | None
    note: str
    created_at: float

    @property
    def entry_id(self) -> str:
        return f"M{self.id}"

    @property
    def speedup(self) -> float | None:
        return self.baseline_ms / self.candidate_ms if self.baseline_ms else None


@dataclass(frozen=True)
class VerdictRecord:
    """What became of a rewrite on one workload (or regime) and device, and why."""

    id: int
    rewrite: str
    verdict: str
    workload: str
    regime: str | None
    device: str
    cause: str
    tags: tuple[str, ...]
    origin: str
    rewrite_uuid: str | None
    created_at: float

    @property
    def entry_id(self) -> str:
        return f"V{self.id}"


@dataclass(frozen=True)
class LessonRecord:
    id: int
    text: str
    tags: tuple[str, ...]
    rewrite: str | None
    device: str | None
    created_at: float

    @property
    def entry_id(self) -> str:
        return f"L{self.id}"


@dataclass(frozen=True)
class GraphRecord:
    """An optimized graph kept for a warm start (:mod:`kopt.warm`); its payload is read apart."""

    id: int
    key: str
    workload: str
    device: str
    kopt_build: str
    nodes: int
    bytes: int
    hits: int
    created_at: float
    used_at: float | None

    @property
    def entry_id(self) -> str:
        return f"G{self.id}"


Record = KernelRecord | MeasurementRecord | VerdictRecord | LessonRecord | GraphRecord


@dataclass(frozen=True)
class PruneResult:
    """What ``prune`` removed (or would remove, with ``dry_run``), by reason."""

    kernels_other_versions: int
    kernels_invalid: int
    older: dict[str, int]  # table -> rows older than the cutoff
    measurements_of_kernels: int
    dry_run: bool
    graphs_other_builds: int = 0  # optimized graphs of another kopt build

    @property
    def total(self) -> int:
        return (self.kernels_other_versions + self.kernels_invalid + sum(self.older.values())
                + self.measurements_of_kernels + self.graphs_other_builds)

    def format(self) -> str:
        verb = "would remove" if self.dry_run else "removed"
        parts = [f"{self.kernels_other_versions} kernel configs of other torch/triton versions",
                 f"{self.kernels_invalid} invalid kernel configs",
                 f"{self.measurements_of_kernels} measurements of those kernels",
                 f"{self.graphs_other_builds} optimized graphs of other kopt builds"]
        parts += [f"{n} {table} older than the cutoff" for table, n in self.older.items()]
        return f"prune {verb} {self.total} rows: " + ", ".join(parts)


@dataclass(frozen=True)
class MergeResult:
    """What ``merge`` copied from another knowledge base, and what it left out and why."""

    source: str
    added: dict[str, int]  # table -> rows added
    skipped: dict[str, int]  # reason -> rows left out

    def format(self) -> str:
        parts = [f"{n} {table}" for table, n in self.added.items()]
        text = f"merged {self.source}: added " + ", ".join(parts)
        if self.skipped:
            text += "; left out " + ", ".join(f"{n} {why}" for why, n in self.skipped.items())
        return text


def default_path() -> Path:
    """``$KOPT_CACHE_DIR/kb.sqlite``, else ``$XDG_CACHE_HOME/kopt/kb.sqlite``, else
    ``~/.cache/kopt/kb.sqlite``: where ``kopt`` keeps its knowledge base unless told."""
    if os.environ.get("KOPT_CACHE_DIR"):
        return Path(os.environ["KOPT_CACHE_DIR"]) / "kb.sqlite"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kopt" / "kb.sqlite"


@functools.lru_cache(maxsize=1)
def kopt_build() -> str:
    """``src-<hash>`` of kopt's source files (its version line among them): an edited kopt is
    another build, whose optimized graphs (:mod:`kopt.warm`) this one never reuses."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return f"src-{h.hexdigest()[:12]}"


def format_time(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


class KnowledgeBase:
    """One open knowledge base file; use :meth:`open` (or :func:`safe_open`)."""

    def __init__(self, path: Path, db: sqlite3.Connection) -> None:
        self.path = path
        self._db = db
        self._lock = threading.Lock()  # one connection, shared by the threads of a process

    # -- opening --------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path | None = None, *, timeout_s: float = 30.0) -> KnowledgeBase:
        """Open (creating it and its folder if missing) and migrate to the current schema.

        Raises :class:`KnowledgeBaseError` for a corrupt file, a file that is not a kopt
        knowledge base, or one written by a newer kopt; such a file is not modified."""
        p = Path(path) if path is not None else default_path()
        p = p.expanduser()
        advice = ("kopt leaves the file as it is; move it away, or pass --kb PATH to use "
                  "another file")
        if p.is_dir():
            raise KnowledgeBaseError(f"knowledge base {p} is a directory; {advice}")
        if p.exists() and p.stat().st_size > 0:
            with p.open("rb") as f:
                head = f.read(len(SQLITE_MAGIC))
            if head != SQLITE_MAGIC:
                raise KnowledgeBaseError(f"knowledge base {p} is corrupt: not an SQLite file "
                                         f"(header {head[:16]!r}); {advice}")
        else:
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise KnowledgeBaseError(f"cannot create the folder of knowledge base {p}: "
                                         f"{e}") from e
        try:
            db = sqlite3.connect(p, timeout=timeout_s, isolation_level=None,
                                 check_same_thread=False)
        except sqlite3.Error as e:
            raise KnowledgeBaseError(f"cannot open knowledge base {p}: {e}") from e
        try:
            # read-only checks first: nothing below writes until the file is known to be ours
            problems = [r[0] for r in db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise KnowledgeBaseError(f"knowledge base {p} is corrupt (SQLite quick_check: "
                                         f"{'; '.join(problems[:3])}); {advice}")
            version = schema.stored_version(db)
            if version is None:
                raise KnowledgeBaseError(f"{p} is an SQLite file but not a kopt knowledge "
                                         f"base (no kopt_schema table); {advice}")
            if version > schema.CURRENT:
                raise KnowledgeBaseError(
                    f"knowledge base {p} has schema version {version}, newer than this kopt "
                    f"understands (up to {schema.CURRENT}): it was written by a newer kopt. "
                    f"Upgrade kopt, or pass --kb PATH to use another file; {advice}")
            db.execute(f"PRAGMA busy_timeout = {int(timeout_s * 1000)}")
            _wal(db, timeout_s)
            db.execute("PRAGMA synchronous = NORMAL")  # WAL: durable at checkpoints, never torn
            db.execute("PRAGMA foreign_keys = ON")
            applied = schema.migrate(db, time.time())
        except KnowledgeBaseError:
            db.close()
            raise
        except sqlite3.Error as e:
            db.close()
            what = "is corrupt" if isinstance(e, sqlite3.DatabaseError) and (
                "not a database" in str(e) or "malformed" in str(e)) else "cannot be used"
            raise KnowledgeBaseError(f"knowledge base {p} {what}: {e}; {advice}") from e
        if applied:
            log.info("kopt: knowledge base %s: schema migrated to version %d", p, applied[-1])
        return cls(p, db)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> KnowledgeBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KnowledgeBase({str(self.path)!r})"

    def schema_version(self) -> int:
        with self._read() as db:
            return schema.stored_version(db) or 0

    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One write transaction: taken before any read (``BEGIN IMMEDIATE``), so two
        processes never both read, then both write; waits up to the busy timeout."""
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise KnowledgeBaseError(f"knowledge base {self.path}: cannot start a write: "
                                         f"{e}") from e
            try:
                yield self._db
                self._db.execute("COMMIT")
            except BaseException as e:
                with contextlib.suppress(sqlite3.Error):
                    self._db.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise KnowledgeBaseError(f"knowledge base {self.path}: write failed, "
                                             f"nothing written: {e}") from e
                raise

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                yield self._db
            except sqlite3.Error as e:
                raise KnowledgeBaseError(f"knowledge base {self.path}: read failed: {e}") from e

    # -- kernels --------------------------------------------------------------------------

    def record_kernel_config(self, template: str, source_hash: str, config: Mapping[str, int],
                             bucket: str, dtype: str, device: str,
                             versions: Versions | None = None) -> int:
        """Store a tuned config (validated like a read); returns its kernel id. The same
        config for the same key is stored once."""
        try:
            text = config_text(template, config)
        except ConfigRejected as e:
            raise InvalidRecord(f"refusing to store a {template} config: {e}") from e
        v = versions or Versions.current()
        key = (template, source_hash, bucket, dtype, device, v.torch, v.triton, text)
        with self._write() as db:
            db.execute("INSERT OR IGNORE INTO kernels (template, source_hash, bucket, dtype, "
                       "device, torch_version, triton_version, config, created_at) VALUES "
                       "(?, ?, ?, ?, ?, ?, ?, ?, ?)", (*key, time.time()))
            row = db.execute("SELECT id FROM kernels WHERE template = ? AND source_hash = ? "
                             "AND bucket = ? AND dtype = ? AND device = ? AND torch_version = ? "
                             "AND triton_version = ? AND config = ?", key).fetchone()
        return int(row[0])

    _KERNEL_COLUMNS = ("k.id, k.template, k.source_hash, k.config, k.bucket, k.dtype, k.device, "
                       "k.torch_version, k.triton_version, k.created_at, "
                       "(SELECT min(candidate_ms) FROM measurements m WHERE m.kernel_id = k.id "
                       "AND m.kind = 'micro') AS best_ms")

    @staticmethod
    def _kernel(row: Sequence[Any]) -> KernelRecord:
        (kid, template, source_hash, raw, bucket, dtype, device, tv, trv, created,
         best) = row
        try:
            config, invalid = validate_config(template, raw), None
        except ConfigRejected as e:
            config, invalid = None, str(e)
        return KernelRecord(kid, str(template), str(source_hash), config, str(bucket),
                            str(dtype), str(device), Versions(str(tv), str(trv)), created,
                            best, invalid)

    def best_config(self, template: str, bucket: str, device: str,
                    versions: Versions | None = None, *, source_hash: str | None = None,
                    dtype: str | None = None) -> KernelRecord | None:
        """The fastest valid config known for (template, shape bucket, device) under these
        torch/triton versions (and, if given, this generated source and dtype). Rows that fail
        validation are skipped with a warning, never used."""
        v = versions or Versions.current()
        sql = (f"SELECT {self._KERNEL_COLUMNS} FROM kernels k WHERE k.template = ? AND "
               "k.bucket = ? AND k.device = ? AND k.torch_version = ? AND k.triton_version = ?")
        args: list[Any] = [template, bucket, device, v.torch, v.triton]
        if source_hash is not None:
            sql += " AND k.source_hash = ?"
            args.append(source_hash)
        if dtype is not None:
            sql += " AND k.dtype = ?"
            args.append(dtype)
        sql += " ORDER BY best_ms IS NULL, best_ms, k.created_at DESC, k.id DESC"
        with self._read() as db:
            rows = db.execute(sql, args).fetchall()
        for row in rows:
            rec = self._kernel(row)
            if rec.config is not None:
                return rec
            log.warning("kopt: knowledge base %s: ignoring kernel config %s: %s", self.path,
                        rec.entry_id, rec.invalid)
        return None

    def kernels(self) -> list[KernelRecord]:
        with self._read() as db:
            rows = db.execute(f"SELECT {self._KERNEL_COLUMNS} FROM kernels k ORDER BY k.id")
            return [self._kernel(r) for r in rows.fetchall()]

    # -- measurements ---------------------------------------------------------------------

    def record_measurement(self, kind: str, workload: str, device: str,
                           baseline_ms: float | None, candidate_ms: float, *,
                           cuda_graphs: bool = False, kernel_id: int | None = None,
                           rewrite: str | None = None, note: str = "") -> int:
        if kind not in MEASUREMENT_KINDS:
            raise InvalidRecord(f"measurement kind {kind!r}: one of {MEASUREMENT_KINDS}")
        for name, ms in (("baseline_ms", baseline_ms), ("candidate_ms", candidate_ms)):
            if ms is not None and not (isinstance(ms, int | float) and 0 <= ms < float("inf")):
                raise InvalidRecord(f"{name} must be a finite time >= 0; got {ms!r}")
        with self._write() as db:
            cur = db.execute(
                "INSERT INTO measurements (kind, workload, device, baseline_ms, candidate_ms, "
                "cuda_graphs, kernel_id, rewrite, note, created_at) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (kind, workload, device, baseline_ms, candidate_ms, int(cuda_graphs), kernel_id,
                 rewrite, note, time.time()))
            return int(cur.lastrowid)

    def measurements(self) -> list[MeasurementRecord]:
        with self._read() as db:
            rows = db.execute("SELECT id, kind, workload, device, baseline_ms, candidate_ms, "
                              "cuda_graphs, kernel_id, rewrite, note, created_at FROM "
                              "measurements ORDER BY id").fetchall()
        return [MeasurementRecord(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7], r[8],
                                  r[9], r[10]) for r in rows]

    # -- verdicts -------------------------------------------------------------------------

    def record_verdict(self, rewrite: str, verdict: VerdictKind, *, workload: str, device: str,
                       cause: str = "", tags: Sequence[str] = (), regime: str | None = None,
                       origin: str = "pipeline", rewrite_uuid: str | None = None) -> int:
        """Record what became of ``rewrite`` on ``workload`` (``'*'``: all) and ``device``
        (``'*'``: all). A pipeline verdict identical to the latest one for the same scope is
        not stored again (its id is returned)."""
        if verdict not in VERDICTS:
            raise InvalidRecord(f"verdict {verdict!r}: one of {VERDICTS}")
        if origin not in ORIGINS:
            raise InvalidRecord(f"origin {origin!r}: one of {ORIGINS}")
        if verdict == "dead_end" and origin == "pipeline":
            raise InvalidRecord("a dead end is a judgement on measurements: recorded by a "
                                     "human or the ablation, not by the pipeline")
        bad = sorted(set(tags) - set(TAGS))
        if bad:
            raise InvalidRecord(f"unknown tags {bad}; tags: {', '.join(TAGS)}")
        tags = tuple(sorted(set(tags)))
        with self._write() as db:
            if origin == "pipeline":
                last = db.execute(
                    "SELECT id, verdict, cause, rewrite_uuid FROM verdicts WHERE rewrite = ? "
                    "AND workload = ? AND device = ? AND regime IS ? AND origin = 'pipeline' "
                    "ORDER BY created_at DESC, id DESC LIMIT 1",
                    (rewrite, workload, device, regime)).fetchone()
                if last is not None and tuple(last[1:]) == (verdict, cause, rewrite_uuid) and \
                        self._tags(db, "verdict", last[0]) == tags:
                    return int(last[0])
            cur = db.execute(
                "INSERT INTO verdicts (rewrite, workload, device, verdict, cause, regime, origin, "
                "rewrite_uuid, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rewrite, workload, device, verdict, cause, regime, origin, rewrite_uuid,
                 time.time()))
            vid = int(cur.lastrowid)
            db.executemany("INSERT INTO verdict_tags (verdict_id, tag) VALUES (?, ?)",
                           [(vid, t) for t in tags])
        return vid

    @staticmethod
    def _tags(db: sqlite3.Connection, kind: str, rid: int) -> tuple[str, ...]:
        rows = db.execute(f"SELECT tag FROM {kind}_tags WHERE {kind}_id = ? ORDER BY tag",
                          (rid,)).fetchall()
        return tuple(r[0] for r in rows)

    def _verdicts(self, where: str = "", args: Sequence[Any] = ()) -> list[VerdictRecord]:
        with self._read() as db:
            rows = db.execute("SELECT id, rewrite, verdict, workload, regime, device, cause, "
                              "origin, rewrite_uuid, created_at FROM verdicts " + where, args)
            return [VerdictRecord(r[0], r[1], r[2], r[3], r[4], r[5], r[6],
                                  self._tags(db, "verdict", r[0]), r[7], r[8], r[9])
                    for r in rows.fetchall()]

    def verdicts(self) -> list[VerdictRecord]:
        return self._verdicts("ORDER BY id")

    def verdicts_for(self, rewrite: str, device: str, workload: str,
                     regime: str | None = None) -> list[VerdictRecord]:
        """Verdicts on ``rewrite`` that apply to this device and workload (or regime), newest
        first: those for this device or every device, for this workload, every workload, or
        the named regime."""
        return self._verdicts(
            "WHERE rewrite = ? AND device IN (?, ?) AND (workload IN (?, ?) OR "
            "(regime IS NOT NULL AND regime = ?)) ORDER BY created_at DESC, id DESC",
            (rewrite, device, ANY, workload, ANY, regime))

    def dead_end(self, rewrite: str, device: str, workload: str, regime: str | None = None,
                 rewrite_uuid: str | None = None, *,
                 cuda_graphs: bool = False) -> VerdictRecord | None:
        """The dead-end verdict that rules ``rewrite`` out here, if any. The newest verdict of
        a human or the ablation decides (pipeline verdicts judge numerics only, so they never
        lift a dead end); a dead end recorded for another version of the pass (``rewrite_uuid``
        differs) no longer applies, nor, unless the run replays from CUDA graphs
        (``cuda_graphs``), one whose only cause is being slower under CUDA graphs."""
        for v in self.verdicts_for(rewrite, device, workload, regime):
            if v.origin == "pipeline":
                continue
            if v.tags == ("slower-under-cuda-graphs",) and not cuda_graphs:
                continue
            if v.verdict != "dead_end":
                return None
            if v.rewrite_uuid is None or rewrite_uuid is None or v.rewrite_uuid == rewrite_uuid:
                return v
        return None

    # -- lessons --------------------------------------------------------------------------

    def add_lesson(self, text: str, tags: Sequence[str] = (), rewrite: str | None = None,
                   device: str | None = None) -> int:
        if not text.strip():
            raise InvalidRecord("a lesson needs text")
        bad = sorted(set(tags) - set(TAGS))
        if bad:
            raise InvalidRecord(f"unknown tags {bad}; tags: {', '.join(TAGS)}")
        with self._write() as db:
            cur = db.execute("INSERT INTO lessons (text, rewrite, device, created_at) VALUES "
                             "(?, ?, ?, ?)", (text.strip(), rewrite, device, time.time()))
            lid = int(cur.lastrowid)
            db.executemany("INSERT INTO lesson_tags (lesson_id, tag) VALUES (?, ?)",
                           [(lid, t) for t in sorted(set(tags))])
        return lid

    def lessons(self) -> list[LessonRecord]:
        with self._read() as db:
            rows = db.execute("SELECT id, text, rewrite, device, created_at FROM lessons "
                              "ORDER BY id").fetchall()
            return [LessonRecord(r[0], r[1], self._tags(db, "lesson", r[0]), r[2], r[3], r[4])
                    for r in rows]

    # -- optimized graphs (kopt.warm) -----------------------------------------------------

    _GRAPH_COLUMNS = ("id, key, workload, device, kopt_build, nodes, bytes, hits, created_at, "
                      "used_at")

    def record_graph(self, key: str, workload: str, device: str, kopt_build: str, nodes: int,
                     size: int, payload: bytes) -> int:
        """Keep ``payload`` under ``key``, replacing an entry of the same key."""
        with self._write() as db:
            db.execute("DELETE FROM graphs WHERE key = ?", (key,))
            return db.execute(
                "INSERT INTO graphs (key, workload, device, kopt_build, nodes, bytes, payload, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (key, workload, device, kopt_build, nodes, size, payload, time.time()),
            ).lastrowid

    def graph(self, key: str) -> tuple[GraphRecord, bytes] | None:
        with self._read() as db:
            row = db.execute(f"SELECT {self._GRAPH_COLUMNS}, payload FROM graphs WHERE key = ?",
                             (key,)).fetchone()
        return None if row is None else (GraphRecord(*row[:-1]), bytes(row[-1]))

    def graphs(self) -> list[GraphRecord]:
        with self._read() as db:
            return [GraphRecord(*r) for r in db.execute(
                f"SELECT {self._GRAPH_COLUMNS} FROM graphs ORDER BY id")]

    def graph_used(self, gid: int) -> None:
        with self._write() as db:
            db.execute("UPDATE graphs SET hits = hits + 1, used_at = ? WHERE id = ?",
                       (time.time(), gid))

    def drop_graph(self, gid: int) -> None:
        with self._write() as db:
            db.execute("DELETE FROM graphs WHERE id = ?", (gid,))

    # -- listing, export, pruning ---------------------------------------------------------

    def entries(self) -> list[Record]:
        return [*self.kernels(), *self.measurements(), *self.verdicts(), *self.lessons(),
                *self.graphs()]

    def get(self, entry_id: str) -> Record:
        """An entry by its listed id: ``K12`` kernel, ``M3`` measurement, ``V7`` verdict,
        ``L1`` lesson, ``G2`` optimized graph."""
        kinds = {"K": self.kernels, "M": self.measurements, "V": self.verdicts,
                 "L": self.lessons, "G": self.graphs}
        prefix, number = entry_id[:1].upper(), entry_id[1:]
        if prefix not in kinds or not number.isdigit():
            raise InvalidRecord(f"entry id {entry_id!r}: K<n> (kernel), M<n> "
                                "(measurement), V<n> (verdict), L<n> (lesson) or G<n> "
                                "(optimized graph)")
        for rec in kinds[prefix]():
            if rec.id == int(number):
                return rec
        raise InvalidRecord(f"no entry {entry_id} in {self.path}")

    def show(self, entry_id: str) -> str:
        rec = self.get(entry_id)
        lines = [f"{rec.entry_id}: {describe(rec)}"]
        for name, value in _as_dict(rec).items():
            lines.append(f"  {name}: {value}")
        if isinstance(rec, KernelRecord):
            for m in self.measurements():
                if m.kernel_id == rec.id:
                    lines.append(f"  measured {m.entry_id}: {describe(m)}")
        return "\n".join(lines)

    def export(self, fmt: Literal["md", "json"] = "md") -> str:
        """Everything in the file as Markdown tables or JSON (invalid configs as their reason,
        never their stored text)."""
        kernels, measurements = self.kernels(), self.measurements()
        verdicts, lessons, graphs = self.verdicts(), self.lessons(), self.graphs()
        if fmt == "json":
            doc = {"kb": str(self.path), "schema_version": self.schema_version(),
                   "kernels": [_as_dict(k) for k in kernels],
                   "measurements": [_as_dict(m) for m in measurements],
                   "verdicts": [_as_dict(v) for v in verdicts],
                   "lessons": [_as_dict(x) for x in lessons],
                   "graphs": [_as_dict(g) for g in graphs]}
            return json.dumps(doc, indent=2) + "\n"
        if fmt != "md":
            raise InvalidRecord(f"export format {fmt!r}: md or json")
        out = ["# kopt knowledge base", "",
               f"`{self.path}`, schema version {self.schema_version()}.", ""]

        def table(title: str, head: Sequence[str], rows: list[Sequence[object]]) -> None:
            out.extend([f"## {title} ({len(rows)})", ""])
            if not rows:
                out.extend(["none", ""])
                return
            out.append("| " + " | ".join(head) + " |")
            out.append("|" + "---|" * len(head))
            for r in rows:
                out.append("| " + " | ".join(_md(c) for c in r) + " |")
            out.append("")

        table("Verdicts", ("id", "rewrite", "verdict", "workload", "regime", "device", "cause",
                           "tags", "by", "when"),
              [(v.entry_id, v.rewrite, v.verdict.replace("_", " "), v.workload, v.regime or "",
                v.device, v.cause, ", ".join(v.tags), v.origin, format_time(v.created_at))
               for v in verdicts])
        table("Kernels", ("id", "template", "bucket", "dtype", "device", "config", "best ms",
                          "torch / triton"),
              [(k.entry_id, k.template, k.bucket, k.dtype, k.device,
                format_config(k.config) if k.config else f"INVALID: {k.invalid}",
                "" if k.best_ms is None else f"{k.best_ms:.4f}",
                f"{k.versions.torch} / {k.versions.triton}") for k in kernels])
        table("Measurements", ("id", "kind", "workload", "device", "baseline ms",
                               "candidate ms", "speedup", "CUDA graphs", "kernel / rewrite"),
              [(m.entry_id, m.kind, m.workload, m.device,
                "" if m.baseline_ms is None else f"{m.baseline_ms:.4f}",
                f"{m.candidate_ms:.4f}", "" if m.speedup is None else f"{m.speedup:.3f}x",
                "on" if m.cuda_graphs else "off",
                f"K{m.kernel_id}" if m.kernel_id else m.rewrite or "") for m in measurements])
        table("Lessons", ("id", "lesson", "rewrite", "device", "tags"),
              [(x.entry_id, x.text, x.rewrite or "", x.device or "", ", ".join(x.tags))
               for x in lessons])
        table("Optimized graphs (warm start)", ("id", "workload", "device", "nodes", "MiB",
                                                "kopt build", "warm starts", "recorded"),
              [(g.entry_id, g.workload, g.device, g.nodes, f"{g.bytes / 2**20:.2f}",
                g.kopt_build, g.hits, format_time(g.created_at)) for g in graphs])
        return "\n".join(out)

    def prune(self, older_than_days: float | None = None, *, other_versions: bool = True,
              dry_run: bool = False, versions: Versions | None = None) -> PruneResult:
        """Remove what this kopt can no longer use: kernel configs of other torch/triton
        versions and optimized graphs of other kopt builds (``other_versions``), kernel rows
        that fail validation, and, with ``older_than_days``, kernels, measurements and
        verdicts older than that, and optimized graphs not used since (lessons are kept).
        Measurements of removed kernels go with them. ``dry_run``: count only."""
        v = versions or Versions.current()
        drop: set[int] = set()
        other = invalid = 0
        for k in self.kernels():
            if other_versions and k.versions != v:
                other += 1
                drop.add(k.id)
            elif k.config is None:
                invalid += 1
                drop.add(k.id)
        cutoff = time.time() - older_than_days * 86400 if older_than_days is not None else None
        older: dict[str, int] = {}
        with self._write() as db:
            if cutoff is not None:
                old = {r[0] for r in db.execute("SELECT id FROM kernels WHERE created_at < ?",
                                                (cutoff,))}
                older["kernels"] = len(old - drop)
                drop |= old
            ids = json.dumps(sorted(drop))  # one parameter, however many ids
            in_drop = "kernel_id IN (SELECT value FROM json_each(?))"
            of_kernels = db.execute(f"SELECT count(*) FROM measurements WHERE {in_drop}",
                                    (ids,)).fetchone()[0]
            if cutoff is not None:
                older["measurements"] = db.execute(
                    f"SELECT count(*) FROM measurements WHERE created_at < ? AND NOT "
                    f"coalesce({in_drop}, 0)", (cutoff, ids)).fetchone()[0]
                older["verdicts"] = db.execute("SELECT count(*) FROM verdicts WHERE "
                                               "created_at < ?", (cutoff,)).fetchone()[0]
            graphs = 0
            if other_versions:
                build = kopt_build()
                graphs = db.execute("SELECT count(*) FROM graphs WHERE kopt_build != ?",
                                    (build,)).fetchone()[0]
                if not dry_run:
                    db.execute("DELETE FROM graphs WHERE kopt_build != ?", (build,))
            if cutoff is not None:  # a graph counts from its last warm start
                unused = "coalesce(used_at, created_at) < ?"
                older["optimized graphs"] = db.execute(
                    f"SELECT count(*) FROM graphs WHERE {unused}", (cutoff,)).fetchone()[0]
                if not dry_run:
                    db.execute(f"DELETE FROM graphs WHERE {unused}", (cutoff,))
            if not dry_run:
                db.execute(f"DELETE FROM measurements WHERE {in_drop}", (ids,))
                db.execute("DELETE FROM kernels WHERE id IN (SELECT value FROM json_each(?))",
                           (ids,))
                if cutoff is not None:
                    db.execute("DELETE FROM measurements WHERE created_at < ?", (cutoff,))
                    db.execute("DELETE FROM verdicts WHERE created_at < ?", (cutoff,))
        return PruneResult(other, invalid, older, of_kernels, dry_run, graphs)


    def merge(self, other: KnowledgeBase) -> MergeResult:
        """Copy into this file every entry of ``other`` (a knowledge base of another machine,
        session or teammate) that it lacks, in one write transaction: kernel configs
        (validated like a read; rows that fail are skipped and counted, never copied),
        measurements (re-pointed at this file's ids of their kernels), verdicts with their
        tags, and lessons. An entry is a duplicate when every field, its time included,
        equals one already here: merging the same file twice adds nothing. Times are kept, so
        the newest verdict still decides a dead end. Optimized graphs are left out: they hold
        the graph of one kopt build and device, which the next run there records itself."""
        if other.path.resolve() == self.path.resolve():
            raise InvalidRecord(f"cannot merge knowledge base {self.path} into itself")
        with other._read() as src:
            kernels = src.execute("SELECT id, template, source_hash, bucket, dtype, device, "
                                  "torch_version, triton_version, config, created_at "
                                  "FROM kernels ORDER BY id").fetchall()
            measurements = src.execute(
                "SELECT kind, workload, device, baseline_ms, candidate_ms, cuda_graphs, "
                "kernel_id, rewrite, note, created_at FROM measurements ORDER BY id").fetchall()
            verdicts = [(r, other._tags(src, "verdict", r[0])) for r in src.execute(
                "SELECT id, rewrite, workload, device, verdict, cause, regime, origin, "
                "rewrite_uuid, created_at FROM verdicts ORDER BY id").fetchall()]
            lessons = [(r, other._tags(src, "lesson", r[0])) for r in src.execute(
                "SELECT id, text, rewrite, device, created_at FROM lessons ORDER BY id")
                .fetchall()]
            graphs = src.execute("SELECT count(*) FROM graphs").fetchone()[0] if (
                schema.stored_version(src) or 0) >= 4 else 0
        added = dict.fromkeys(("kernels", "measurements", "verdicts", "lessons"), 0)
        skipped: dict[str, int] = {}
        if graphs:
            skipped["optimized graphs (each machine records its own)"] = graphs

        def skip(why: str) -> None:
            skipped[why] = skipped.get(why, 0) + 1

        kernel_ids: dict[int, int] = {}
        with self._write() as db:
            for kid, template, *key, raw, created in kernels:
                try:
                    text = config_text(template, validate_config(template, raw))
                except ConfigRejected:
                    skip("kernel configs that fail validation")
                    continue
                cur = db.execute("INSERT OR IGNORE INTO kernels (template, source_hash, bucket, "
                                 "dtype, device, torch_version, triton_version, config, "
                                 "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                                 (template, *key, text, created))
                added["kernels"] += cur.rowcount
                kernel_ids[kid] = db.execute(
                    "SELECT id FROM kernels WHERE template = ? AND source_hash = ? AND "
                    "bucket = ? AND dtype = ? AND device = ? AND torch_version = ? AND "
                    "triton_version = ? AND config = ?", (template, *key, text)).fetchone()[0]
            for kind, *rest, kernel_id, rewrite, note, created in measurements:
                times = rest[2:4]
                if kind not in MEASUREMENT_KINDS or not all(
                        t is None or (isinstance(t, int | float) and 0 <= t < float("inf"))
                        for t in times) or times[1] is None:
                    skip("invalid measurements")
                    continue
                if kernel_id is not None:
                    if kernel_id not in kernel_ids:
                        skip("measurements of skipped kernels")
                        continue
                    kernel_id = kernel_ids[kernel_id]
                row = (kind, *rest, kernel_id, rewrite, note, created)
                if db.execute("SELECT 1 FROM measurements WHERE kind = ? AND workload = ? AND "
                              "device = ? AND baseline_ms IS ? AND candidate_ms = ? AND "
                              "cuda_graphs = ? AND kernel_id IS ? AND rewrite IS ? AND "
                              "note = ? AND created_at = ?", row).fetchone():
                    continue
                db.execute("INSERT INTO measurements (kind, workload, device, baseline_ms, "
                           "candidate_ms, cuda_graphs, kernel_id, rewrite, note, created_at) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
                added["measurements"] += 1
            for (_, *row), tags in verdicts:
                _, _, _, verdict, _, _, origin, _, _ = row  # the columns selected above
                if verdict not in VERDICTS or origin not in ORIGINS or set(tags) - set(TAGS) \
                        or (verdict == "dead_end" and origin == "pipeline"):
                    skip("invalid verdicts")
                    continue
                same = db.execute(
                    "SELECT id FROM verdicts WHERE rewrite = ? AND workload = ? AND device = ? "
                    "AND verdict = ? AND cause = ? AND regime IS ? AND origin = ? AND "
                    "rewrite_uuid IS ? AND created_at = ?", row).fetchall()
                if any(self._tags(db, "verdict", r[0]) == tags for r in same):
                    continue
                vid = db.execute("INSERT INTO verdicts (rewrite, workload, device, verdict, "
                                 "cause, regime, origin, rewrite_uuid, created_at) VALUES "
                                 "(?, ?, ?, ?, ?, ?, ?, ?, ?)", row).lastrowid
                db.executemany("INSERT INTO verdict_tags (verdict_id, tag) VALUES (?, ?)",
                               [(vid, t) for t in tags])
                added["verdicts"] += 1
            for (_, *row), tags in lessons:
                text, *_ = row
                if set(tags) - set(TAGS) or not str(text).strip():
                    skip("invalid lessons")
                    continue
                same = db.execute("SELECT id FROM lessons WHERE text = ? AND rewrite IS ? AND "
                                  "device IS ? AND created_at = ?", row).fetchall()
                if any(self._tags(db, "lesson", r[0]) == tags for r in same):
                    continue
                lid = db.execute("INSERT INTO lessons (text, rewrite, device, created_at) "
                                 "VALUES (?, ?, ?, ?)", row).lastrowid
                db.executemany("INSERT INTO lesson_tags (lesson_id, tag) VALUES (?, ?)",
                               [(lid, t) for t in tags])
                added["lessons"] += 1
        return MergeResult(str(other.path), added, skipped)


def _wal(db: sqlite3.Connection, timeout_s: float) -> None:
    """Switch to WAL. SQLite answers "database is locked" at once, without its busy handler,
    when another process is switching or creating the same file (two kopt runs starting
    together): retry with backoff until ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        try:
            db.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.2)


def safe_open(path: str | Path | None = None, *, timeout_s: float = 30.0) -> KnowledgeBase | None:
    """:meth:`KnowledgeBase.open`, or None with a :class:`KnowledgeBaseWarning` saying why when
    the file cannot be used: kopt then runs without it and leaves the file untouched."""
    try:
        return KnowledgeBase.open(path, timeout_s=timeout_s)
    except KnowledgeBaseError as e:
        warnings.warn(f"kopt runs without its knowledge base: {e}", KnowledgeBaseWarning,
                      stacklevel=2)
        return None


def _md(cell: object) -> str:
    return str(cell).replace("|", "\\|").replace("\n", " ")


def _as_dict(rec: Record) -> dict[str, Any]:
    d = asdict(rec)
    d = {"id": rec.entry_id, **{k: v for k, v in d.items() if k != "id"}}
    if isinstance(rec, KernelRecord):
        d["versions"] = {"torch": rec.versions.torch, "triton": rec.versions.triton}
    for key in ("created_at", "used_at"):
        if d.get(key) is not None:
            d[key] = format_time(d[key])
    if isinstance(d.get("tags"), tuple):
        d["tags"] = list(d["tags"])
    return d


def describe(rec: Record) -> str:
    """One line per entry, as ``kopt kb list`` prints it."""
    if isinstance(rec, KernelRecord):
        cfg = format_config(rec.config) if rec.config else f"INVALID ({rec.invalid})"
        best = f", best {rec.best_ms:.4f} ms" if rec.best_ms is not None else ""
        return (f"kernel {rec.template} [{rec.bucket}] {rec.dtype} on {rec.device}: {cfg}{best} "
                f"(torch {rec.versions.torch}, triton {rec.versions.triton})")
    if isinstance(rec, MeasurementRecord):
        base = f"{rec.baseline_ms:.4f} -> " if rec.baseline_ms is not None else ""
        speed = f" ({rec.speedup:.3f}x)" if rec.speedup is not None else ""
        what = f"K{rec.kernel_id}" if rec.kernel_id else rec.rewrite or "model"
        return (f"{rec.kind} {what} on {rec.workload} @ {rec.device}: {base}"
                f"{rec.candidate_ms:.4f} ms{speed}, CUDA graphs "
                f"{'on' if rec.cuda_graphs else 'off'}" + (f"; {rec.note}" if rec.note else ""))
    if isinstance(rec, GraphRecord):
        used = f", last used {format_time(rec.used_at)}" if rec.used_at else ""
        return (f"optimized graph of {rec.workload} @ {rec.device}: {rec.nodes} nodes, "
                f"{rec.bytes / 2**20:.2f} MiB, kopt {rec.kopt_build}; {rec.hits} warm starts"
                f"{used}")
    if isinstance(rec, VerdictRecord):
        scope = rec.workload + (f" / regime {rec.regime}" if rec.regime else "")
        tags = f" [{', '.join(rec.tags)}]" if rec.tags else ""
        return (f"verdict {rec.rewrite}: {rec.verdict.replace('_', ' ')} on {scope} @ "
                f"{rec.device} by {rec.origin}: {rec.cause or '-'}{tags}")
    tags = f" [{', '.join(rec.tags)}]" if rec.tags else ""
    about = ", ".join(x for x in (rec.rewrite, rec.device) if x)
    return f"lesson{f' ({about})' if about else ''}: {rec.text}{tags}"
