"""The compiled-kernel disk cache's host logic, with a stand-in for the compiler and loader."""

import logging

import pytest

from ops import _disk_cache as D


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_KERNELS_CACHE", "1")
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(D, "usable", lambda: True)
    return tmp_path


class FakeCompiled:
    """What cute.compile returns, as far as the cache uses it."""

    def __init__(self, payload=b"object code"):
        self.payload = payload
        self.exports = 0

    def export_to_c(self, path, function_name):
        self.exports += 1
        with open(path, "wb") as f:
            f.write(self.payload + function_name.encode())

    def __call__(self):
        return "fresh"


@pytest.fixture
def loader(monkeypatch):
    """A stand-in load_module: loads files whose text starts with b'object code'."""
    import cutlass.cute as cute

    loads = []

    class Module:
        def __init__(self, path):
            data = open(path, "rb").read()
            if not data.startswith(b"object code"):
                raise RuntimeError("not an object file")
            self.name = data[len(b"object code") :].decode()

        def __getattr__(self, name):
            if name != self.name:
                raise AttributeError(name)
            return lambda: "loaded"

    def load_module(path, enable_tvm_ffi):
        assert enable_tvm_ffi
        loads.append(path)
        return Module(path)

    monkeypatch.setattr(cute.runtime, "load_module", load_module)
    return loads


def test_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTE_KERNELS_CACHE_DIR", raising=False)
    monkeypatch.setenv("CUTE_KERNELS_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert D.cache_dir() == tmp_path / "cute_kernels"
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert D.cache_dir() == tmp_path / "elsewhere"
    for off in ("0", "off", "false"):
        monkeypatch.setenv("CUTE_KERNELS_CACHE", off)
        assert D.cache_dir() is None


def test_entries_differ_by_name_and_key(tmp_path):
    paths = {D.entry_path(tmp_path, n, k) for n in ("a", "b") for k in ("(1, 'sm_90a')", "(2, 'sm_90a')")}
    assert len(paths) == 4
    assert D.entry_path(tmp_path, "a", "k") == D.entry_path(tmp_path, "a", "k")
    assert D.stable_key((1, "sm_90a", True)) == "(1, 'sm_90a', True)"
    assert D.stable_key((object(),)) is None  # an address in the text: not kept on disk


def test_first_process_compiles_and_stores_the_next_loads(cache_on, loader, caplog):
    compiled = FakeCompiled()
    builds = []
    with caplog.at_level(logging.INFO, logger="cute_kernels"):
        fn = D.load_or_build("kern", (1, "sm_90a"), lambda: builds.append(1) or compiled)
    assert fn() == "fresh" and builds == [1] and compiled.exports == 1 and loader == []
    assert any("compiling kern for (1, 'sm_90a')" in r.getMessage() for r in caplog.records)
    (entry,) = (cache_on / "kern").glob("*.o")
    # a later process: loads, compiles nothing
    fn = D.load_or_build("kern", (1, "sm_90a"), lambda: pytest.fail("compiled again"))
    assert fn() == "loaded" and loader == [str(entry)]
    assert not list((cache_on / "kern").glob("*.part"))


def test_a_corrupt_entry_is_compiled_again(cache_on, loader, caplog):
    path = D.entry_path(cache_on, "kern", D.stable_key((2,)))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"truncated")
    compiled = FakeCompiled()
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        fn = D.load_or_build("kern", (2,), lambda: compiled)
    assert fn() == "fresh" and compiled.exports == 1
    assert "does not load" in caplog.text
    assert path.read_bytes().startswith(b"object code")  # replaced by the new compile


def test_an_unwritable_folder_still_compiles(cache_on, loader, monkeypatch, caplog):
    blocker = cache_on / "kern"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="cute_kernels"):
        fn = D.load_or_build("kern", (3,), lambda: FakeCompiled())
    assert fn() == "fresh" and "cannot use" in caplog.text


def test_off_or_without_a_gpu_nothing_is_written(tmp_path, monkeypatch, loader):
    monkeypatch.setenv("CUTE_KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CUTE_KERNELS_CACHE", "1")
    # compile-only processes (no GPU) do not use the cache
    monkeypatch.setattr(D.torch.cuda, "is_available", lambda: False)
    assert D.usable() is False
    monkeypatch.setenv("CUTE_KERNELS_CACHE", "0")
    assert D.usable() is False
    fn = D.load_or_build("kern", (4,), lambda: FakeCompiled())
    assert fn() == "fresh" and not list(tmp_path.rglob("*.o"))


def test_code_version_covers_the_kernel_sources():
    import pathlib

    root = pathlib.Path(D.__file__).resolve().parents[1]
    assert (root / "cute_kernels" / "attention_sm90").is_dir()
    assert len(D.code_version()) == 64
