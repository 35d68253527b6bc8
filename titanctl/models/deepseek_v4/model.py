"""The DeepSeek-V4 decoder: token embedding spread over the hyper-connection streams, blocks of
(attention, MoE) each entered and left through a hyper-connection, a final collapse, norm and output."""

from __future__ import annotations

import torch
from torch import nn

from titanctl.models.deepseek_v4.args import DeepseekV4Args
from titanctl.models.deepseek_v4.attention import Attention, RMSNorm
from titanctl.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead, write_back
from titanctl.models.deepseek_v4.moe import MoE


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
    def __init__(self, args: DeepseekV4Args):
        super().__init__()
        args.check()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, S) token ids from position 0 -> (B, S, vocab) logits."""
        h = self.tok_embeddings(tokens)
        streams = h.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()
        for block in self.layers.values():
            streams = block(streams, tokens)
        return self.output(self.norm(self.hc_head(streams)))
