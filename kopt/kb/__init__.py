"""The knowledge base: kernels, configs, measurements and verdicts that make the next run start
ahead (SQLite, one file; see :mod:`kopt.kb.store`).

    kb = kopt.kb.safe_open()                 # None (and a warning) if the file is unusable
    with kopt.kb.using(kb, workload="W1") as session:
        opt = kopt.optimize(model, args)     # tuned configs reused, dead ends skipped
    print(session.summary())
"""

from kopt.kb.configs import TEMPLATES, ConfigRejected, validate_config
from kopt.kb.session import Session, active, device_name, using
from kopt.kb.store import (
    TAGS,
    InvalidRecord,
    KernelRecord,
    KnowledgeBase,
    KnowledgeBaseError,
    KnowledgeBaseWarning,
    LessonRecord,
    MeasurementRecord,
    MergeResult,
    PruneResult,
    VerdictRecord,
    Versions,
    default_path,
    safe_open,
)
from kopt.kb.verdicts import record_pass_results, skip_reason, workload_key

__all__ = [
    "TAGS",
    "TEMPLATES",
    "ConfigRejected",
    "InvalidRecord",
    "KernelRecord",
    "KnowledgeBase",
    "KnowledgeBaseError",
    "KnowledgeBaseWarning",
    "LessonRecord",
    "MeasurementRecord",
    "MergeResult",
    "PruneResult",
    "Session",
    "VerdictRecord",
    "Versions",
    "active",
    "default_path",
    "device_name",
    "record_pass_results",
    "safe_open",
    "skip_reason",
    "using",
    "validate_config",
    "workload_key",
]
