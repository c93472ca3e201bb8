"""Whether Numba's on-disk cache already holds this package's compiled kernels."""
from pathlib import Path


def kernels_compiled() -> bool:
    """True once any kernel of this package has been compiled and cached (index files exist)."""
    return any((Path(__file__).parent / "__pycache__").glob("*.nbi"))
