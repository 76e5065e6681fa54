"""Generated kernel source, imported from real files.

``triton.jit`` reads the source of what it compiles (``inspect.getsource``), which ``exec`` of a
string does not give on every Triton version (3.6 and 3.9, compiled and interpreted): generated
source is written to ``<cache_dir>/kopt_<prefix>_<sha256[:16]>.py`` (atomically, so concurrent
processes never read half a file) and imported from there, one module per distinct source per
process. Only source that kopt generated from its own templates is ever written here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

_MODULES: dict[str, ModuleType] = {}
_LOCK = threading.Lock()


def default_cache_dir() -> Path:
    """``~/.cache/kopt/generated``, or a per-user folder under the temp dir if home is
    read-only."""
    home = Path.home() / ".cache" / "kopt" / "generated"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    tmp = Path(tempfile.gettempdir()) / f"kopt-{uid}" / "generated"
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def load_generated_module(source: str, prefix: str, cache_dir: Path | None = None) -> ModuleType:
    """Import generated Triton source. ``triton.jit`` needs the source of what it compiles
    (``inspect.getsource``), which ``exec`` of a string does not give on every Triton version:
    the text goes to ``<cache_dir>/kopt_<prefix>_<sha256[:16]>.py`` (written atomically, so
    concurrent processes never read half a file) and is imported from there. One module per
    distinct source per process."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:16]
    name = f"kopt_{prefix}_{digest}"
    with _LOCK:
        if name in _MODULES:
            return _MODULES[name]
        folder = cache_dir or default_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.py"
        if not path.exists() or path.read_text() != source:
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        _MODULES[name] = module
        return module
