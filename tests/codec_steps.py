"""Every codec step once, on the path in force: for comparing the kernels with the torch ops
across processes (``GRADSHARE_KERNELS=0`` is read at import)."""

from __future__ import annotations

import torch

from gradshare import codec


def run_steps() -> list[torch.Tensor]:
    """Messages, residuals and sums of sparse, bounded, bitmap and mean-magnitude encodes,
    decodes small and large, fused sums, validation, take_update_, subtract_, decay_add_
    and decay_into_ in the forms LocalSteps calls, step_sum_, find_nonfinite, and the compact
    form there and back."""
    out: list[torch.Tensor] = []
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(0)
        x = (torch.randn(3 * 65536 + 77, generator=g) * 1e-3).to(dtype)
        x[65536 : 65536 + 30000] *= 40
        messages = []
        for encode in (
            lambda r: codec.encode_sparse_(r, 1e-3),
            lambda r: codec.encode_sparse_(r, 1e-3, 5000),
            lambda r: codec.encode_bitmap_(r, 1e-3),
            lambda r: codec.encode_sparse_(r, 1e-3, magnitude="mean"),
            lambda r: codec.encode_bitmap_(r, 1e-3, magnitude="mean"),
        ):
            r = x.clone()
            m = encode(r)
            assert m is not None
            messages.append(m)
            out += [m, r]
        small = codec.encode_sparse_(x[:1000].clone(), 1e-3)
        assert small is not None
        for m in (small, messages[0], messages[2]):  # small sparse, large sparse, bitmap
            codec.check_message(m, m[1].item())
            out.append(codec.decode_(m, torch.ones(int(m[1]), dtype=dtype)))
        total = torch.empty_like(x)
        codec.decode_sum_([messages[0], None, messages[2]], total, divisor=3)
        params = x.clone() + 1
        codec.subtract_sum_(messages[:2], params, torch.zeros_like(x), divisor=4)
        update = torch.empty_like(x)
        codec.take_update_(x + 1, x, update)
        delta = torch.empty_like(x)
        codec.subtract_(x + 1, x * 0.5, delta, plus=x * 3)
        kept = torch.empty_like(x)
        decayed = x.clone()
        codec.decay_add_(decayed, 0.95, kept, x + 1, x * 0.5, plus=x * 3, out=delta.clone())
        out += [delta, kept, decayed]
        # the forms LocalSteps calls: no overlap, τ < H (carry, send point), the lead (Δ kept)
        for plus, delta_out, copy in (
            (None, None, None),
            (x * 3, None, torch.empty_like(x)),
            (x * 3, torch.empty_like(x), None),
        ):
            into, sampled = (
                torch.empty_like(x),
                torch.empty(len(range(5, x.numel(), 64)), dtype=dtype),
            )
            codec.decay_into_(
                x,
                0.95,
                into,
                x + 1,
                x * 0.5,
                plus=plus,
                out=delta_out,
                sample=(sampled, 5, 64),
                copy=copy,
            )
            out += [into, sampled] + ([] if copy is None else [copy])
        for plus, copy in ((None, None), (x * 3, torch.empty_like(x))):  # fragments
            codec.decay_add_(
                decayed,
                0.95,
                kept,
                x + 1,
                x * 0.5,
                plus=plus,
                copy=copy,
                sample=(torch.empty(x.numel(), dtype=dtype), 0, 1),
            )
        carried, local = x.clone(), x * 0.5
        codec.subtract_(carried, local, carried, then=x + 1)  # a merge's carry and take
        out += [carried, local]
        for sent, world in ((messages[:1], 1), ([messages[0], messages[3]], 3)):
            stepped = x.clone()
            codec.step_sum_(
                sent, stepped, torch.zeros_like(x, dtype=torch.float32), lr=2.8, divisor=world
            )
            out.append(stepped)
        y = x.clone()
        y[[7, 70000]] = float("nan")
        small_form = codec.compact_message(messages[0])
        assert int(small_form[3]) == codec.COMPACT_ENCODING
        out += [small_form, codec.expand_message(small_form, x.numel())]
        out += [total, params, update, torch.tensor(codec.find_nonfinite(y))]
    return out
