"""DeepSeek-V3's spec: the shared decoder with Multi-head Latent Attention, dense first layers and a
Mixture of Experts (shared experts, group-limited routing) in the others."""

from __future__ import annotations

from titanctl.errors import ParallelError
from titanctl.models.common.decoder import Transformer, split_into_stage
from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
from titanctl.models.deepseek_v3.flops import deepseek_v3_flops_per_token
from titanctl.models.deepseek_v3.hf import HF
from titanctl.models.spec import ModelSpec, TPPlan


def _no_tensor_parallel(*_args, **_kwargs) -> dict:
    # The dense decoder's plan names wq/wk/wv; applied to MLA it would split the queries' heads and
    # not the keys' (wkv_b). Refused before anything is distributed, until MLA has a plan of its own.
    raise ParallelError("tensor parallelism is not built for deepseek_v3 (Multi-head Latent Attention) yet: "
                        "set tensor_parallel_degree = 1")


SPEC = ModelSpec(
    name="deepseek_v3",
    flavors=DEEPSEEK_V3_FLAVORS,
    build=Transformer,
    tp_plan=TPPlan(root=_no_tensor_parallel, block=_no_tensor_parallel),
    split_stage=split_into_stage,
    flops_per_token=deepseek_v3_flops_per_token,
    hf=HF,
    tokenizer_repo=("deepseek-ai/DeepSeek-V3", ""),
)
