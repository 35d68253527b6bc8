"""The DeepSeek-V4 decoder: token embedding spread over the hyper-connection streams, blocks of
(attention, MoE) each entered and left through a hyper-connection, a final collapse, norm and output.

A pipeline stage (``split_into_stage``) is the same module holding some of the blocks: the boundary between
stages carries the streams (B, S, hc_mult, dim) whole (the next block mixes all of them) and the token ids
(B, S), which the hash-routed layers route by; a stage passes both on, so a hash-routed layer may sit in any
stage. The ids need no gradient, and torch's pipelining sends no gradient for an integer tensor."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from titanctl.models.common import decoder
from titanctl.models.common.init import INPUT, ONES, ParamInit, output_projection
from titanctl.models.deepseek_v4.args import DeepseekV4Args
from titanctl.models.deepseek_v4.attention import Attention, RMSNorm, rope_frequencies
from titanctl.models.deepseek_v4.hyper_connections import HyperConnection, HyperHead, write_back
from titanctl.models.deepseek_v4.indexer_loss import AddLossGradient
from titanctl.models.deepseek_v4.moe import MoE, hash_table
from titanctl.models.deepseek_v4.mtp import PredictionDepth, with_prediction_layers

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

    @property
    def moe(self) -> MoE:
        """The MoE under the name the layouts look for (expert parallel's token exchange, FSDP's expert
        units): ``mlp`` is transformers' name, which the checkpoint formats keep."""
        return self.mlp

    def forward(self, streams: torch.Tensor, tokens: torch.Tensor, input_pos: torch.Tensor | None = None
                ) -> torch.Tensor:
        post, comb, h = self.attn_hc(streams)
        streams = write_back(streams, self.self_attn(self.input_layernorm(h), input_pos=input_pos), post, comb)
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
        # The prediction depths' blocks follow the main ones in layers (every layout shards them as any block).
        blocks = with_prediction_layers(args)
        self.layers = nn.ModuleDict({str(i): Block(blocks, i) for i in range(blocks.n_layers)})
        self.mtp = nn.ModuleDict({str(k): PredictionDepth(args) for k in range(args.mtp_layers)}) or None
        self.hc_head = HyperHead(args)
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.tie_weights()
        self.indexer_warmup = False
        self.microbatches = 1
        self.cache_length: int | None = None  # positions of the decoding caches, once set up

    def setup_kv_cache(self, max_seq_len: int | None = None, batch_size: int = 1) -> None:
        """Give every main layer's attention zeroed decoding caches for ``max_seq_len`` positions (default: the
        model's max_seq_len): its window's ring and a CSA/HCA layer's compressed entries (cache.py). The
        prediction depths' blocks get none: decoding runs the main layers only."""
        length = max_seq_len or (self.args.max_seq_len if self.args is not None else None)
        if not length:
            raise ValueError("setup_kv_cache needs max_seq_len: this model was built without ModelArgs")
        for layer_id, block in self.layers.items():
            if int(layer_id) < self.v4.n_layers:
                block.self_attn.cache = block.self_attn.new_cache(batch_size, length)
        self.cache_length = length

    def clear_kv_cache(self) -> None:
        for block in self.layers.values():
            block.self_attn.cache = None
        self.cache_length = None

    def tie_weights(self) -> None:
        """Make ``output.weight`` the embedding's Parameter again (when tied and both are here): tensor
        parallelism's distribution of each module gives each its own."""
        if self.v4.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def set_training_step(self, step: int, microbatches: int) -> None:
        """Called by the trainer before each step (``step`` steps done, ``microbatches`` forwards in it): the
        first ``indexer_warmup_steps`` attend densely in the CSA layers and train the indexer alone."""
        self.indexer_warmup = step < self.v4.indexer_warmup_steps
        self.microbatches = microbatches
        for block in self.layers.values():
            block.self_attn.dense = self.indexer_warmup

    def _with_indexer_loss(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` carrying the gradient of this forward's indexer losses (summed over the CSA layers, per
        microbatch / the step's microbatches, as the language-model loss); in the warm-up nothing else's."""
        losses = [block.self_attn.indexer_loss for block in self.layers.values()
                  if block.self_attn.indexer_loss is not None]
        if not losses:
            return out
        loss = self.v4.indexer_loss_coeff * torch.stack(losses).sum() / self.microbatches
        self.last_indexer_loss = loss.detach()
        return AddLossGradient.apply(out.detach() if self.indexer_warmup else out, loss)

    def forward(self, tokens: torch.Tensor, token_ids: torch.Tensor | None = None,
                input_pos: torch.Tensor | None = None, attn_mask=None, mtp: bool = False,
                positions: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """(B, S) token ids from position 0 -> (B, S, vocab) logits. Whole sequences only: packed documents
        are not built for this family. ``mtp`` (training, a model with prediction depths): returns (logits,
        [each depth's logits (B, S, vocab)]); at position i depth k predicts token i + k + 1 (mtp.py).

        ``input_pos`` (S,) int64, after ``setup_kv_cache``: the tokens' positions, consecutive, below the
        cache's length, every earlier position given in earlier calls (decoding: a prompt, then a token at a
        time, or in chunks).

        A pipeline stage without the embedding takes the previous stage's (streams (B, S, n, D), token ids
        (B, S)); one without the output layer returns them."""
        if attn_mask is not None or positions is not None:
            raise ValueError("deepseek_v4 trains on whole windows only: set model.attn_mask_type = 'causal' "
                             "(its compressed entries span document boundaries; chat data packs documents too)")
        if input_pos is not None and self.cache_length is None:
            raise ValueError("forward(..., input_pos) decodes through the caches: call setup_kv_cache first")
        if self.tok_embeddings is not None:
            token_ids, h = tokens, self.tok_embeddings(tokens)
            streams = h.unsqueeze(2).expand(-1, -1, self.v4.hc_mult, -1).contiguous()  # (B, S, n, D)
        else:
            streams = tokens
        for layer_id, block in self.layers.items():
            if int(layer_id) < self.v4.n_layers:  # the prediction depths' blocks run in predict_ahead
                streams = block(streams, token_ids, input_pos)
        if self.output is None:
            return self._with_indexer_loss(streams), token_ids
        logits = self._with_indexer_loss(self.output(self.norm(self.hc_head(streams))))
        if not mtp or self.mtp is None:
            return logits
        return logits, self.predict_ahead(tokens, streams)

    def predict_ahead(self, tokens: torch.Tensor, streams: torch.Tensor) -> list[torch.Tensor]:
        """Each prediction depth's logits (B, S, vocab), from the token ids and the main model's last streams."""
        depth_logits = []
        for k, depth in self.mtp.items():
            # Position i takes token i + k + 1 (rolled: the last k + 1 positions wrap around to the window's
            # start, and the depth's attention is causal, so they change no earlier position).
            ahead = tokens.roll(-(int(k) + 1), dims=1)
            block = self.layers[str(self.v4.n_layers + int(k))]
            streams = block(depth(streams, self.tok_embeddings(ahead)), ahead)
            depth_logits.append(self.output(depth.hidden(streams)))
        return depth_logits

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
        zero the routing biases and the token counts."""
        device = device if device is not None else next(self.parameters()).device
        args = self.v4
        for layer_id, block in self.layers.items():
            attn = block.self_attn
            attn.freqs = rope_frequencies(args, compressed=attn.kind != "sliding_attention").to(device)
            if block.mlp.hashed:
                block.mlp.tid2eid = hash_table(args.vocab_size, args.num_experts, args.top_k, int(layer_id), device)
            else:
                block.mlp.expert_bias = torch.zeros(args.num_experts, device=device)
            block.mlp.tokens_per_expert = torch.zeros(args.num_experts, device=device)
        self.tie_weights()


def split_into_stage(model: DeepseekV4, layer_ids: Iterable[int], is_first: bool, is_last: bool) -> DeepseekV4:
    """The decoder's stage (``decoder.split_into_stage``), the streams' collapse kept on the last stage only."""
    stage = decoder.split_into_stage(model, layer_ids, is_first, is_last)
    if not is_last:
        stage.hc_head = None
    return stage
