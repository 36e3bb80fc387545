"""make_variants: turn the chunks a prefill computed in full into chunk-cache variants.

Their K/V come out of the request's KVCache (keys un-rotated to before RoPE); their metadata
(S_old, inter / intra attention per layer, per-token external scores, CCI: cache-craft.md §2)
from the attention statistics the forward collected over the prompt's spans.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

from cachecraft.model.kv import KVCache
from cachecraft.model.rope import Rope
from cachecraft.model.step import SeqResult
from cachecraft.reuse.plan import RecomputePlan
from cachecraft.reuse.stats import cci
from cachecraft.store.meta import VariantMeta
from cachecraft.store.variant import Variant


def make_variants(
    plan: RecomputePlan,
    rows: torch.Tensor,
    kv: KVCache,
    result: SeqResult,
    rope: Rope,
    storage_dtype: torch.dtype,
    chunks: Collection[int],
    measured: bool = True,
    layers: tuple[int, ...] | None = None,
) -> list[Variant]:
    """One variant per chunk index in `chunks` (each computed in full). Spans: 0 = prefix,
    i + 1 = chunk i, last = question; `rows` [n] are the computed positions behind
    result.row_span_mass; `layers`: the layers the statistics were measured at (None: all).

    measured=False (`prefix` mode, which reuses only exact variants and so never reads their
    statistics): no statistics were collected; the metadata is the conservative "unmeasured"
    form (zero masses, CCI 1.0), so another mode that finds such a variant recomputes the most.
    """
    if measured and (result.span_mass_layers is None or result.row_span_mass is None):
        return []
    layout = plan.layout
    num_layers = kv.k.shape[0]
    every = tuple(range(num_layers))
    layers = every if layers is None else tuple(layers)
    span_mass = result.span_mass_layers[list(layers)].tolist() if measured else None  # [L'][S][S]
    stats_layers = () if layers == every or not measured else layers  # (): every layer
    out = []
    for i, cp in enumerate(plan.chunks):
        if cp.variant is not None or i not in chunks:
            continue
        slot, n = cp.slot, cp.slot.num_tokens
        earlier = plan.chunks[:i]
        sizes = tuple(c.slot.num_tokens for c in earlier)
        positions = torch.arange(slot.start, slot.end, device=kv.k.device)
        keys = rope.unrotate(kv.k[:, :, slot.start : slot.end], positions).to(storage_dtype)
        values = kv.v[:, :, slot.start : slot.end].to(storage_dtype, copy=True)
        if span_mass is None:  # statistics not collected: placeholder metadata (CCI 1)
            inter = tuple((0.0,) * num_layers for _ in earlier)
            intra: tuple[float, ...] = (0.0,) * num_layers
            token_scores: tuple[float, ...] = (0.0,) * n
            impact = 1.0
        else:
            inter = tuple(
                tuple(layer[i + 1][j + 1] for layer in span_mass) for j in range(len(earlier))
            )
            intra = tuple(layer[i + 1][i + 1] for layer in span_mass)
            in_chunk = (rows >= slot.start) & (rows < slot.end)
            # mass on earlier chunks
            token_scores = tuple(result.row_span_mass[in_chunk][:, 1 : i + 1].sum(-1).tolist())
            impact = cci(inter, intra, sizes, n)
        meta = VariantMeta(
            chunk_key=slot.key,
            prefix_key=layout.prefix_key,
            s_old=tuple(c.slot.key for c in earlier),
            s_old_sizes=sizes,
            num_tokens=n,
            num_layers=num_layers,
            inter=inter,
            intra=intra,
            token_scores=token_scores,
            cci=impact,
            is_exact=cp.is_exact,
            stats_layers=stats_layers,
        )
        out.append(Variant(meta, keys, values))
    return out
