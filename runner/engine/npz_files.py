"""Reading .npz files that a user hands ggrun (a saved KV state, logits for --kl-base) without trusting
them: never by pickle, and every member's declared type and shape checked by the caller before its
data is read, so that a crafted file can neither allocate terabytes nor expand a zip bomb."""
from __future__ import annotations

import zipfile
from collections.abc import Callable

import numpy as np

MAX_MEMBERS = 4096


class NpzError(ValueError):
    """The file is not an .npz of plain arrays, or holds one its reader refuses."""


def _header(f) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if read is None:
        raise NpzError(f"unknown .npy format version {version}")
    shape, fortran_order, dtype = read(f)
    if fortran_order or dtype.hasobject:
        raise NpzError("it holds an array of Python objects or in Fortran order")
    return shape, dtype


def read_npz(path, check: Callable[[str, np.dtype, tuple[int, ...]], None],
             names: set[str] | None = None) -> dict[str, np.ndarray]:
    """The arrays of an .npz (of `names` only, where given). check(name, dtype, shape) sees each
    member's declaration first and raises NpzError to refuse it; a member whose size is not what
    it declares is refused too. Any unreadable file is an NpzError."""
    try:
        with zipfile.ZipFile(path) as zf:
            members = [i for i in zf.infolist() if names is None or i.filename.removesuffix(".npy") in names]
            if len(zf.infolist()) > MAX_MEMBERS:
                raise NpzError(f"it holds {len(zf.infolist())} members")
            arrays = {}
            for info in members:
                name = info.filename.removesuffix(".npy")
                with zf.open(info) as f:
                    shape, dtype = _header(f)
                    check(name, dtype, shape)
                    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                    if f.tell() + nbytes != info.file_size:
                        raise NpzError(f"its member {name!r} does not hold the {nbytes} bytes it declares")
                    arrays[name] = np.frombuffer(f.read(nbytes), dtype=dtype).reshape(shape).copy()
            return arrays
    except NpzError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:
        raise NpzError(f"it cannot be read ({e})") from None


def expect(name: str, dtype: np.dtype, shape: tuple[int, ...], want_dtype, want_shape) -> None:
    """Refuses a member unless it has the dtype and shape wanted (None in want_shape: any size)."""
    if (np.dtype(dtype) != np.dtype(want_dtype) or len(shape) != len(want_shape)
            or any(w is not None and s != w for s, w in zip(shape, want_shape))):
        raise NpzError(f"its {name} is {np.dtype(dtype)} {tuple(shape)}, not {np.dtype(want_dtype)} "
                       f"{tuple('any' if w is None else w for w in want_shape)}")
