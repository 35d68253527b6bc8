"""The model of a checkpoint that carries no config, from its tensor shapes.

Shapes give the width (embedding columns), the vocabulary (embedding rows), the depth
(layer ids), the query and key/value widths (``wq``/``wk`` rows) and the MLP width
(``w1`` rows). They cannot give the number of attention heads (a 4096-wide query is 32
heads of 128 or 64 of 64), nor RoPE's theta and scaling or the norm epsilon. So a model
is inferred only when its shapes are those of a published flavor (any depth): the
flavor supplies the rest, and the origin string says so. Otherwise the error lists what
the shapes did say and asks for ``--flavor`` or ``--config``.
"""

from __future__ import annotations

import re

from titanctl.errors import CheckpointError
from titanctl.models.llama.args import LLAMA3_FLAVORS, ModelArgs

_LAYER = re.compile(r"layers\.(\d+)\.")


def infer_model_args(shapes: dict[str, tuple[int, ...]], where: str) -> tuple[ModelArgs, str]:
    """(ModelArgs, origin) from canonical-name -> shape; raises CheckpointError when it cannot."""
    emb = shapes.get("tok_embeddings.weight")
    if emb is None or len(emb) != 2:
        raise CheckpointError(
            f"{where} has no model config and no 2-D tok_embeddings.weight: give --flavor or --config"
        )
    vocab, dim = emb
    layer_ids = {int(m.group(1)) for name in shapes if (m := _LAYER.match(name))}
    n_layers = max(layer_ids) + 1 if layer_ids else 0

    def rows(suffix: str) -> int | None:
        shape = shapes.get(f"layers.0.{suffix}")
        return shape[0] if shape else None

    q_dim, kv_dim, ffn = rows("attention.wq.weight"), rows("attention.wk.weight"), rows("feed_forward.w1.weight")
    seen = f"dim {dim}, {n_layers} layers, vocab {vocab}, query width {q_dim}, key/value width {kv_dim}, ffn {ffn}"
    for flavor, args in LLAMA3_FLAVORS.items():
        if (args.dim, args.n_heads * args.head_dim, args.kv_heads * args.head_dim, args.ffn_hidden_dim) == (
            dim, q_dim, kv_dim, ffn
        ):
            depth = "" if n_layers == args.n_layers else f" with {n_layers} layers"
            origin = (
                f"tensor shapes ({seen}: flavor {flavor}'s{depth}; n_heads {args.n_heads}, "
                f"n_kv_heads {args.kv_heads}, RoPE and norm eps taken from it)"
            )
            return args.replace(n_layers=n_layers, vocab_size=vocab), origin
    raise CheckpointError(
        f"{where} has no model config; its tensor shapes say {seen}, which is no published flavor, and "
        "n_heads cannot be inferred from shapes: give --flavor or --config"
    )
