"""Small helpers for emitting LLVM IR vector code from Numba intrinsics (see rowdot.py).

Numba's auto-vectorizer gives up on block-structured loops (per-block scales, nibble unpacking),
so the hot loops are written directly as LLVM vector IR. Values are 16 lanes wide: one AVX-512
register of float32, or two AVX2 registers where the CPU has no AVX-512.
"""
from llvmlite import ir
from numba.core import cgutils

LANES = 16
I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
FAST = ("fast",)


def vector(element, n=LANES):
    return ir.VectorType(element, n)


def const_vector(element, values):
    return ir.Constant(vector(element, len(values)), list(values))


def splat(b, value, n=LANES):
    one = b.insert_element(ir.Constant(vector(value.type, n), ir.Undefined), value, ir.Constant(I32, 0))
    return b.shuffle_vector(one, one, const_vector(I32, [0] * n))


def array_data(context, b, array_type, array_value):
    """The data pointer of a Numba array, as i8*."""
    data = cgutils.create_struct_proxy(array_type)(context, b, value=array_value).data
    return b.bitcast(data, I8.as_pointer())


def array_strides(context, b, array_type, array_value):
    proxy = cgutils.create_struct_proxy(array_type)(context, b, value=array_value)
    return cgutils.unpack_tuple(b, proxy.strides, array_type.ndim)


def array_shape(context, b, array_type, array_value):
    proxy = cgutils.create_struct_proxy(array_type)(context, b, value=array_value)
    return cgutils.unpack_tuple(b, proxy.shape, array_type.ndim)


def array_row(context, b, array_type, array_value, index):
    """Pointer (i8*) to row `index` (an i64 value) of a Numba array: data + index * first stride."""
    stride = array_strides(context, b, array_type, array_value)[0]
    return offset(b, array_data(context, b, array_type, array_value), b.mul(index, stride))


def offset(b, ptr, n):
    """ptr + n bytes; n an int or an i64 value."""
    return b.gep(ptr, [ir.Constant(I64, n) if isinstance(n, int) else n])


def load_bytes(b, ptr, at, n=LANES):
    """n bytes at ptr + at as <n x i8>; rows of blocks are not aligned, so neither are loads."""
    return b.load(b.bitcast(offset(b, ptr, at), vector(I8, n).as_pointer()), align=1)


def load_floats(b, ptr, at_element, n=LANES):
    """n float32 starting at element at_element (an i64 value) of a float32 array at ptr."""
    p = b.gep(b.bitcast(ptr, F32.as_pointer()), [at_element])
    return b.load(b.bitcast(p, vector(F32, n).as_pointer()), align=4)


def load_f16(b, ptr, at):
    half = b.load(b.bitcast(offset(b, ptr, at), ir.HalfType().as_pointer()), align=1)
    return b.fpext(half, F32)


def load_u32(b, ptr, at):
    return b.load(b.bitcast(offset(b, ptr, at), I32.as_pointer()), align=1)


def load_byte(b, ptr, at):
    """The byte at ptr + at, zero-extended to i32."""
    return b.zext(b.load(offset(b, ptr, at)), I32)


def to_float(b, ints, signed):
    return (b.sitofp if signed else b.uitofp)(ints, vector(F32, ints.type.count))


def prefetch(b, ptr):
    """A read hint for the cache line at ptr (never faults, so it may point past the data)."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [ptr.type, I32, I32, I32]),
                                        "llvm.prefetch.p0")
    b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def mul_add(b, x, y, z):
    """x * y + z; the fast-math flags let LLVM fuse it into one FMA."""
    return b.fadd(b.fmul(x, y, flags=FAST), z, flags=FAST)


def horizontal_sum(b, v):
    n = v.type.count
    while n > 1:
        n //= 2
        low = b.shuffle_vector(v, v, const_vector(I32, range(n)))
        high = b.shuffle_vector(v, v, const_vector(I32, range(n, 2 * n)))
        v = b.fadd(low, high, flags=FAST)
    return b.extract_element(v, ir.Constant(I32, 0))
