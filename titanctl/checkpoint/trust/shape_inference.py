"""The model of a checkpoint that carries no config, from its tensor shapes.

Shapes give the width (embedding columns), the vocabulary (embedding rows), the depth
(layer ids), the query and key/value widths (``wq``/``wk`` rows) and the MLP width
(``w1`` rows). They cannot give the number of attention heads (a 4096-wide query is 32
heads of 128 or 64 of 64), nor RoPE's theta and scaling or the norm epsilon. So a model
is inferred only when its width, query width and MLP width are those of a published
flavor (any depth): the flavor supplies the heads (so the head width), RoPE and norm eps,
and the origin string says so. A flavor whose key/value width is the checkpoint's too is
preferred (torchtitan's debugmodel has titanctl's debugmodel widths in 16 heads of 16, all of
them key/value: flavor ``debugmodel_torchtitan``); else the key/value width counts the key/value
heads, which may differ from the flavor's, and the origin says that too. Otherwise the error
lists what the shapes did say and asks for ``--flavor`` or ``--config``.
"""

from __future__ import annotations

import re

from titanctl.errors import CheckpointError
from titanctl.models.common.args import ModelArgs
from titanctl.models.registry import all_specs

_LAYER = re.compile(r"layers\.(\d+)\.")


def kv_heads_of(kv_width: int | None, args: ModelArgs) -> int | None:
    """The key/value head count that a key/value width means with `args`' head width and query
    heads (None: no whole count that divides n_heads)."""
    if not kv_width:
        return None
    heads, rest = divmod(kv_width, args.head_dim)
    return heads if not rest and heads and args.n_heads % heads == 0 else None


def kv_heads_hint(name: str, shape: tuple[int, ...], want: tuple[int, ...], args: ModelArgs) -> str:
    """For a weight `name` (canonical) of `shape` where the model `args` wants `want`: when only the
    key/value heads differ (torchtitan's debugmodel against titanctl's flavor), how many the checkpoint
    has and the setting that says so; '' otherwise."""
    if not name.endswith(("attention.wk.weight", "attention.wv.weight")) or tuple(shape[1:]) != tuple(want[1:]):
        return ""
    for label, other in _same_widths(args):
        if other.kv_heads * other.head_dim == shape[0]:
            return (f": the checkpoint has flavor {label}'s key/value width ({other.kv_heads} heads of "
                    f"{other.head_dim}); use that flavor (model.flavor, or convert's --flavor)")
    heads = kv_heads_of(shape[0], args)
    if heads is None:
        return ""
    return (
        f": the checkpoint has {heads} key/value heads of {args.head_dim}, the model {args.kv_heads}; "
        f"set model.n_kv_heads = {heads} in the recipe"
    )


def _flavors() -> list[tuple[str, ModelArgs]]:
    """(name as --flavor takes it, args) of every published flavor."""
    return [(flavor if spec.name == "llama3" else f"{spec.name}:{flavor}", args)
            for spec in all_specs() for flavor, args in spec.flavors.items()]


def _same_widths(args: ModelArgs) -> list[tuple[str, ModelArgs]]:
    """The flavors of `args`' family with its width, query width and MLP width."""
    widths = (args.dim, args.n_heads * args.head_dim, args.ffn_hidden_dim)
    return [(label, other) for label, other in _flavors() if other.family == args.family
            and (other.dim, other.n_heads * other.head_dim, other.ffn_hidden_dim) == widths]


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
    qk_norm = "layers.0.attention.q_norm.weight" in shapes
    tied = "output.weight" not in shapes
    flavors = _flavors()
    # A flavor of the checkpoint's key/value width first; then one whose head width counts its heads.
    flavors.sort(key=lambda found: found[1].kv_heads * found[1].head_dim != kv_dim)
    for label, args in flavors:
        if args.qk_norm != qk_norm or (tied and not args.tie_embeddings):
            continue
        # A tied flavor's checkpoint that stores its output layer (torchtitan's Llama 3.2) is read
        # as the untied model with those weights.
        args = args.replace(tie_embeddings=tied)
        if (args.dim, args.n_heads * args.head_dim, args.ffn_hidden_dim) != (dim, q_dim, ffn):
            continue
        kv_heads = kv_heads_of(kv_dim, args)
        if kv_heads is None:
            continue
        depth = "" if n_layers == args.n_layers else f" with {n_layers} layers"
        if kv_heads == args.kv_heads:
            heads = f"n_heads {args.n_heads}, n_kv_heads {args.kv_heads}, RoPE and norm eps taken from it"
        else:
            kind = "multi-head attention" if kv_heads == args.n_heads else "grouped-query attention"
            heads = (
                f"n_heads {args.n_heads}, RoPE and norm eps taken from it; n_kv_heads {kv_heads} from the "
                f"key/value width ({kind}, where the flavor has {args.kv_heads})"
            )
        origin = f"tensor shapes ({seen}: flavor {label}'s{depth}; {heads})"
        return args.replace(n_layers=n_layers, vocab_size=vocab, n_kv_heads=kv_heads), origin
    raise CheckpointError(
        f"{where} has no model config; its tensor shapes say {seen}, which is no published flavor, and "
        "n_heads cannot be inferred from shapes: give --flavor or --config"
    )
