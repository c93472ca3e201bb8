"""Prefill's 8-bit products of interleaved groups on AMX's integer tiles (tdpbssd).

An interleaved word (interleaved.py) holds four consecutive weights of each of a group's eight
rows: two groups' words side by side are one 64-byte row of the second operand tdpbssd takes
(16 columns of 4 consecutive k). So a unit of a block (the weights that share an integer scale:
32, or 16 for the types with 16-weight scales) of two groups is one tile of W rows, one per
word, decoded by the same IR as the vector path's; the activations' matching 16 tokens x 4W
bytes load as a tile straight from the 8-bit activations, a row per token. One tdpbssd then
does the 16 x 16 x 4W multiply-adds that took the vector path 2 x 16 x W vpdpbusd.

The integer sums leave the tile through memory, then go the vector path's way: times the
unit's integer scale into a block total per token, and at the block's end corrected, scaled
and added in float (interleaved.block_value), in the same order: the products are bit for bit
the vector path's. Every value fits a signed byte (unsigned weights reach 63 at most), so one
instruction serves signed and unsigned types.
"""
from __future__ import annotations

import functools

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from llvmlite import binding, ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from . import amx
from .cpu_features import int8_isa
from .interleaved import ACTIVATIONS, GROUP, KINDS, LAYOUTS, Block, block_value
from .ir import F32, I8, I32, I64, array_row, array_shape, array_strides, concat, const_vector, offset, vector
from .rowdot import switch_on_type
from .type_sets import tagged_types

ROWS = TOKENS = 16  # a tile's output: 16 tokens (its rows) x 16 weight rows (two groups)
# Two sets of tiles (sums C, activations A, weights B), for two units in flight.
_TILE_SETS = ((0, 1, 2), (3, 4, 5))
# Words (of four weights) per unit where it is not 8: the types with a scale per 16 weights.
_WORDS = {T.Q2_K: 4, T.Q3_K: 4, T.Q6_K: 4}


def _tile_config(words: int) -> ir.Constant:
    """ldtilecfg's 64 bytes for units of `words` words: C 16 x 64 bytes (int32 sums), A 16 x 4W
    bytes (tokens' activations), B W x 64 (the two groups' words)."""
    config = bytearray(64)
    config[0] = 1  # palette 1
    for c, a, w in _TILE_SETS:
        for tile, (rows, row_bytes) in {c: (ROWS, 64), a: (TOKENS, 4 * words), w: (words, 64)}.items():
            config[16 + 2 * tile:18 + 2 * tile] = row_bytes.to_bytes(2, "little")
            config[48 + tile] = rows
    return ir.Constant(ir.ArrayType(I8, 64), config)


def _position(at):
    """A word's position in its block as (an IR value or None, a constant): units give
    positions as ints or as an IR value plus constants."""
    if isinstance(at, int):
        return None, at
    if isinstance(at, ir.Instruction) and at.opname == "add" and isinstance(at.operands[1], ir.Constant):
        base, constant = _position(at.operands[0])
        return base, constant + at.operands[1].constant
    return at, 0


def _word_order(unit) -> tuple:
    """(base, first constant, the unit's word indices by position): the words must be 4W
    consecutive weights, for the activations to load as one tile."""
    places = [_position(at) for _, at in unit.words]
    base = places[0][0]
    order = sorted(range(len(places)), key=lambda j: places[j][1])
    first = places[order[0]][1]
    if any(places[j][0] is not base or places[j][1] != first + 4 * n for n, j in enumerate(order)):
        raise NotImplementedError("a unit whose words are not consecutive weights")
    return base, first, order


@njit(cache=True)
def work_bytes(rows, k):
    """The scratch memory groups_product_amx takes for `rows` rows of K weights: each pair of
    groups decoded to bytes (16 K), each of its units' scales (at most K / 16 units, 64 bytes
    each), each unit's first weight (8 bytes)."""
    return rows // ROWS * (16 * k + 4 * k) + k // 2


@intrinsic
def groups_product_amx(typingctx, kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col,
                       work):
    """interleaved.groups_dot_int8 on AMX's tiles, for rows first <= r < last in pairs of groups
    (multiples of 16) and a multiple of 16 tokens (len(out)); work: uint8, work_bytes(last -
    first, K) of them; the callers' other guarantees as there.

    The rows' units are decoded once, into work, for all the tokens; then each 16 tokens go
    over them, the rows' tiles and the tokens' activations staying in L2 (tasks of a few pairs
    of groups)."""
    isa = int8_isa()
    qtypes = [t for t in tagged_types(kinds) if t in LAYOUTS]

    def codegen(context, b, signature, args):
        _, qtype_v, wv, first_v, last_v, *act_values, out_v, col_v, work_v = args
        act_values = act_values[:len(ACTIVATIONS)]
        act_types = signature.args[5:12]
        w_type, out_type, work_type = signature.args[2], signature.args[12], signature.args[14]
        n_tokens = array_shape(context, b, out_type, out_v)[0]
        const = lambda v: ir.Constant(I64, v)  # noqa: E731
        sums = cgutils.alloca_once(b, ir.ArrayType(I8, 2048))
        sums.align = 64
        sums_at = [offset(b, b.bitcast(sums, I8.as_pointer()), 1024 * n) for n in (0, 1)]
        wide = vector(I32, 2 * GROUP)  # a token's sums with the two groups' rows
        totals = cgutils.alloca_once(b, wide, size=TOKENS)  # a block's, per token
        accs = cgutils.alloca_once(b, vector(F32, GROUP), size=2 * TOKENS)  # token t, group h: [2t + h]
        tables = [cgutils.alloca_once(b, vector(I32, GROUP), size=16) for _ in range(2)]  # each group's scale_table
        work_at = array_row(context, b, work_type, work_v, const(0))
        n_pairs = b.udiv(b.sub(last_v, first_v), const(2 * GROUP))

        def emit(qt):
            kind, words = KINDS[qt], _WORDS.get(qt, 8)
            block_bytes, block_values = GROUP * GGML_QUANT_SIZES[qt][1], GGML_QUANT_SIZES[qt][0]
            n_blocks = b.udiv(array_shape(context, b, w_type, wv)[1], const(block_bytes))
            k = b.mul(n_blocks, const(block_values))
            n_units = b.udiv(k, const(4 * words))
            units_per_block = block_values // (4 * words)
            # work: each pair's tiles (n_units x W x 64 bytes), then its units' scales (n_units x
            # 64 bytes), then the units' first weights (n_units i64), for all pairs alike
            tiles_at = lambda pair: offset(b, work_at, b.mul(pair, b.mul(k, const(16))))  # noqa: E731
            scales_at = lambda pair: offset(b, work_at, b.add(b.mul(n_pairs, b.mul(k, const(16))),  # noqa: E731
                                                             b.mul(pair, b.mul(n_units, const(64)))))
            firsts = b.bitcast(offset(b, work_at, b.mul(n_pairs, b.add(b.mul(k, const(16)), b.mul(n_units, const(64))))),
                               I64.as_pointer())
            q_type, q_value = dict(zip(ACTIVATIONS, zip(act_types, act_values)))[kind.activations]
            q_stride = array_strides(context, b, q_type, q_value)[0]
            group_ptrs = lambda pair: [array_row(context, b, w_type, wv, b.add(b.add(b.udiv(first_v, const(GROUP)),  # noqa: E731
                                                                                b.mul(pair, const(2))), const(h)))
                                       for h in (0, 1)]
            scaled = set()  # whether the units have integer scales
            with cgutils.for_range(b, n_pairs) as pair:  # decode every unit of the pair's rows
                ptrs = group_ptrs(pair.index)
                with cgutils.for_range(b, n_blocks) as loop:
                    i = loop.index
                    blks = [Block(b, LAYOUTS[qt], offset(b, ptr, b.mul(i, const(block_bytes)))) for ptr in ptrs]
                    for blk, table in zip(blks, tables):
                        for j, scale in enumerate(kind.scale_table(b, blk) or ()):
                            b.store(scale, b.gep(table, [const(j)]))
                    per_step = units_per_block // kind.steps
                    with cgutils.for_range(b, const(kind.steps)) as step:
                        pairs = zip(*(kind.units(b, blk, step.index, lambda j, t=table: b.load(b.gep(t, [j])))
                                      for blk, table in zip(blks, tables)))
                        n = 0
                        for n, units in enumerate(pairs):
                            base, first_k, order = _word_order(units[0])
                            if len(order) != words:
                                raise NotImplementedError(f"{qt.name}: units of {len(order)} words")
                            u = b.add(b.mul(i, const(units_per_block)), b.add(b.mul(step.index, const(per_step)), const(n)))
                            tile_at = offset(b, tiles_at(pair.index), b.mul(u, const(64 * words)))
                            for row, j in enumerate(order):
                                for h, unit in enumerate(units):
                                    at = offset(b, tile_at, 64 * row + 32 * h)
                                    b.store(unit.words[j][0], b.bitcast(at, vector(I8, 32).as_pointer()), align=1)
                            scaled.add(units[0].scale is not None)
                            if units[0].scale is not None:
                                at = offset(b, scales_at(pair.index), b.mul(u, const(64)))
                                b.store(concat(b, units[0].scale, units[1].scale), b.bitcast(at, wide.as_pointer()), align=1)
                            k_first = b.add(b.mul(i, const(block_values)), const(first_k))
                            b.store(k_first if base is None else b.add(k_first, base), b.gep(firsts, [u]))
                        if n + 1 != per_step or len(scaled) != 1:
                            raise NotImplementedError(f"{qt.name}: {n + 1} units a step, not {per_step}")
            config = cgutils.global_constant(b.module, f"ggrun.amx_int8.config{words}", _tile_config(words))
            amx.call(b, "ldtilecfg", b.bitcast(config, I8.as_pointer()))
            with cgutils.for_range(b, b.udiv(n_tokens, const(TOKENS))) as tile:
                t0 = b.mul(tile.index, const(TOKENS))
                acts = [{name: array_row(context, b, ty, v, b.add(t0, const(t)))
                         for name, ty, v in zip(ACTIVATIONS, act_types, act_values)} for t in range(TOKENS)]
                q_rows = array_row(context, b, q_type, q_value, t0)
                with cgutils.for_range(b, n_pairs) as pair:
                    ptrs = group_ptrs(pair.index)
                    for j in range(2 * TOKENS):
                        b.store(ir.Constant(vector(F32, GROUP), [0.0] * GROUP), b.gep(accs, [const(j)]))
                    with cgutils.for_range(b, n_blocks) as loop:
                        i = loop.index
                        for t in range(TOKENS):
                            b.store(ir.Constant(wide, [0] * 2 * GROUP), b.gep(totals, [const(t)]))
                        def product(u, tiles, at):
                            """Unit u's 16 x 16 sums into the tile set's C, then stored at `at`."""
                            c, a, w = (amx.tile(t) for t in tiles)
                            amx.call(b, "tileloadd64", w, offset(b, tiles_at(pair.index), b.mul(u, const(64 * words))),
                                     const(64))
                            amx.call(b, "tileloadd64", a, offset(b, q_rows, b.load(b.gep(firsts, [u]))), q_stride)
                            amx.call(b, "tilezero", c)
                            amx.call(b, "tdpbssd", c, a, w)
                            amx.call(b, "tilestored64", c, at, const(64))

                        def add_up(u, at):
                            """The sums stored at `at`, times unit u's scales, into the block's totals."""
                            scale = None
                            if scaled == {True}:
                                scale = b.load(b.bitcast(offset(b, scales_at(pair.index), b.mul(u, const(64))),
                                                         wide.as_pointer()), align=1)
                            for t in range(TOKENS):
                                ints = b.load(b.bitcast(offset(b, at, 64 * t), wide.as_pointer()), align=64)
                                ints = ints if scale is None else b.mul(ints, scale)
                                total = b.gep(totals, [const(t)])
                                b.store(b.add(b.load(total), ints), total)
                        # Units two at a time where a block has several: tile registers are not
                        # renamed, so the second's product runs while the first's sums are stored.
                        ways = 2 if units_per_block % 2 == 0 else 1
                        with cgutils.for_range(b, const(units_per_block // ways)) as unit:
                            us = [b.add(b.mul(i, const(units_per_block)), b.add(b.mul(unit.index, const(ways)), const(n)))
                                  for n in range(ways)]
                            for n, u in enumerate(us):
                                product(u, _TILE_SETS[n], sums_at[n])
                            for n, u in enumerate(us):
                                add_up(u, sums_at[n])
                        blks = [Block(b, LAYOUTS[qt], offset(b, ptr, b.mul(i, const(block_bytes)))) for ptr in ptrs]
                        for t in range(TOKENS):
                            total = b.load(b.gep(totals, [const(t)]))
                            for h, blk in enumerate(blks):
                                ints = b.shuffle_vector(total, total, const_vector(I32, range(GROUP * h, GROUP * h + GROUP)))
                                acc = b.gep(accs, [const(2 * t + h)])
                                b.store(b.fadd(b.load(acc), block_value(b, isa, kind, blk, i, acts[t], ints)), acc)
                    for t in range(TOKENS):
                        out_row = b.bitcast(array_row(context, b, out_type, out_v, b.add(t0, const(t))), F32.as_pointer())
                        for h in (0, 1):
                            at = b.gep(out_row, [b.add(col_v, b.add(b.mul(pair.index, const(2 * GROUP)), const(GROUP * h)))])
                            b.store(b.load(b.gep(accs, [const(2 * t + h)])), b.bitcast(at, vector(F32, GROUP).as_pointer()),
                                    align=4)
            amx.call(b, "tilerelease")
        switch_on_type(b, qtype_v, emit, qtypes)
        return context.get_dummy_value()
    return (types.none(kinds, qtype, w, first, last, q32, d32, sum32, ssum32, q256, d256, sum16, out, col, work),
            codegen)


@functools.cache
def usable() -> bool:
    """Whether prefill's 8-bit products run on AMX's integer tiles: as amx.usable, with amx-int8."""
    return amx.usable() and bool(binding.get_host_cpu_features().get("amx-int8"))
