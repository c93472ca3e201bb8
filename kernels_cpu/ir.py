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


def splat_float(b, value, n=LANES):
    """splat for a float32 scalar; one converted from float16 is splatted as float16 and
    converted as a vector, which AVX512-FP16 does in one instruction from memory (vcvtph2psx with
    a broadcast load) where scalar load, convert and broadcast take three."""
    if isinstance(value, ir.CastInstr) and value.opname == "fpext" and isinstance(value.operands[0].type, ir.HalfType):
        return b.fpext(splat(b, value.operands[0], n), vector(F32, n))
    return splat(b, value, n)


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


def load_vector(b, ptr, at_element, element, n=LANES):
    """n values of type `element` starting at element at_element (an i64 value) of an array at ptr."""
    p = b.gep(b.bitcast(ptr, element.as_pointer()), [at_element])
    return b.load(b.bitcast(p, vector(element, n).as_pointer()), align=4 if element == F32 else element.width // 8)


def load_f16(b, ptr, at):
    half = b.load(b.bitcast(offset(b, ptr, at), ir.HalfType().as_pointer()), align=1)
    return b.fpext(half, F32)


def load_u32(b, ptr, at):
    return b.load(b.bitcast(offset(b, ptr, at), I32.as_pointer()), align=1)


def to_float(b, ints, signed):
    return (b.sitofp if signed else b.uitofp)(ints, vector(F32, ints.type.count))


def widen(b, ints, element, signed):
    """Integer vector to wider lanes of type `element`, sign- or zero-extended."""
    return (b.sext if signed else b.zext)(ints, vector(element, ints.type.count))


def concat(b, low, high):
    """Two vectors of n lanes as one of 2n."""
    return b.shuffle_vector(low, high, const_vector(I32, range(2 * low.type.count)))


def pair_products(b, a, c):
    """<2n x i16> a, c -> <n x i32>: a[2i] * c[2i] + a[2i + 1] * c[2i + 1]. x86 has this as one
    instruction (pmaddwd; vpdpwssd with an accumulator on VNNI), which LLVM selects for the pattern."""
    n = a.type.count
    wide = vector(I32, n)
    p = b.mul(b.sext(a, wide), b.sext(c, wide))
    even = b.shuffle_vector(p, p, const_vector(I32, range(0, n, 2)))
    odd = b.shuffle_vector(p, p, const_vector(I32, range(1, n, 2)))
    return b.add(even, odd)


def pair_products_into(b, isa, acc, a, c):
    """acc + pair_products(a, c) for <16 x i16> a, c: one vpdpwssd with VNNI, kept as the
    intrinsic so that LLVM does not re-associate sums of them into one chain of vpdpwssd (4-5
    cycles each: a K-quant super-block then waited ~36 cycles on its own sum)."""
    if isa == "vnni":
        return x86_call(b, "llvm.x86.avx512.vpdpwssd.256", acc.type, [acc, b.bitcast(a, acc.type), b.bitcast(c, acc.type)])
    return b.add(acc, pair_products(b, a, c))


def lanes_below(b, n, lanes=LANES):
    """<lanes x i1>: lane i set when i < n (an i64 value)."""
    return b.icmp_unsigned("<", const_vector(I64, range(lanes)), splat(b, n, lanes))


def masked_load(b, ptr, mask, align):
    """The lanes of mask from the vector at ptr (a vector pointer), zeros elsewhere; the other
    lanes' memory is not touched."""
    vt = ptr.type.pointee
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(vt, [ptr.type, I32, mask.type, vt]),
                                        f"llvm.masked.load.v{vt.count}{_type_suffix(vt.element)}.p0")
    return b.call(fn, [ptr, ir.Constant(I32, align), mask, ir.Constant(vt, [0] * vt.count)])


def masked_store(b, value, ptr, mask, align):
    """Store the lanes of mask of value at ptr (a vector pointer)."""
    vt = value.type
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [vt, ptr.type, I32, mask.type]),
                                        f"llvm.masked.store.v{vt.count}{_type_suffix(vt.element)}.p0")
    b.call(fn, [value, ptr, ir.Constant(I32, align), mask])


def _type_suffix(t):
    return {F32: "f32"}.get(t) or ("f16" if isinstance(t, ir.HalfType) else f"i{t.width}")


# Kernels that stream from memory ask for the cache line this many bytes ahead of what they
# read: the hardware prefetchers alone leave decode's products waiting on memory, and hints into
# L2 instead, or further ahead, read no faster. (Attention's own: intrinsics.KV_PREFETCH_BYTES.)
PREFETCH_BYTES = 4096
# A pass of several tokens over the weights (a verified draft) computes for longer per byte than
# one token does, and asks for lines further ahead, into L2 (prefetch's into_l1=False): with
# PREFETCH_BYTES' fetches into L1 its arithmetic and its reads take turns (float rows and the
# 8-bit products of quantized groups alike).
PASS_PREFETCH_BYTES = 12288


def prefetch_weights(b, ptr, tokens):
    """A read hint for the weights' cache line a pass over `tokens` tokens reads next from ptr:
    PREFETCH_BYTES past it into L1 for one token, PASS_PREFETCH_BYTES past it into L2 for
    several."""
    if tokens > 1:
        prefetch(b, offset(b, ptr, PASS_PREFETCH_BYTES), into_l1=False)
    else:
        prefetch(b, offset(b, ptr, PREFETCH_BYTES))


def prefetch(b, ptr, into_l1=True):
    """A read hint for the cache line at ptr (never faults, so it may point past the data): into
    every level (prefetcht0), or with into_l1=False into L2 and beyond (prefetcht1)."""
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ir.VoidType(), [ptr.type, I32, I32, I32]),
                                        "llvm.prefetch.p0")
    b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3 if into_l1 else 2), ir.Constant(I32, 1)])


def mul_add(b, x, y, z):
    """x * y + z; the fast-math flags let LLVM fuse it into one FMA."""
    return b.fadd(b.fmul(x, y, flags=FAST), z, flags=FAST)


def fused_mul_add(b, x, y, z):
    """x * y + z as one FMA where the target has them (llvm.fmuladd), in exactly this order: unlike
    mul_add's, LLVM may not regroup it with the operations around it, so the same IR rounds the
    same way wherever it is emitted (see rowdot.emit_rows' tokens per pass)."""
    n = x.type.count
    return x86_call(b, f"llvm.fmuladd.v{n}f32", x.type, [x, y, z])


def horizontal_sum(b, v, flags=FAST):
    """The sum of v's lanes, pairwise; flags=() keeps that order (no regrouping)."""
    n = v.type.count
    while n > 1:
        n //= 2
        low = b.shuffle_vector(v, v, const_vector(I32, range(n)))
        high = b.shuffle_vector(v, v, const_vector(I32, range(n, 2 * n)))
        v = b.fadd(low, high, flags=flags)
    return b.extract_element(v, ir.Constant(I32, 0))


# 8-bit dot products, by the instructions the target has (cpu_features.int8_isa): LLVM selects
# vpmaddubsw and vpdpbusd only from their intrinsics (vpmaddubsw saturates, so no plain integer
# IR means it), and asking for one the target lacks stops the process.
def x86_call(b, name, ret, args):  # (or any LLVM intrinsic)
    fn = cgutils.get_or_insert_function(b.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return b.call(fn, args)


def byte_pair_sums(b, isa, u, s):
    """<32 x i8> unsigned u, signed s -> <16 x i16>: u[2i] * s[2i] + u[2i + 1] * s[2i + 1]. Exact
    while u <= 128 and |s| <= 127 (vpmaddubsw saturates beyond int16)."""
    if isa == "generic":
        return _word_pair_sums(b, b.zext(u, vector(I16, u.type.count)), b.sext(s, vector(I16, s.type.count)))
    return x86_call(b, "llvm.x86.avx2.pmadd.ub.sw", vector(I16, 16), [u, s])


def _word_pair_sums(b, a, c):
    """<n x i16> a and c -> <n/2 x i16>: a[2i] * c[2i] + a[2i + 1] * c[2i + 1]."""
    p = b.mul(a, c)
    n = a.type.count
    return b.add(b.shuffle_vector(p, p, const_vector(I32, range(0, n, 2))),
                 b.shuffle_vector(p, p, const_vector(I32, range(1, n, 2))))


def word_picks(b, isa, v, lanes):
    """<16 x i16> whose lane j is v[lanes[j]], for v of 8 or 16 words and lanes that all read
    one half of v (words 0-7 or 8-15), as a vpshufb from that half repeated in both 128-bit
    lanes. Where the picks are not one broadcast, LLVM keeps it: the 16-group K-quants' units
    (word g in lanes 0-7, g + 1 in 8-15) would otherwise take a shift and a broadcast each from
    LLVM's own lowering. One broadcast (Q4_K, Q5_K) it turns back into vpbroadcastw."""
    if isa == "generic":
        return b.shuffle_vector(v, v, const_vector(I32, lanes))
    half = lanes[0] // 8
    if any(lane // 8 != half for lane in lanes):
        raise ValueError("word_picks reads one half of its vector")
    source = b.shuffle_vector(v, v, const_vector(I32, [8 * half + i % 8 for i in range(16)]))
    control = const_vector(I8, [2 * (lane % 8) + byte for lane in lanes for byte in (0, 1)])
    picked = x86_call(b, "llvm.x86.avx2.pshuf.b", vector(I8, 32), [b.bitcast(source, vector(I8, 32)), control])
    return b.bitcast(picked, vector(I16, 16))


def byte_quad_sums(b, isa, acc, u, s):
    """acc (<8 x i32>) plus, in lane i, the sum of u[4i + j] * s[4i + j] over j < 4, for <32 x i8>
    unsigned u and signed s (u <= 128, |s| <= 127): one vpdpbusd with VNNI, else vpmaddubsw and
    vpmaddwd by ones."""
    if isa == "vnni":
        return x86_call(b, "llvm.x86.avx512.vpdpbusd.256", acc.type, [acc, u, s])
    return b.add(acc, pair_products(b, byte_pair_sums(b, isa, u, s), const_vector(I16, [1] * 16)))


def wide_byte_quad_sums(b, isa, acc, u, s, wide):
    """byte_quad_sums for <16 x i32> acc and <64 x i8> u and s: one 512-bit vpdpbusd where `wide`
    (the target has AVX512-VNNI), else two of 256 bits. Without VNNI, exact for u <= 255 while
    |s| <= 64 (vpmaddubsw's pair sums stay within int16)."""
    if isa == "vnni" and wide:
        return x86_call(b, "llvm.x86.avx512.vpdpbusd.512", acc.type, [acc, u, s])

    def half(v, h):
        n = v.type.count // 2
        return b.shuffle_vector(v, v, const_vector(I32, range(h * n, (h + 1) * n)))
    return concat(b, *(byte_quad_sums(b, isa, half(acc, h), half(u, h), half(s, h)) for h in range(2)))


def _signs_moved(b, w, s):
    """(|w|, s with w's signs) for signed bytes w and s (vpabsb, vpsignb): their products are w * s."""
    magnitude = x86_call(b, f"llvm.abs.v{w.type.count}i8", w.type, [w, ir.Constant(ir.IntType(1), 0)])
    return magnitude, x86_call(b, "llvm.x86.avx2.psign.b", s.type, [s, w])


def signed_byte_quad_sums(b, isa, acc, w, s):
    """byte_quad_sums for signed bytes w: |w| times s with w's signs, as llama.cpp multiplies two
    Q8_0 blocks."""
    if isa == "generic":
        wide = vector(I32, w.type.count)
        p = b.mul(b.sext(w, wide), b.sext(s, wide))
        quads = [b.shuffle_vector(p, p, const_vector(I32, range(j, w.type.count, 4))) for j in range(4)]
        return b.add(acc, b.add(b.add(quads[0], quads[1]), b.add(quads[2], quads[3])))
    return byte_quad_sums(b, isa, acc, *_signs_moved(b, w, s))


def signed_byte_pair_sums(b, isa, w, s):
    """byte_pair_sums for signed bytes w (|w| <= 127: exact), as signed_byte_quad_sums."""
    if isa == "generic":
        return _word_pair_sums(b, b.sext(w, vector(I16, w.type.count)), b.sext(s, vector(I16, s.type.count)))
    return byte_pair_sums(b, isa, *_signs_moved(b, w, s))
