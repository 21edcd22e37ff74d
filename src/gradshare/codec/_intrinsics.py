"""The LLVM intrinsics inside the fused kernels' superblock loops (private).

The superblock step of :func:`gradshare.codec._kernels.scan` and of the bitmap encode are small
intrinsics (:func:`make_superblock`, :func:`make_bitmap_superblock`) working on one vector
register at a time (16 float32 or 8 float64 with AVX-512): a compare gives the lane mask, a
select the moved values, and ``llvm.experimental.vector.compress`` packs the entries and old
values of the hit lanes (AVX-512 ``vpcompress`` into a register, then a narrow store; LLVM
expands it on CPUs without AVX-512, still correct). The bitmap words come straight from the
compare masks. Every element sees the same IEEE operations as the torch path, so results are
identical bit for bit.

:mod:`gradshare.codec._kernels` builds its intrinsics from these factories at import and inlines
them into its ``@njit`` loops. numba's disk cache of a kernel is keyed on the file that defines
the kernel, not on this one: after changing this file, also touch ``_kernels.py`` (or clear its
``__pycache__``), or the kernels keep the cached machine code of the old intrinsics.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _splat(builder, value, vty):  # pragma: no cover - runs while compiling
    i32 = ir.IntType(32)
    vec = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(i32, 0))
    zeros = ir.Constant(ir.VectorType(i32, vty.count), None)
    return builder.shuffle_vector(vec, ir.Constant(vty, ir.Undefined), zeros)


def _vector_bytes(context):  # pragma: no cover - runs while compiling
    """Bytes of the widest vector register of the compile target (64 with AVX-512)."""
    try:
        features = context.codegen()._tm_features
    except AttributeError:  # numba internals moved: stay with the widely legal width
        return 32
    if "+avx512f" in features:
        return 64
    return 32 if "+avx" in features else 16


def _hsum(builder, vec):  # pragma: no cover - runs while compiling
    """Sum of the lanes of a vector (pairwise halving)."""
    i32 = ir.IntType(32)
    width = vec.type.count
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(
            vec, vec, ir.Constant(ir.VectorType(i32, width), list(range(width)))
        )
        hi = builder.shuffle_vector(
            vec, vec, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width)))
        )
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(i32, 0))


def _store_front(builder, vec, ptr, count, narrow):  # pragma: no cover - runs while compiling
    """Store the first ``count`` lanes of ``vec`` at ``ptr`` (and possibly more, up to all).

    Writes ``narrow`` lanes, and the whole vector only when ``count`` exceeds them (rare for
    sparse data), so that most groups cost one small store instead of a full-width one.
    """
    i32 = ir.IntType(32)
    ety = vec.type.element
    align = 4 if isinstance(ety, ir.IntType) else (4 if ety == ir.FloatType() else 8)
    front = builder.shuffle_vector(
        vec, vec, ir.Constant(ir.VectorType(i32, narrow), list(range(narrow)))
    )
    builder.store(front, builder.bitcast(ptr, front.type.as_pointer()), align=align)
    with builder.if_then(
        builder.icmp_unsigned(">", count, ir.Constant(count.type, narrow)), likely=False
    ):
        builder.store(vec, builder.bitcast(ptr, vec.type.as_pointer()), align=align)


def make_superblock(add, every, size):  # pragma: no cover - runs while compiling
    """The intrinsic that adds, squares, tests, moves and records one superblock of ``size``.

    ``add``: ``r += u`` first. ``every``: run the move-and-record step on every 16 lanes without
    a branch (dense data); else only on lanes groups with a hit (sparse data, the branch is
    predictable).
    """

    @intrinsic
    def superblock(typingctx, r, u, pos, t, ent, old, k):
        for a in (r, u, ent, old):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"):
                return None
        ret = types.Tuple((types.int64, r.dtype))
        sig = ret(r, u, types.int64, r.dtype, ent, old, types.int64)

        def codegen(context, builder, signature, args):
            r_, u_, pos_, t_, ent_, old_, k_ = args
            rty = signature.args[0]
            fty = context.get_value_type(rty.dtype)
            lanes = _vector_bytes(context) // context.get_abi_sizeof(fty)  # one register
            i32, i64, iw = ir.IntType(32), ir.IntType(64), ir.IntType(lanes)
            vty = ir.VectorType(fty, lanes)
            ivty = ir.VectorType(i32, lanes)
            mty = ir.VectorType(ir.IntType(1), lanes)
            sfx = "f32" if rty.dtype == types.float32 else "f64"
            align = context.get_abi_sizeof(fty)
            mod = builder.module
            fabs = cgutils.get_or_insert_function(
                mod, ir.FunctionType(vty, [vty]), f"llvm.fabs.v{lanes}{sfx}"
            )
            pack_i = cgutils.get_or_insert_function(
                mod,
                ir.FunctionType(ivty, [ivty, mty, ivty]),
                f"llvm.experimental.vector.compress.v{lanes}i32",
            )
            pack_f = cgutils.get_or_insert_function(
                mod,
                ir.FunctionType(vty, [vty, mty, vty]),
                f"llvm.experimental.vector.compress.v{lanes}{sfx}",
            )
            ctpop = cgutils.get_or_insert_function(
                mod, ir.FunctionType(iw, [iw]), f"llvm.ctpop.i{lanes}"
            )
            rdata = context.make_array(rty)(context, builder, r_).data
            udata = context.make_array(signature.args[1])(context, builder, u_).data
            edata = context.make_array(signature.args[4])(context, builder, ent_).data
            odata = context.make_array(signature.args[5])(context, builder, old_).data
            tv = _splat(builder, t_, vty)
            iota = ir.Constant(ivty, list(range(lanes)))
            kvar = cgutils.alloca_once_value(builder, k_)
            acc = cgutils.alloca_once_value(builder, ir.Constant(vty, None))

            def group(at):
                vptr = builder.bitcast(builder.gep(rdata, [at], inbounds=True), vty.as_pointer())
                v = builder.load(vptr, align=align)
                if add:
                    uptr = builder.bitcast(
                        builder.gep(udata, [at], inbounds=True), vty.as_pointer()
                    )
                    v = builder.fadd(v, builder.load(uptr, align=align))
                builder.store(builder.fadd(builder.load(acc), builder.fmul(v, v)), acc)
                hit = builder.fcmp_ordered(">=", builder.call(fabs, [v]), tv)
                bits = builder.bitcast(hit, iw)
                if add and not every:
                    builder.store(v, vptr, align=align)

                def take():
                    up = builder.fcmp_ordered(">=", v, tv)
                    step = builder.select(up, tv, builder.fneg(tv))
                    moved = builder.select(hit, builder.fsub(v, step), v)
                    builder.store(moved, vptr, align=align)
                    first = builder.add(builder.trunc(at, i32), ir.Constant(i32, 1))
                    idx = builder.add(_splat(builder, first, ivty), iota)
                    entry = builder.select(up, idx, builder.neg(idx))
                    kk = builder.load(kvar)
                    taken = builder.zext(builder.call(ctpop, [bits]), i64)
                    eptr = builder.gep(edata, [kk], inbounds=True)
                    optr = builder.gep(odata, [kk], inbounds=True)
                    packed_e = builder.call(pack_i, [entry, hit, ir.Constant(ivty, ir.Undefined)])
                    packed_o = builder.call(pack_f, [v, hit, ir.Constant(vty, ir.Undefined)])
                    _store_front(builder, packed_e, eptr, taken, 4)
                    _store_front(builder, packed_o, optr, taken, 4)
                    builder.store(builder.add(kk, taken), kvar)

                if every:
                    take()
                else:
                    with builder.if_then(
                        builder.icmp_unsigned("!=", bits, ir.Constant(iw, 0)), likely=False
                    ):
                        take()

            # branch-free variants: straight-line code; sparse ones: a loop (smaller code)
            if every:
                for q in range(size // lanes):
                    group(builder.add(pos_, ir.Constant(i64, q * lanes)))
            else:
                with cgutils.for_range(builder, ir.Constant(i64, size // lanes)) as loop:
                    group(builder.add(pos_, builder.mul(loop.index, ir.Constant(i64, lanes))))
            taken = builder.sub(builder.load(kvar), k_)
            return context.make_tuple(builder, ret, [taken, _hsum(builder, builder.load(acc))])

        return sig, codegen

    return superblock


def make_bitmap_superblock(add, size):  # pragma: no cover - runs while compiling
    """The intrinsic that (adds and) bitmap-encodes one superblock: ``size // 16`` words.

    Per element the same IEEE operations as :func:`gradshare.codec._kernels._bitmap_code`; the
    magnitude and sign bits of a word come straight from the vector compare masks.
    """

    @intrinsic
    def bitmap_superblock(typingctx, r, u, pos, t, words):
        for a in (r, u, words):
            if not (isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"):
                return None
        ret = types.Tuple((types.int64, r.dtype))
        sig = ret(r, u, types.int64, r.dtype, words)

        def codegen(context, builder, signature, args):
            r_, u_, pos_, t_, words_ = args
            rty = signature.args[0]
            fty = context.get_value_type(rty.dtype)
            lanes = _vector_bytes(context) // context.get_abi_sizeof(fty)
            lanes = min(lanes, 16)
            i32, i64, il = ir.IntType(32), ir.IntType(64), ir.IntType(lanes)
            vty = ir.VectorType(fty, lanes)
            sfx = "f32" if rty.dtype == types.float32 else "f64"
            align = context.get_abi_sizeof(fty)
            mod = builder.module
            fabs = cgutils.get_or_insert_function(
                mod, ir.FunctionType(vty, [vty]), f"llvm.fabs.v{lanes}{sfx}"
            )
            ctpop = cgutils.get_or_insert_function(
                mod, ir.FunctionType(il, [il]), f"llvm.ctpop.i{lanes}"
            )
            rdata = context.make_array(rty)(context, builder, r_).data
            udata = context.make_array(signature.args[1])(context, builder, u_).data
            wdata = context.make_array(signature.args[4])(context, builder, words_).data
            tv = _splat(builder, t_, vty)
            hv = builder.fmul(tv, ir.Constant(vty, [0.5] * lanes))
            zero = ir.Constant(vty, None)
            sent = cgutils.alloca_once_value(builder, ir.Constant(i64, 0))
            acc = cgutils.alloca_once_value(builder, zero)
            wbase = builder.sdiv(pos_, ir.Constant(i64, 16))
            with cgutils.for_range(builder, ir.Constant(i64, size // 16)) as loop:
                word = ir.Constant(i32, 0)
                for g in range(16 // lanes):
                    at = builder.add(
                        pos_,
                        builder.add(
                            builder.mul(loop.index, ir.Constant(i64, 16)),
                            ir.Constant(i64, g * lanes),
                        ),
                    )
                    vptr = builder.bitcast(
                        builder.gep(rdata, [at], inbounds=True), vty.as_pointer()
                    )
                    v = builder.load(vptr, align=align)
                    if add:
                        uptr = builder.bitcast(
                            builder.gep(udata, [at], inbounds=True), vty.as_pointer()
                        )
                        v = builder.fadd(v, builder.load(uptr, align=align))
                    a = builder.call(fabs, [v])
                    mag = builder.fcmp_ordered(">=", a, tv)
                    neg = builder.fcmp_ordered("<", v, zero)
                    sgn = builder.and_(neg, builder.fcmp_ordered(">=", a, hv))
                    step = builder.select(neg, builder.fneg(tv), tv)
                    hstep = builder.select(sgn, builder.fneg(hv), zero)
                    nv = builder.fsub(v, builder.select(mag, step, hstep))
                    builder.store(nv, vptr, align=align)
                    builder.store(builder.fadd(builder.load(acc), builder.fmul(nv, nv)), acc)
                    mbits = builder.bitcast(mag, il)
                    sbits = builder.bitcast(sgn, il)
                    n_sent = builder.zext(builder.call(ctpop, [builder.or_(mbits, sbits)]), i64)
                    builder.store(builder.add(builder.load(sent), n_sent), sent)
                    lo = builder.shl(builder.zext(mbits, i32), ir.Constant(i32, g * lanes))
                    hi = builder.shl(builder.zext(sbits, i32), ir.Constant(i32, 16 + g * lanes))
                    word = builder.or_(word, builder.or_(lo, hi))
                wptr = builder.gep(wdata, [builder.add(wbase, loop.index)], inbounds=True)
                builder.store(word, wptr, align=4)
            return context.make_tuple(
                builder, ret, [builder.load(sent), _hsum(builder, builder.load(acc))]
            )

        return sig, codegen

    return bitmap_superblock


@intrinsic
def fma(typingctx, a, b, c):  # pragma: no cover - runs while compiling
    """``a * b + c`` rounded once (``llvm.fma``: a fused multiply-add instruction where the
    CPU has one, else libm's exact ``fma``), as torch's CPU ``add(c, b, alpha=a)`` rounds it.
    All three of one float type."""
    if not (isinstance(a, types.Float) and a == b == c):
        return None
    sig = a(a, b, c)

    def codegen(context, builder, signature, args):
        fty = context.get_value_type(signature.args[0])
        sfx = "f32" if signature.args[0] == types.float32 else "f64"
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(fty, [fty, fty, fty]), f"llvm.fma.{sfx}"
        )
        return builder.call(fn, list(args))

    return sig, codegen


@intrinsic
def prefetch(typingctx, arr, index):  # pragma: no cover - runs while compiling
    """Hint the CPU to load ``arr[index]``'s cache line for a write soon (``llvm.prefetch``;
    nothing where it has no such instruction, and no fault for any index)."""
    if not (isinstance(arr, types.Array) and isinstance(index, types.Integer)):
        return None
    sig = types.void(arr, index)

    def codegen(context, builder, signature, args):
        a, i = args
        data = context.make_array(signature.args[0])(context, builder, a).data
        i8p = ir.IntType(8).as_pointer()
        ptr = builder.bitcast(builder.gep(data, [i]), i8p)
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0i8",
        )
        builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen
