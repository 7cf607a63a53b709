"""Llama / Qwen2 / Qwen3 decoder as a plain nn.Module (parameter names as Hugging Face's).

No serving logic: the module maps flat token ids to hidden states and reads/writes K/V only
through the `attention` callable the runner passes in (paged attention over the KV cache).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from disagg.engine.fused_ops import FusedOps
from disagg.engine.linear import PackedLinear, concat_linears, to_packed
from disagg.engine.model_spec import ModelSpec
from disagg.engine.rope import rotate

__all__ = ["AttentionFn", "CausalLM"]

_VOCAB_SLICE_ROWS = 2048  # see CausalLM.compute_logits

# (layer index, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> attention output [N, Hq, D]
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused: FusedOps | None = None  # set by CausalLM.prepare_for_inference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm: in fp32 the reference's math; in bf16/fp16 it normalizes in fp32 and
        # rounds once, where the reference rounds before the weight multiply too (measured: as
        # close to an fp32 result as the reference is, and ~20% faster than the reference's
        # eight separate calls on CPU, where rms_norm is itself a composite op).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual stream's add and the norm after it,
        in one pass where the fused kernel runs (the sum rounded to the stream's dtype first,
        as torch's add rounds it)."""
        if self.fused is not None:
            return self.fused.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self(summed), summed


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        hidden, d = spec.hidden_size, spec.head_dim
        bias = spec.has_qkv_bias
        self.q_proj = nn.Linear(hidden, spec.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(hidden, spec.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(hidden, spec.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(spec.num_heads * d, hidden, bias=spec.has_o_bias)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps) if spec.has_qk_norm else None
        self.k_norm = RMSNorm(d, spec.rms_norm_eps) if spec.has_qk_norm else None
        self.qkv_proj: nn.Module | None = None  # q|k|v in one GEMM, set by fuse()

    def fuse(self) -> None:
        self.qkv_proj = concat_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        kv_width = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv_width, kv_width], -1)
        return q, k, v

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionFn
    ) -> torch.Tensor:
        """cos, sin: the step's tables from rope.rope_tables."""
        n, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.qkv_proj is not None and self.q_norm is None:
            # q and k sit side by side in the fused output: one rotation for both.
            qkv = self.qkv_proj(x)
            qk = rotate(qkv[:, : (hq + hkv) * d].unflatten(-1, (hq + hkv, d)), cos, sin)
            q, k, v = qk[:, :hq], qk[:, hq:], qkv[:, (hq + hkv) * d :].unflatten(-1, (hkv, d))
        else:
            q, k, v = (t.unflatten(-1, (-1, d)) for t in self._qkv(x))
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)  # Qwen3: per-head norm before RoPE
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = attention(self.layer_index, q, k, v)  # [N, Hq, D]
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate|up in one GEMM, set by fuse()
        self.fused: FusedOps | None = None  # SiLU x up in one pass, set by prepare_for_inference

    def fuse(self) -> None:
        self.gate_up_proj = concat_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate_up = self.gate_up_proj(x)
        if self.fused is not None:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the embedding
        for the first layer, whose stream is None). Returns (this layer's output, the stream):
        the add waits for the next norm, so add and norm run as one op."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h, residual = self.post_attention_layernorm.add_and_norm(
            self.self_attn(h, cos, sin, attention), residual
        )
        return self.mlp(h), residual


class Backbone(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = Backbone(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] flat tokens of every scheduled request
        cos: torch.Tensor,  # [N, D]
        sin: torch.Tensor,  # [N, D]
        attention: AttentionFn,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [N, hidden]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, attention)
        if residual is None:  # no layers
            return self.model.norm(x)
        return self.model.norm.add_and_norm(x, residual)[0]

    def prepare_for_inference(self, pack: bool, fused: FusedOps | None = None) -> None:
        """After load_weights: fuse q/k/v and gate/up into one projection each, and with `pack`
        (CPU with oneDNN) hold every projection's weight pre-reordered (see linear.py). The
        vocabulary projection gets its own packed copy of a tied embedding table (+vocab x
        hidden elements of memory: 57 MB at bf16 for SmolLM2) so the lookup table stays plain.
        `fused`: the CPU kernels for add + norm and SiLU x up (fused_ops.py), or None."""
        for module in self.modules():
            if isinstance(module, RMSNorm | MLP):
                module.fused = fused
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
            if pack:
                for parent in (layer.self_attn, layer.mlp):
                    for name, child in list(parent.named_children()):
                        if isinstance(child, nn.Linear):
                            setattr(parent, name, to_packed(child))
        if pack:
            self.lm_head = to_packed(self.lm_head)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Only the rows that sample go through the vocabulary projection (the largest matmul
        of a small model); fp32 out, so sampling sees the same numbers in every dtype.

        On CPU without a packed weight a batch of rows runs against the weight in slices: for a
        few rows against a 49k x 576 weight, one MKL GEMM takes ~1.5x as long as the same work
        in 2048-row slices (measured at batch 4-32; no gain at batch 1; GPUs want one GEMM)."""
        plain = isinstance(self.lm_head, nn.Linear)
        if not plain or hidden.device.type != "cpu" or hidden.shape[0] < 2:
            return self.lm_head(hidden).float()  # [num_sampled, vocab]
        slices = self.lm_head.weight.split(_VOCAB_SLICE_ROWS)
        return torch.cat([F.linear(hidden, w) for w in slices], dim=-1).float()

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        if isinstance(self.lm_head, PackedLinear):
            raise RuntimeError("load_weights must come before prepare_for_inference")
        if self.spec.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
        elif "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
            raise ValueError("checkpoint has no lm_head.weight and does not tie embeddings")
        missing, unexpected = self.load_state_dict(weights, strict=False)
        missing = [
            m for m in missing if not (self.spec.tie_word_embeddings and m == "lm_head.weight")
        ]
        unexpected = [u for u in unexpected if "rotary_emb" not in u]
        if missing or unexpected:
            raise ValueError(
                f"checkpoint mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
