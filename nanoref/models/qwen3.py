"""Qwen3 (dense) in the flat layout: every tensor is (N, ...) with N the step's tokens.

Nothing here knows about sequences or batches: norms, projections and the MLP act per token, and
attention finds sequence boundaries in the step's `Context`. Differences from Llama worth noticing:
q_norm and k_norm (an RMSNorm over each head's vector, before RoPE), and no bias in q/k/v by default.
config.json's fields are parsed in `configs.py` (`Qwen3Config`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nanoref.layers.activation import SiluAndMul
from nanoref.layers.attention import Attention
from nanoref.layers.embed_head import LMHead, VocabEmbedding
from nanoref.layers.layernorm import RMSNorm, rms_norm_cuda
from nanoref.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from nanoref.layers.rotary import RotaryEmbedding, apply_rotary, norm_rotary_qk_cuda
from nanoref.models.configs import Qwen3Config
from nanoref.utils.seams import seam
from nanoref.utils.tracing import trace, trace_layer


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=config.attention_bias,
        )
        # this rank's heads: all of them on one device; under tensor parallelism a 1/N share (layers/linear.py)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_bias, name="o_proj"
        )
        self.rotary_emb = rotary_emb  # one table shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # (N, (H + 2 Hk) * D) = [q | k | v]
        q, k = self.norm_rotary(positions, qkv)  # (N, H, D), (N, Hk, D)
        v = qkv[:, self.q_size + self.kv_size :].view(-1, self.num_kv_heads, self.head_dim)  # (N, Hk, D), a view
        trace("qkv_proj", hidden=hidden, qkv=qkv, q=q, k=k, v=v)
        out = self.attn(q, k, v)  # (N, H, D)
        return self.o_proj(out.flatten(1, 2))  # (N, H * D) -> (N, hidden)

    def norm_rotary(self, positions: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Qwen3's per-head RMSNorm of q and k, then RoPE. qkv (N, (H + 2 Hk) * D) -> q (N, H, D), k (N, Hk, D).

        Readable version (below): q_norm and k_norm, each an RMSNorm over one head's D channels, then
        `rotary_emb` rotates both by each token's position. Fused version (`_norm_rotary_qk`): the same math
        on the query and key heads side by side in one pass, read from `qkv`; it is the one that runs, unless an
        exercise seam replaced rms_norm or apply_rotary (a learner's function then runs in the modules).
        """
        if (
            seam("rms_norm", rms_norm_cuda) is not rms_norm_cuda
            or seam("apply_rotary", apply_rotary) is not apply_rotary
        ):
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # (N, H * D), (N, Hk * D)
            q = q.view(-1, self.num_heads, self.head_dim)  # (N, H, D)
            k = k.view(-1, self.num_kv_heads, self.head_dim)  # (N, Hk, D)
            q, k = self.q_norm(q), self.k_norm(k)  # (N, H, D), (N, Hk, D): each head's vector normalised
            return self.rotary_emb(positions, q, k)  # (N, H, D), (N, Hk, D): rotated by each token's position
        return self._norm_rotary_qk(positions, qkv)  # the fast path: same numbers, fewer kernels

    def _norm_rotary_qk(self, positions: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused version of `norm_rotary`: q_norm, k_norm and RoPE with nanoref's own functions, the query and
        key heads side by side in one pass (on a CPU each small op costs microseconds whatever its size):
        `layers.rotary.norm_rotary_qk` (compiled on CUDA: a few fused kernels), or the backend's own kernel (cpp's
        C++ one)."""
        heads, kv_heads, dim = self.num_heads, self.num_kv_heads, self.head_dim
        qk = qkv[:, : self.q_size + self.kv_size].view(-1, heads + kv_heads, dim)  # (N, H + Hk, D), a view
        q_weight, k_weight = self.q_norm.weight.expand(heads, dim), self.k_norm.weight.expand(kv_heads, dim)  # views
        rope = self.rotary_emb
        eps = self.q_norm.eps  # (k_norm's too: both are config.rms_norm_eps)
        backend_kernel = self.attn.backend.norm_rotary  # the backend's own (cpp's C++ kernel) takes them joined
        if backend_kernel is not None:
            qk = backend_kernel(qk, torch.cat([q_weight, k_weight]), eps, positions, rope.cos_cache, rope.sin_cache)
        else:  # nanoref's function (compiled on CUDA, the weights joined inside it: no copy kernel of their own)
            qk = norm_rotary_qk_cuda(qk, q_weight, k_weight, eps, positions, rope.cos_cache, rope.sin_cache)
        q, k = qk.split([heads, kv_heads], dim=1)  # (N, H, D), (N, Hk, D): views
        return q, k


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(config.hidden_size, [config.intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, bias=False, name="down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(hidden)  # (N, 2 * I)
        out = self.down_proj(self.act_fn(gate_up))  # (N, I) -> (N, hidden)
        trace("mlp", hidden=hidden, gate_up=gate_up, out=out)
        return out


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, rotary_emb: RotaryEmbedding, mlp: nn.Module | None = None) -> None:
        """mlp: the feed-forward block, any (N, hidden) -> (N, hidden) module; default the dense Qwen3MLP."""
        super().__init__()
        self.self_attn = Qwen3Attention(config, rotary_emb)
        self.mlp = mlp if mlp is not None else Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # the fused norm adds the previous block's output to the residual stream and normalises it
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        return hidden, residual


class Qwen3Model(nn.Module):
    def __init__(
        self, config: Qwen3Config, max_positions: int, make_mlp: Callable[[int], nn.Module] | None = None
    ) -> None:
        """make_mlp(layer_index): each layer's feed-forward block (Qwen3-MoE makes some sparse); default dense."""
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        # cos/sin for the positions the engine can reach (max_model_len), not the model's whole range
        rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope_theta)
        self.layers = nn.ModuleList(
            Qwen3DecoderLayer(config, rotary_emb, make_mlp(index) if make_mlp else None)
            for index in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # (N,) -> (N, hidden)
        residual = None
        for index, layer in enumerate(self.layers):
            trace_layer(index)
            hidden, residual = layer(positions, hidden, residual)
        trace_layer(None)
        hidden, _ = self.norm(hidden, residual)  # (N, hidden)
        trace("norm", hidden=hidden)
        return hidden


class Qwen3ForCausalLM(nn.Module):
    config_class = Qwen3Config  # what parses this architecture's config.json
    # checkpoint name -> (nanoref parameter, shard) for the weights packed into fused matmuls
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Qwen3Config, max_positions: int | None = None) -> None:
        """max_positions: size of the RoPE tables (the engine passes max_model_len); default: the model's limit."""
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config, max_positions or config.max_position_embeddings, self.make_mlp)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight  # one tensor, two uses

    def make_mlp(self, layer_index: int) -> nn.Module:
        """The feed-forward block of decoder layer `layer_index`: dense everywhere in Qwen3 (Qwen3-MoE overrides)."""
        return Qwen3MLP(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: (N,) -> hidden (N, hidden_size)."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(N, hidden) -> (num_seqs, vocab): only each sequence's last token in prefill."""
        return self.lm_head(hidden)
