"""The DeepSeek-V4 decoder: token embedding spread over the hyper-connection streams, blocks of
(attention, MoE) each entered and left through a hyper-connection, a final collapse, norm and output."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.models.common.init import INPUT, ONES, ParamInit, output_projection
from titanctl.models.deepseek_v4.args import DeepseekV4Args
from titanctl.models.deepseek_v4.attention import Attention, RMSNorm, rope_frequencies
from titanctl.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead, write_back
from titanctl.models.deepseek_v4.moe import MoE, hash_table

# Parameters drawn as the reference initializes them: its mixing weights std 0.02 (INPUT), these at zero.
ZERO_AT_INIT = ("sinks", "position_bias", "base")
# Each branch's last projection, scaled down by depth as titanctl's other families do.
BRANCH_OUTPUTS = ("o_b_proj.weight", "down_proj.weight", "down_proj")


class Block(nn.Module):
    def __init__(self, args: DeepseekV4Args, layer_id: int):
        super().__init__()
        self.attn_hc = HyperConnection(args)
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args, layer_id)
        self.ffn_hc = HyperConnection(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.mlp = MoE(args, layer_id)

    def forward(self, streams: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        post, comb, h = self.attn_hc(streams)
        streams = write_back(streams, self.self_attn(self.input_layernorm(h)), post, comb)
        post, comb, h = self.ffn_hc(streams)
        return write_back(streams, self.mlp(self.post_attention_layernorm(h), tokens), post, comb)


class DeepseekV4(nn.Module):
    def __init__(self, args: DeepseekV4Args, model_args=None):
        """``model_args``: titanctl's ModelArgs these were read from (what the trainer and layouts read as
        ``model.args``), when built through the spec."""
        super().__init__()
        args.check()
        self.v4 = args
        self.args = model_args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None, attn_mask=None,
                mtp: bool = False, positions: torch.Tensor | None = None) -> torch.Tensor:
        """(B, S) token ids from position 0 -> (B, S, vocab) logits. Whole sequences only: packed documents,
        decoding and prediction depths are not built for this family."""
        if attn_mask is not None or positions is not None:
            raise ValueError("deepseek_v4 trains on whole windows only: set model.attn_mask_type = 'causal' "
                             "(its compressed entries span document boundaries; chat data packs documents too)")
        if input_pos is not None:
            raise ValueError("deepseek_v4 has no decoding cache in titanctl yet")
        if mtp:
            raise ValueError("deepseek_v4 has no multi-token prediction depths in titanctl; set model.mtp_layers = 0")
        h = self.tok_embeddings(tokens)
        streams = h.unsqueeze(2).expand(-1, -1, self.v4.hc_mult, -1).contiguous()
        for block in self.layers.values():
            streams = block(streams, tokens)
        return self.output(self.norm(self.hc_head(streams)))

    def param_inits(self, depth: int | None) -> dict[str, ParamInit]:
        """Every parameter's init, by its name in this model."""
        layers = self.v4.n_layers
        rules = {}
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name == "tok_embeddings.weight":
                rules[name] = ParamInit("normal", std=0.02 if self.v4.tie_embeddings else 1.0)
            elif name == "output.weight":
                std = self.v4.dim ** -0.5
                rules[name] = ParamInit("trunc_normal", std=std, bound=3 * std)
            elif leaf in ZERO_AT_INIT:
                rules[name] = ParamInit("zeros")
            elif leaf == "scale" or p.ndim == 1:
                rules[name] = ONES
            elif name.endswith(BRANCH_OUTPUTS):
                rules[name] = output_projection(layers)
            else:
                rules[name] = INPUT
        return rules

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Recompute the RoPE frequencies and the hash tables (``to_empty`` leaves buffers uninitialized),
        zero the routing biases."""
        device = device if device is not None else self.tok_embeddings.weight.device
        args = self.v4
        for layer_id, block in self.layers.items():
            attn = block.self_attn
            attn.freqs = rope_frequencies(args, compressed=attn.kind != "sliding_attention").to(device)
            if block.mlp.hashed:
                block.mlp.tid2eid = hash_table(args.vocab_size, args.num_experts, args.top_k, int(layer_id), device)
            else:
                block.mlp.expert_bias = torch.zeros(args.num_experts, device=device)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
