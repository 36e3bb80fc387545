"""Our Llama-family forward (Llama 2/3, SmolLM, Mistral, Qwen2) with explicit positions.

One primitive, `step`, runs any mix of sequences: each SeqWork gives the rows (positions) it
computes over its own KVCache. A full prefill computes 0..n-1 on an empty cache; a partial
prefill computes a subset over a spliced cache; a decode step computes one row. Linear layers
run on all rows of all sequences at once; attention runs per SeqWork with an exact mask, and
once per layer for all rows of a DecodeBatch (plain decodes over a KVPool, model/decode.py).
`forward_step(works)` is `step(works)` without a batch.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from cachecraft.errors import ContextLengthError
from cachecraft.model.arch import ModelArch
from cachecraft.model.attention import attention_key_mass, causal_attention
from cachecraft.model.decode import DecodePlan, attend_decode, plan_decode
from cachecraft.model.linear import Linear, can_pack, packed_is_faster
from cachecraft.model.mlp import Mlp
from cachecraft.model.rope import Rope
from cachecraft.model.row_kernel import load_row_kernel
from cachecraft.model.rows import StepRows
from cachecraft.model.step import DecodeBatch, LayerView, SeqResult, SeqWork, StepOutput

PLAIN_COPY_MAX_BYTES = 1 << 30
"""Packed models whose linear weights take at most this much keep their plain weights too,
for the products those are faster at (fp32: one or two rows; bf16: long prefills;
model/linear.py): SmolLM2-135M's 0.40 GiB, not a 7B model's 26 GiB."""


TIME_SHORT_PRODUCTS_BYTES = 64 << 20
"""fp32 models whose linear weights take at least this much time their one- and two-row
products with both weights at load (`linear.packed_is_faster`, well under a second for the
bundled model) and keep the plain copies only where those are faster. Smaller ones stay in the CPU's caches, where
a timing says nothing about a decode step that reads its weights from memory (and the test
models' products then never change from one load to the next)."""


ROW_ALIGN_BF16 = 32
"""bf16 on oneDNN: a step's products run on its row count rounded up to a multiple of this
(from this many rows on; the extra rows are never read). oneDNN builds a kernel for every new
row count, and in bf16 (AMX) building one costs several times the product itself, so a
request whose row counts were never seen pays for them at its first layers (a reused request
twice: its check rows stop early). Rounded, the counts repeat. The engine builds the kernels
of every aligned count up to its token budget before its first step (`warm_kernels`), so no
request pays for them. float32's products build their kernels in a small fraction of a
product's time, so float32 runs its rows as they are (figures: docs/performance.md)."""


class LayerWeights(NamedTuple):
    """A layer's products. The two RMSNorm weights are folded into the products that read
    their output (W diag(w): qkv carries input_layernorm's, the MLP's gate and up carry
    post_attention_layernorm's), so a layer's norms are `_normalize` alone: one pass over the
    rows less each."""

    qkv: Linear  # [(H + 2 Hkv) D, hidden] (+ bias for Qwen2)
    o: Linear  # [hidden, H D]
    mlp: Mlp  # gate and up [2 I, hidden], down [hidden, I]


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps), the mean in fp32. The sum of squares comes from one
    reduction (`vector_norm`, squared again on the [n, 1] result) rather than a squared copy
    of x and its mean; the result differs from that form by float rounding (~4e-7 relative)."""
    xf = x.float()
    inv = torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_()
    inv = inv.div_(x.shape[-1]).add_(eps).rsqrt_()
    return (xf * inv).to(x.dtype)


def _linear_bytes(state_dict: dict[str, torch.Tensor], dtype: torch.dtype, tied: bool) -> int:
    """Bytes of the linear layers' weights (the head's when untied) once cast to `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    names = [n for n in state_dict if n.endswith("_proj.weight")]
    if not tied:
        names.append("lm_head.weight")
    return size * sum(state_dict[n].numel() for n in names)


def _may_stop(states: list[StepRows]) -> bool:
    """Can any row stop before the top layer (a per-row last layer, or a hook that may stop
    rows)?"""
    return any(s.work.last_layer is not None or s.work.hooks for s in states)


def _put_rows(cache: torch.Tensor, pos: torch.Tensor, x: torch.Tensor) -> None:
    """cache[:, pos] = x at scattered positions pos [n]; cache [Hkv, capacity, D] may view
    keys stored transposed ([Hkv, D, capacity] memory, a pool slot's): the rows then go in as
    columns of that memory, from a transposed copy of x (index_put through the transposed
    view scatters across the grain and is several times slower)."""
    if cache.stride(1) == 1 and cache.stride(2) != 1:
        cache.transpose(1, 2)[:, :, pos] = x.transpose(1, 2).to(cache.dtype).contiguous()
    else:
        cache[:, pos] = x.to(cache.dtype)


class LlamaModel:
    """Weights and forward of one Llama-family model on one device and dtype."""

    def __init__(
        self,
        arch: ModelArch,
        hf_config: Any,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        pack: bool = True,
        row_align: int | None = None,
        row_kernel: bool = True,
    ) -> None:
        """pack: pack the linear weights for oneDNN where it runs (model/linear.py).
        row_align: products run on row counts rounded up to a multiple of it (None:
        ROW_ALIGN_BF16 for packed bf16, else 1, i.e. as they are).
        row_kernel: float32 attention on a CPU through our kernel where it can be built
        (model/row_kernel.py); torch's SDPA otherwise or when False."""
        self.arch = arch
        self.dtype = dtype
        self.device = torch.device(device)
        self.rope = Rope(hf_config, arch.head_dim, self.device)
        use_kernel = row_kernel and dtype == torch.float32 and self.device.type == "cpu"
        self.row_kernel = load_row_kernel() if use_kernel else None

        def get(name: str, norm: str | None = None) -> torch.Tensor:
            """The weight `name`; with `norm`, times that RMSNorm's weight per input column
            (folded in fp32, then cast once)."""
            w = state_dict[name]
            if norm is not None:
                w = w.float() * state_dict[norm].float()[None, :]
            return w.to(device=self.device, dtype=dtype).contiguous()

        pack = pack and can_pack(dtype, self.device)
        if row_align is None:
            row_align = ROW_ALIGN_BF16 if pack and dtype == torch.bfloat16 else 1
        if row_align < 1:
            raise ValueError(f"row_align must be >= 1, got {row_align}")
        self.row_align = row_align
        self._warm_rows = 0  # `warm_kernels` ran every aligned count up to this
        self.embed = get("model.embed_tokens.weight")
        self.norm = get("model.norm.weight")
        tied = arch.tie_word_embeddings or "lm_head.weight" not in state_dict
        plain = pack and _linear_bytes(state_dict, dtype, tied) <= PLAIN_COPY_MAX_BYTES
        if tied:  # packs a copy: embed stays, so its plain copy costs nothing
            self.lm_head = Linear(self.embed, None, pack, keep_plain=pack)
        else:
            self.lm_head = Linear(get("lm_head.weight"), None, pack, keep_plain=plain)
        self.layers: list[LayerWeights] = []
        for i in range(arch.num_layers):
            p = f"model.layers.{i}."
            att = p + "self_attn."
            bias = None
            if arch.attention_bias:
                bias = torch.cat([get(att + f"{x}_proj.bias") for x in "qkv"])
            ln1, ln2 = p + "input_layernorm.weight", p + "post_attention_layernorm.weight"
            qkv = torch.cat([get(att + f"{x}_proj.weight", ln1) for x in "qkv"])
            gate_up = torch.cat(
                [get(p + "mlp.gate_proj.weight", ln2), get(p + "mlp.up_proj.weight", ln2)]
            )
            self.layers.append(
                LayerWeights(
                    qkv=Linear(qkv, bias, pack, plain),
                    o=Linear(get(att + "o_proj.weight"), None, pack, plain),
                    mlp=Mlp(gate_up, get(p + "mlp.down_proj.weight"), pack, plain),
                )
            )
        size = _linear_bytes(state_dict, dtype, tied)
        if plain and dtype == torch.float32 and size >= TIME_SHORT_PRODUCTS_BYTES:
            linears = self.linears()
            if packed_is_faster(linears):
                for lin in linears:
                    lin.pack_only()

    def linears(self) -> list[Linear]:
        """Every Linear of a decode step, in its order: each layer's, then the head's."""
        out = []
        for w in self.layers:
            out += [w.qkv, w.o]
            if w.mlp.gate_up is not None and w.mlp.down is not None:
                out += [w.mlp.gate_up, w.mlp.down]
        return [*out, self.lm_head]

    def forward_step(self, works: list[SeqWork]) -> list[SeqResult]:
        """Run every layer for the rows of each SeqWork, writing their fresh K/V into its cache."""
        return self.step(works).results

    @torch.inference_mode()
    def step(self, works: list[SeqWork], decode: DecodeBatch | None = None) -> StepOutput:
        """`forward_step` plus the rows of `decode`, all through one pass over the weights.
        Rows in h: every SeqWork's rows in order, then the decode rows sorted by slot."""
        arch = self.arch
        num_spans = [0 if w.span_bounds is None else w.span_bounds.shape[0] for w in works]
        states = [
            StepRows(w, arch.num_layers, s, self.rope)
            for w, s in zip(works, num_spans, strict=True)
        ]
        for w in works:
            top = int(w.positions[-1]) + 1
            if top > arch.max_position_embeddings:
                raise ContextLengthError(top, arch.max_position_embeddings)
            w.kv.ensure_capacity(top)
            w.kv.length = max(w.kv.length, top)
        ids = [w.token_ids for w in works]
        dplan = None
        num_decode = 0
        tables: list[tuple[torch.Tensor, torch.Tensor]] = []  # decode rows' RoPE tables
        if decode is not None and decode.caches:
            dplan = plan_decode(decode, arch.sliding_window, arch.max_position_embeddings)
            dids = decode.token_ids.to(self.device)
            dids = dids if dplan.order is None else dids[dplan.order]
            ids.append(dids)
            num_decode = dids.shape[0]
            tables.append(self.rope.cos_sin(dplan.positions, self.dtype))
        # h: the real rows, then copies of row 0 up to an aligned count (`_aligned`).
        h = F.embedding(self._aligned(torch.cat(ids).to(self.device)), self.embed)
        # RoPE tables of every row of every sequence: [N, 1, D], one rotation per layer.
        cos, sin = self._tables(states, tables)
        loaders = [w.before_layer for w in works if w.before_layer is not None]
        for layer_idx, weights in enumerate(self.layers):
            for fill in loaders:
                fill(layer_idx)
            compacted = self._compact(h, states, layer_idx, num_decode)
            if compacted is not None:
                h = compacted
                cos, sin = self._tables(states, tables)
            h = self._layer(h, states, layer_idx, weights, cos, sin, dplan)
        return self._finish(h, states, dplan, num_decode)

    @torch.inference_mode()
    def warm_kernels(self, max_rows: int) -> int:
        """Run one layer's products once at every aligned row count up to `max_rows` (a
        step's most rows), so that oneDNN builds their kernels now rather than in the first
        requests that reach each count (ROW_ALIGN_BF16); a no-op when rows are not aligned
        or the counts were warmed already. oneDNN keys its kernels by thread count too: call
        it on the thread that will step (engine/engine.py). Returns the row counts warmed."""
        align = self.row_align
        if align == 1:
            return 0
        counts = range(align * (self._warm_rows // align + 1), max_rows + 1, align)
        w = self.layers[0]
        hidden = self.embed.shape[1]
        attn_width = self.arch.num_heads * self.arch.head_dim
        for n in counts:
            x = torch.zeros((n, hidden), dtype=self.dtype, device=self.device)
            w.qkv(x)
            w.mlp(x, x + w.o(x.new_zeros((n, attn_width))))
        self._warm_rows = max(self._warm_rows, max_rows)
        return len(counts)

    def _aligned(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n] (token ids or row indexes) followed by copies of rows[0] up to n rounded
        up to a multiple of row_align (from row_align rows on): the products of a step then
        see few distinct row counts (ROW_ALIGN_BF16). The extra rows are computed by the
        row-wise products alone and never read."""
        n, align = rows.shape[0], self.row_align
        if align == 1 or n < align or n % align == 0:
            return rows
        return torch.cat([rows, rows[:1].expand(align - n % align)])

    @staticmethod
    def _tables(
        states: list[StepRows], tables: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = torch.cat([s.cos for s in states] + [t[0] for t in tables])[:, None]
        sin = torch.cat([s.sin for s in states] + [t[1] for t in tables])[:, None]
        return cos, sin

    def _compact(
        self, h: torch.Tensor, states: list[StepRows], layer_idx: int, num_decode: int
    ) -> torch.Tensor | None:
        """Drop rows whose last layer is below `layer_idx` (they keep their given K/V above);
        None when every row goes on. The `num_decode` decode rows (after the states' rows)
        always go on; the result is aligned again (`_aligned`)."""
        if not _may_stop(states):
            return None  # nothing can have stopped: skip the per-sequence checks
        parts: list[torch.Tensor] = []
        start, changed = 0, False
        for s in states:
            n = s.num_rows
            keep = s.compact(layer_idx)  # the host knows how many go on: no read-back
            changed |= keep is not None
            parts.append(
                torch.arange(start, start + n, device=h.device) if keep is None else keep + start
            )
            start += n
        if not changed:
            return None
        parts.append(torch.arange(start, start + num_decode, device=h.device))
        return h[self._aligned(torch.cat(parts))]

    def _layer(
        self,
        h: torch.Tensor,
        states: list[StepRows],
        layer_idx: int,
        w: LayerWeights,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dplan: DecodePlan | None = None,
    ) -> torch.Tensor:
        arch = self.arch
        nh, nkv, hd = arch.num_heads, arch.num_kv_heads, arch.head_dim
        num_rows = cos.shape[0]  # h's real rows; the rest is alignment (`_aligned`)
        x = _normalize(h, arch.rms_norm_eps)  # input_layernorm's weight is in qkv
        qkv = w.qkv(x)[:num_rows]
        # Rotate the queries and keys of all rows at once: [N, H + Hkv, D].
        qk = Rope.apply(qkv[:, : (nh + nkv) * hd].view(num_rows, nh + nkv, hd), cos, sin)
        vals = qkv[:, (nh + nkv) * hd :].view(num_rows, nkv, hd)
        attn = torch.empty((h.shape[0], nh * hd), dtype=h.dtype, device=h.device)
        attn[num_rows:] = 0
        start = 0
        for s in states:
            n = s.positions.shape[0]
            if n == 0:
                continue
            q = qk[start : start + n, :nh].transpose(0, 1)
            k = qk[start : start + n, nh:].transpose(0, 1)
            v = vals[start : start + n].transpose(0, 1)
            self._attend(s, layer_idx, q, k, v, attn[start : start + n].view(n, nh, hd))
            start += n
        if dplan is not None:  # the decode rows: [B, H, D] queries, [B, Hkv, D] keys/values
            q, k, v = qk[start:, :nh], qk[start:, nh:], vals[start:]
            attn[start:num_rows] = attend_decode(dplan, layer_idx, q, k, v)
        # Rows that stop here (their K/V at this layer are all they give) skip the rest of
        # the layer; their h stays stale and is never read (compacted away, or no logits).
        rows = self._going_on(states, layer_idx, num_rows)
        if rows is None:
            return self._mlp(h, attn, w)
        if rows.numel():
            take = self._aligned(rows)
            h.index_copy_(0, rows, self._mlp(h[take], attn[take], w)[: rows.numel()])
        return h

    def _mlp(self, h: torch.Tensor, attn: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        """The rest of a layer after attention: o-proj, residual, norm, MLP, residual."""
        h = h + w.o(attn)
        x = _normalize(h, self.arch.rms_norm_eps)  # post_attention_layernorm's is in the MLP
        return w.mlp(x, h)

    def _going_on(
        self, states: list[StepRows], layer_idx: int, num_rows: int
    ) -> torch.Tensor | None:
        """Indexes into this layer's rows of those whose output of this layer is read: rows
        computed at the next layer, and at the top layer the rows logits are asked for (and
        every decode row, after the states' rows). None: all of them. A full prefill skips the
        top layer's o-proj and MLP for every row but its last; a check or early exit, a layer
        of it for every row it stops."""
        top = self.arch.num_layers - 1
        if not states:
            return None  # decode rows only: every one wants its logits
        if layer_idx < top and not _may_stop(states):
            return None  # nothing can stop before the top layer
        parts: list[torch.Tensor] = []
        start = 0
        for s in states:
            n = s.num_rows
            keep = s.going_on(layer_idx) if layer_idx < top else self._wants_logits(s)
            parts.append(keep + start)
            start += n
        parts.append(torch.arange(start, num_rows, device=self.device))  # decode rows
        rows = torch.cat(parts)
        return None if rows.numel() == num_rows else rows

    def _wants_logits(self, s: StepRows) -> torch.Tensor:
        """Indexes among the rows of `s` still computed of those whose logits its work asks
        for. Rows ascend, so the work's last row, when still computed, is the last one (and
        `_finish` fails a work whose asked-for rows stopped)."""
        mode, n = s.work.logits_for, s.num_rows
        if mode == "all":
            return torch.arange(n, device=self.device)
        if mode == "last" and n:
            return torch.arange(n - 1, n, device=self.device)
        return torch.zeros(0, dtype=torch.long, device=self.device)

    def _attend(
        self,
        s: StepRows,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Write the fresh (rotated) K/V at the rows' positions, attend: q [H, n, D], the
        output into out [n, H, D]."""
        work, pos = s.work, s.positions
        kv_k, kv_v = work.kv.k[layer_idx], work.kv.v[layer_idx]
        hook = work.hooks.get(layer_idx)
        k_old = v_old = None
        if hook is not None and work.hooks_need_old:
            k_old, v_old = kv_k[:, pos].clone(), kv_v[:, pos].clone()
        last = s.last  # known on the host; after rows stopped an upper bound (masked past)
        if s.is_contiguous:
            assert s.first is not None
            kv_k[:, s.first : last + 1] = k.to(kv_k.dtype)
            kv_v[:, s.first : last + 1] = v.to(kv_v.dtype)
        else:
            _put_rows(kv_k, pos, k)
            _put_rows(kv_v, pos, v)
        keys = kv_k[:, : last + 1].to(q.dtype)
        if keys.stride(-1) != 1 and self.row_kernel is None:
            # a pool slot's keys are stored transposed: one contiguous copy here is cheaper
            # than SDPA reading them strided; the kernel copies them transposed anyway
            keys = keys.contiguous()
        values = kv_v[:, : last + 1].to(q.dtype)
        window = self.arch.sliding_window
        wants_stats = work.span_bounds is not None and layer_idx in s.stats_at and s.has_stats_rows
        onehot = s.onehot if wants_stats else None
        meter = work.meter
        mplan = None
        if meter is not None and meter.first_layer <= layer_idx <= meter.last_layer:
            mplan = s.metered(window, q.shape[0], k.shape[0])
        if mplan is not None:
            assert meter is not None
            res, key_mass = attention_key_mass(q, keys, values, mplan)
            out.copy_(res.transpose(0, 1))
            s.add_key_mass(key_mass[: meter.start])
            mass = None
        else:
            kernel = self.row_kernel
            plan = None if kernel is not None else s.plan(window, q.dtype)
            _, mass = causal_attention(q, keys, values, pos, window, onehot, plan, out, kernel)
        if mass is not None:
            s.collect(layer_idx, mass)
        if hook is not None:
            view = LayerView(layer_idx, pos, q, k, v, k_old, v_old, keys, window)
            keep = hook(view)
            if keep is not None:
                s.stop(keep, layer_idx, getattr(hook, "num_kept", None))

    def _finish(
        self, h: torch.Tensor, states: list[StepRows], dplan: DecodePlan | None, num_decode: int
    ) -> StepOutput:
        """Logits of the rows each sequence asked for, and of the `num_decode` decode rows,
        through ONE lm_head product for all sequences (the head is the largest matrix:
        reading it once per sequence would cost a decode step more than its layers)."""
        picks: list[torch.Tensor] = []
        counts: list[int] = []
        start = 0
        top = self.arch.num_layers - 1
        for s in states:
            n = s.positions.shape[0]
            mode = s.work.logits_for
            total = s.work.positions.shape[0]
            if mode == "none":
                want: list[int] = []
            elif mode == "last":
                want = [total - 1]
            else:
                want = list(range(total))
            if n == total:  # no row stopped early: row i is still at offset i
                where = want
            else:
                at = {int(i): j for j, i in enumerate(s.index.tolist())}
                missing = [i for i in want if i not in at]
                if missing:
                    raise ValueError(
                        f"logits asked for rows {missing} that stopped before layer {top}"
                    )
                where = [at[i] for i in want]
            picks.append(torch.tensor(where, dtype=torch.long, device=h.device) + start)
            counts.append(len(want))
            start += n
        if num_decode:
            picks.append(torch.arange(start, start + num_decode, device=h.device))
            counts.append(num_decode)
        rows = torch.cat(picks)
        x = self.norm * _normalize(h[self._aligned(rows)], self.arch.rms_norm_eps)
        # results go back to the host: sampling and planning read them there
        logits = self.lm_head(x)[: rows.shape[0]].float().cpu().split(counts)
        results = []
        for s, seq_logits in zip(states, logits[: len(states)], strict=True):
            row_mass = None
            if s.mass_rows is not None and s.row_layers is not None:
                row_mass = s.mass_rows / s.row_layers.clamp(min=1)[:, None]
            found = (s.final_last_layer, s.mass_layers, row_mass)
            last, *stats = (None if t is None else t.cpu() for t in found)
            assert last is not None
            results.append(SeqResult(seq_logits, last, *stats, s.key_mass()))
        decode_logits = None
        if dplan is not None:
            decode_logits = logits[-1]
            if dplan.order is not None:  # back from slot order to the batch's row order
                decode_logits = torch.empty_like(decode_logits).index_copy_(
                    0, dplan.order.cpu(), decode_logits
                )
        return StepOutput(results, decode_logits)
