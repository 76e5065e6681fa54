"""``kopt kb``: look at, export, prune and annotate the knowledge base.

    kopt kb list [--kind kernels|measurements|verdicts|lessons|graphs] [--kb PATH]
    kopt kb show ID                                   (K12, M3, V7, L1, G2: as list prints them)
    kopt kb export --format md|json [--out PATH]
    kopt kb prune [--older-than DAYS] [--keep-other-versions] [--dry-run]
    kopt kb merge OTHER.sqlite                        (copy in what another file has)
    kopt kb mark REWRITE dead_end --cause TEXT [--tag TAG] [--workload KEY] [--device NAME]
    kopt kb lesson TEXT [--tag TAG] [--rewrite NAME] [--device NAME]

Exit codes: 0 done, 1 the knowledge base cannot be used (the message says why; the file is left
as it is), 2 bad arguments (an unknown entry id, tag or verdict).

For ``kopt optimize``: :func:`add_optimize_arguments` adds ``--kb PATH``, ``--no-kb``,
``--retry`` and ``--workload NAME``; :func:`optimize_session` opens the knowledge base those
ask for (or runs without it, with a warning, if the file is unusable).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from kopt.kb.session import Session, using
from kopt.kb.store import (
    ANY,
    TAGS,
    VERDICTS,
    InvalidRecord,
    KnowledgeBase,
    KnowledgeBaseError,
    KnowledgeBaseWarning,
    default_path,
    describe,
    safe_open,
)

_KINDS = {"kernels": "K", "measurements": "M", "verdicts": "V", "lessons": "L", "graphs": "G"}


def _kb_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kb", metavar="PATH", default=None,
                   help=f"knowledge base file (default: {default_path()}; $KOPT_CACHE_DIR "
                        "moves it)")


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``kb`` and its subcommands to ``kopt``'s subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    _kb_option(common)
    kb = subparsers.add_parser("kb", help="the knowledge base of tuned kernels, measurements "
                               "and verdicts: list, show, export, prune, merge, mark, lesson")
    sub = kb.add_subparsers(dest="kb_command", required=True)
    ls = sub.add_parser("list", parents=[common], help="one line per entry, with its id")
    ls.add_argument("--kind", choices=sorted(_KINDS), action="append", default=[],
                    help="only these entries (repeatable; default: all)")
    show = sub.add_parser("show", parents=[common], help="one entry in full")
    show.add_argument("id", help="an id as list prints it: K12, M3, V7, L1, G2")
    ex = sub.add_parser("export", parents=[common], help="everything as Markdown or JSON")
    ex.add_argument("--format", choices=("md", "json"), default="md")
    ex.add_argument("--out", metavar="PATH", help="write here instead of stdout")
    pr = sub.add_parser("prune", parents=[common],
                        help="remove configs of other torch/triton versions, optimized graphs "
                             "of other kopt builds, invalid rows, and (--older-than) old "
                             "entries; lessons are kept")
    pr.add_argument("--older-than", type=float, metavar="DAYS",
                    help="also remove kernels, measurements and verdicts older than DAYS, "
                         "and optimized graphs unused that long")
    pr.add_argument("--keep-other-versions", action="store_true",
                    help="keep kernel configs tuned under other torch/triton versions")
    pr.add_argument("--dry-run", action="store_true", help="count, remove nothing")
    mg = sub.add_parser("merge", parents=[common],
                        help="copy in the entries another knowledge base has and this one "
                             "lacks (another machine's or run's)")
    mg.add_argument("other", help="the other knowledge base file")
    mk = sub.add_parser("mark", parents=[common],
                        help="record a verdict on a rewrite by hand (e.g. a dead end)")
    mk.add_argument("rewrite", help="the pass name, as the report prints it")
    mk.add_argument("verdict", choices=VERDICTS)
    mk.add_argument("--cause", default="", help="the root cause, in words")
    mk.add_argument("--tag", action="append", default=[], choices=TAGS,
                    help="root-cause tag (repeatable)")
    mk.add_argument("--workload", default=ANY,
                    help="workload key or name (default: every workload)")
    mk.add_argument("--regime", default=None, help="a named shape regime instead")
    mk.add_argument("--device", default=ANY, help="device name (default: every device)")
    mk.add_argument("--by", choices=("human", "ablation"), default="human")
    le = sub.add_parser("lesson", parents=[common], help="record a lesson learned")
    le.add_argument("text")
    le.add_argument("--tag", action="append", default=[], choices=TAGS)
    le.add_argument("--rewrite", default=None)
    le.add_argument("--device", default=None)
    return kb


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``kopt kb ...`` command; returns the exit code."""
    path = Path(args.kb).expanduser() if args.kb else default_path()
    cmd = args.kb_command
    problem = _argument_problem(args)
    if problem:
        print(f"kopt kb: error: {problem}", file=sys.stderr)
        return 2
    if cmd in ("list", "show", "export") and not path.exists():
        missing = f"no knowledge base at {path} yet (kopt optimize creates it)"
        if cmd == "show":
            print(f"kopt kb: error: no entry {args.id}: {missing}", file=sys.stderr)
            return 2
        print(missing, file=sys.stderr)
        return 0
    try:
        with KnowledgeBase.open(path) as kb:
            return _run(kb, args)
    except KnowledgeBaseError as e:
        print(f"kopt kb: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, InvalidRecord) else 1


def _argument_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, found before the file is opened; None if nothing."""
    from kopt.passes import PassConfig

    if args.kb_command == "prune" and args.older_than is not None and args.older_than < 0:
        return f"--older-than must be at least 0 days, got {args.older_than:g}"
    if args.kb_command == "mark" and args.rewrite not in PassConfig.pass_names():
        return (f"unknown rewrite {args.rewrite!r} (a verdict applies to a pass); valid: "
                f"{', '.join(PassConfig.pass_names())}")
    return None


def _run(kb: KnowledgeBase, args: argparse.Namespace) -> int:
    cmd = args.kb_command
    if cmd == "list":
        wanted = {_KINDS[k] for k in args.kind} or set(_KINDS.values())
        entries = [e for e in kb.entries() if e.entry_id[0] in wanted]
        for e in entries:
            print(f"{e.entry_id:<6} {describe(e)}")
        print(f"{len(entries)} entries in {kb.path}")
    elif cmd == "show":
        print(kb.show(args.id))
    elif cmd == "export":
        text = kb.export(args.format)
        if args.out:
            try:
                Path(args.out).expanduser().write_text(text)
            except OSError as e:
                print(f"kopt kb: error: --out {args.out}: cannot write: {e.strerror}",
                      file=sys.stderr)
                return 2
            print(f"exported to {args.out}")
        else:
            sys.stdout.write(text)
    elif cmd == "prune":
        result = kb.prune(args.older_than, other_versions=not args.keep_other_versions,
                          dry_run=args.dry_run)
        print(result.format())
    elif cmd == "merge":
        other = Path(args.other).expanduser()
        if not other.is_file():
            raise InvalidRecord(f"no knowledge base at {other}")
        with KnowledgeBase.open(other) as src:
            print(kb.merge(src).format())
    elif cmd == "mark":
        vid = kb.record_verdict(args.rewrite, args.verdict, workload=args.workload,
                                device=args.device, cause=args.cause, tags=args.tag,
                                regime=args.regime, origin=args.by)
        print(f"V{vid}: {describe(kb.get(f'V{vid}'))}")
    elif cmd == "lesson":
        lid = kb.add_lesson(args.text, args.tag, args.rewrite, args.device)
        print(f"L{lid}: {describe(kb.get(f'L{lid}'))}")
    return 0


# -- kopt optimize -------------------------------------------------------------------------

def add_optimize_arguments(p: argparse.ArgumentParser) -> None:
    """``--kb PATH``, ``--no-kb``, ``--retry``, ``--workload NAME`` for ``kopt optimize``."""
    _kb_option(p)
    p.add_argument("--no-kb", action="store_true",
                   help="neither read nor write the knowledge base")
    p.add_argument("--retry", action="store_true",
                   help="run passes the knowledge base records as dead ends here")
    p.add_argument("--workload", metavar="NAME", default=None,
                   help="file verdicts and measurements under NAME (default: a hash of the "
                        "captured graph and its input shapes)")


@contextlib.contextmanager
def optimize_session(args: argparse.Namespace) -> Iterator[Session | None]:
    """The knowledge-base scope of one ``kopt optimize``: None with ``--no-kb`` or when the
    file is unusable (a warning on stderr says why; kopt runs on without it)."""
    if getattr(args, "no_kb", False):
        yield None
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KnowledgeBaseWarning)
        kb = safe_open(args.kb)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    if kb is None:
        yield None
        return
    try:
        with using(kb, workload=getattr(args, "workload", None),
                   retry=getattr(args, "retry", False)) as session:
            yield session
    finally:
        kb.close()
