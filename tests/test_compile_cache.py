"""Numba's on-disk cache of ggrun's kernels: what is dropped when sources change, what is marked
compiled, and that code cached by different processes never mixes."""
import os
import subprocess
import sys
from pathlib import Path

# Two structured dtypes with the same fields at swapped offsets: a kernel over each reads a
# different field as "the second". A parallel callee is not inlined into its caller, so the
# caller's copy of it is a weak symbol that the JIT links by name.
_PROBE = """
import sys
import numpy as np
import kernels_cpu  # (ggrun's guard: its compile numbering)
from numba import njit, prange


@njit(cache=True, parallel=True)
def second_fields(x):
    total = 0.0
    for i in prange(x.shape[0]):
        total += x[i][1]
    return total


@njit(cache=True)
def twice_second_fields(x):
    return 2 * second_fields(x)


dtypes = {"A": np.dtype([("a", np.float64), ("b", np.int64)]), "B": np.dtype([("b", np.int64), ("a", np.float64)])}
out = []
for name in sys.argv[1:]:
    x = np.zeros(1, dtypes[name])
    x["a"], x["b"] = 1.5, 7
    out.append(twice_second_fields(x))
print(*out)
"""


def test_each_cache_type_gets_its_compile_message(tmp_path, monkeypatch):
    """The kernels that touch the KV cache compile once per element type: a first run with another
    --cache-type says so too."""
    from kernels_cpu import compile_cache
    monkeypatch.setattr(compile_cache, "_PACKAGE", tmp_path / "kernels")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    assert not compile_cache.kernels_compiled("q8_0")
    compile_cache.mark_compiled("q8_0")
    assert compile_cache.kernels_compiled("q8_0") and not compile_cache.kernels_compiled("f16")


def test_compile_marks_live_beside_the_numba_cache(tmp_path, monkeypatch):
    """NUMBA_CACHE_DIR moves the kernels' cache, and the marks with it: a mark beside another
    cache says nothing about this one."""
    from kernels_cpu import compile_cache
    monkeypatch.setattr(compile_cache, "_PACKAGE", tmp_path / "kernels")
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    compile_cache.mark_compiled("f16-decode")
    assert compile_cache.kernels_compiled("f16-decode")
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert not compile_cache.kernels_compiled("f16-decode")
    compile_cache.mark_compiled("f16-decode")
    assert compile_cache.kernels_compiled("f16-decode")
    assert list((tmp_path / "elsewhere").rglob("ggrun-compiled-f16-decode"))


def test_a_kernel_source_change_drops_every_inlining_cache(tmp_path, monkeypatch):
    """A change to the kernels package's sources drops the Numba caches of every package that
    inlines it, in __pycache__ and where NUMBA_CACHE_DIR puts them, as Numba itself names that
    place; unchanged sources keep them, and so does a change to an inlining package alone (Numba
    checks its own files)."""
    from kernels_cpu import compile_cache
    packages = [tmp_path / "kernels", tmp_path / "tools"]
    for package in packages:
        package.mkdir()
        (package / "__init__.py").write_text("")
    (packages[1] / "jitted.py").write_text("from numba import njit\n\n\n@njit(cache=True)\ndef one():\n    return 1\n")
    user_cache = tmp_path / "numba-cache"
    r = subprocess.run([sys.executable, "-c", "from tools.jitted import one; one()"], cwd=tmp_path, timeout=300,
                       env={**os.environ, "NUMBA_CACHE_DIR": str(user_cache)}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(user_cache))
    monkeypatch.setattr(compile_cache, "_PACKAGE", packages[0])
    monkeypatch.setattr(compile_cache, "_INLINING", tuple(packages))
    monkeypatch.setattr(compile_cache, "_CACHE", packages[0] / "__pycache__")
    monkeypatch.setattr(compile_cache, "_STAMP", packages[0] / "__pycache__" / "stamp")
    numba_made = list(compile_cache._cache_dirs(packages[1])[1].glob("jitted.one-*"))
    assert numba_made, list(user_cache.rglob("*"))

    def cached():
        files = [p / "__pycache__" / f"{p.name}.f-1.py311.nbi" for p in packages] + numba_made
        for path in files:
            path.parent.mkdir(exist_ok=True)
            path.touch()
        return files

    files = cached()
    compile_cache.drop_stale_cache()  # first run: no stamp yet
    assert not any(p.exists() for p in files)
    files = cached()
    compile_cache.drop_stale_cache()
    assert all(p.exists() for p in files)
    with open(packages[1] / "jitted.py", "a") as f:
        f.write("# changed\n")
    compile_cache.drop_stale_cache()
    assert all(p.exists() for p in files)
    (packages[0] / "blocks.py").write_text("# changed\n")
    compile_cache.drop_stale_cache()
    assert not any(p.exists() for p in files)


def test_code_cached_by_two_processes_never_mixes(tmp_path):
    """Numba numbers compiles and structured types per process, and names symbols by those numbers:
    the kernel cached for dtype A by one process and for dtype B by another had the same name, and
    a third process that loaded both ran A's code on B's data (9.2e18 for 3.0; the f16 cache test
    of test_model.py decoded garbage after the fast-decode tests, whose two models had cached
    `products` over their weight types in two processes)."""
    (tmp_path / "probe.py").write_text(_PROBE)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}

    def probe(*names):
        r = subprocess.run([sys.executable, "probe.py", *names], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return [float(v) for v in r.stdout.split()]

    assert probe("A") == [14.0] and probe("B") == [3.0]  # each compiled and cached in its own process
    assert probe("A", "B") == [14.0, 3.0]  # both loaded from the cache into one
