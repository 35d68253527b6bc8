"""Pipeline stages on a fake process group: answer for the peers that do not exist.

A pipeline schedule's first step runs a handshake between neighbouring stages: a vote on whether
the tensor shapes are known (``dist.recv`` of a flag, then ``.item()``), and, for a stage whose
neighbour lives on another rank, the metadata of the tensors it will receive
(``dist.recv_object_list``). A fake process group delivers nothing, so on rank 0 alone these
receives would read garbage. Here each of rank 0's stages gets, instead, what its neighbours would
have sent:

- the vote: "shapes not known" (dynamic inference, what a real run without static shapes does,
  including the metadata forward/backward that costs memory on the first step);
- a stage's input from the previous stage on another rank: Llama's stages all exchange the same
  hidden states, so it is the output metadata of rank 0's first stage, which is inferred first;
- the gradient a stage receives from the next stage: shaped like that stage's own outputs.

Only attributes of rank 0's own stage objects are replaced; nothing global is patched.
"""

from __future__ import annotations

import torch


def answer_for_fake_peers(pipeline) -> None:
    from torch.distributed.pipelining._utils import _StageBackwardMeta, _StageForwardMeta

    stages = pipeline.stages
    first = stages[0]

    def vote(*_args, **_kwargs) -> torch.Tensor:
        return torch.tensor([0], dtype=torch.int32)  # 0: shapes are inferred from the first batch

    for stage in stages:

        def recv_meta(src_stage: int, stage=stage):
            if src_stage < stage.stage_index:  # forward: the previous stage's outputs
                outputs = first._stage_meta.outputs
                if outputs is None:
                    raise RuntimeError(f"stage {stage.stage_index} runs before stage {first.stage_index}")
                return _StageForwardMeta(forward_metas=outputs)
            # backward: gradients of this stage's outputs
            return _StageBackwardMeta(backward_metas=_grad_metas(stage._stage_meta.outputs))

        stage._warmup_forward_vote = vote
        stage._warmup_backward_result = vote
        stage._recv_meta = recv_meta
        stage._send_meta = lambda meta, dst_stage: None


def _grad_metas(outputs):
    from torch.distributed.pipelining._utils import _derive_grad_metas

    return _derive_grad_metas(outputs)
