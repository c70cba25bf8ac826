"""Compiled kernels kept on disk, so that a new process does not compile them again.

A compiled configuration is exported as an object file (``export_to_c``) and loaded back
with ``cute.runtime.load_module(path, enable_tvm_ffi=True)``: a TVM-FFI function called
exactly as the freshly compiled one. An entry's name hashes everything its code depends on:
the cache's name, the configuration key, the sources of ``cute_kernels/``, ``layouts/`` and
``ops/``, and the DSL and TVM-FFI versions, so an entry is never stale, only unused.

Where: ``$CUTE_KERNELS_CACHE_DIR``, else ``$XDG_CACHE_HOME/cute_kernels``, else
``~/.cache/cute_kernels``. ``CUTE_KERNELS_CACHE=0`` turns it off. Processes share it (one
per GPU under torchrun): a lock file per entry lets one of them compile while the others
wait and then load, and entries appear by atomic rename. An entry that does not load
(truncated, foreign) is removed and compiled again; the cache never makes a call fail.
Only processes that can launch kernels (a CUDA device present) use it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pathlib
import tempfile
from importlib import metadata
from typing import Callable, Hashable, Optional

import torch

logger = logging.getLogger("cute_kernels")
_PACKAGES = ("cute_kernels", "layouts", "ops")  # whose sources the compiled code depends on


def cache_dir() -> Optional[pathlib.Path]:
    """The cache's folder, or None when the cache is off."""
    if os.environ.get("CUTE_KERNELS_CACHE", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    explicit = os.environ.get("CUTE_KERNELS_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "cute_kernels"


@functools.lru_cache(maxsize=None)
def code_version() -> str:
    """A hash of the kernel sources and the compiler's versions (read once a process)."""
    h = hashlib.sha256()
    root = pathlib.Path(__file__).resolve().parents[1]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    for dist in ("nvidia-cutlass-dsl", "apache-tvm-ffi"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            h.update(f"{dist}=={metadata.version(dist)}".encode())
    return h.hexdigest()


def stable_key(key: Hashable) -> Optional[str]:
    """The key's text, the same in every process; None where it holds an object whose text
    names a memory address (such a key is not kept on disk)."""
    text = repr(key)
    return None if " at 0x" in text else text


def entry_path(folder: pathlib.Path, name: str, key_text: str) -> pathlib.Path:
    digest = hashlib.sha256(f"{name}\0{key_text}\0{code_version()}".encode()).hexdigest()[:32]
    return folder / name / f"{digest}.o"


def _function_name(path: pathlib.Path) -> str:
    return "cute_kernels_" + path.stem  # a C identifier: the digest is hex


@contextlib.contextmanager
def _locked(path: pathlib.Path):
    """An exclusive lock on ``path``'s lock file (released when the process dies)."""
    import fcntl

    with open(path.with_suffix(".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(path: pathlib.Path) -> Optional[Callable]:
    """The function kept at ``path``; None (and the entry removed) where it does not load."""
    if not path.exists():
        return None
    import cutlass.cute as cute

    try:
        module = cute.runtime.load_module(str(path), enable_tvm_ffi=True)
        return getattr(module, _function_name(path))
    except Exception as e:  # a truncated or foreign file: compile again
        logger.warning("compiled-kernel cache: %s does not load (%s); compiling again", path, e)
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _store(path: pathlib.Path, compiled) -> None:
    """Export ``compiled`` to ``path`` by way of a temporary file and an atomic rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.stem, suffix=".o.part")
    os.close(fd)
    try:
        compiled.export_to_c(tmp, function_name=_function_name(path))
        os.replace(tmp, path)
    except Exception as e:  # a full disk, a read-only folder: the process keeps its compiled copy
        logger.warning("compiled-kernel cache: could not write %s (%s)", path, e)
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def usable() -> bool:
    """Whether this process keeps compiled kernels on disk: the cache is on and a CUDA
    device can run them (compile-only processes compile, as their tests mean them to)."""
    return cache_dir() is not None and torch.cuda.is_available()


def load_or_build(name: str, key: Hashable, build: Callable[[], Callable]) -> Callable:
    """The compiled function of ``name`` / ``key``: from the disk cache, else built (and kept)."""
    folder = cache_dir() if usable() else None
    key_text = stable_key(key) if folder is not None else None
    if key_text is None:
        return _build_logged(name, key, build)
    path = entry_path(folder, name, key_text)
    fn = _load(path)
    if fn is not None:
        return fn
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("compiled-kernel cache: cannot use %s (%s)", path.parent, e)
        return _build_logged(name, key, build)
    with _locked(path):
        fn = _load(path)  # another process may have compiled it while this one waited
        if fn is not None:
            return fn
        compiled = _build_logged(name, key, build)
        _store(path, compiled)
    return compiled


def _build_logged(name: str, key: Hashable, build: Callable[[], Callable]) -> Callable:
    logger.info("compiling %s for %s (first use of this configuration)", name, key)
    return build()
