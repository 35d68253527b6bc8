"""Pipeline stages under the estimator: answer for the peers that do not exist; label actions.

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

``label_actions`` tells the memory tracker which of the schedule's actions is running, so that
peaks are kept apart by action (see ``shortcuts.microbatch_plan``).
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


_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
# The first step's set-up of each stage, in torch's private PipelineStage methods: shape inference
# (a forward, then a backward, on the first microbatch), each followed by the buffers for every
# microbatch's messages (received activations, received gradients).
_SET_UP = {
    "_forward_metadata_inference": "shapes F",
    "_setup_forward_recv_info": "buffers F",
    "_backward_metadata_inference": "shapes B",
    "_setup_backward_recv_info": "buffers B",
}


def label_actions(pipeline, tracker) -> None:
    """Set ``tracker.action`` as each of this rank's stages starts a schedule action.

    The label is the action's kind (F forward, B backward, I backward of the inputs only, W backward
    of the weights), its stage, and its microbatch's place among the step's microbatches: the
    first, the last, or one between. It stays set until the next action, so that what the schedule
    does after an action (the loss after the last stage's forward, sends) is counted with it. Peaks
    of different places then have their own keys: each grows in its own way with the microbatch
    count (the first backward of GPipe holds every microbatch's activations, the last one only its
    own), while the first and last actions do what no other does (all-gather the weights, create
    the gradients, reduce them). The first step's set-up is labelled too: its shape inference needs
    the same memory whatever the count, the message buffers it then makes grow with it. (Should a
    torch release rename a set-up method, it goes unlabelled: the tests comparing shortcuts with
    full runs then say so.)
    """
    n = pipeline.n_microbatches

    def place(chunk_id: int) -> str:
        return "first" if chunk_id == 0 else "last" if chunk_id == n - 1 else "mid"

    for stage in pipeline.stages:
        for method, kind in _ACTIONS.items():
            original = getattr(stage, method)

            def action(chunk_id, *args, _original=original, _kind=kind, _stage=stage.stage_index, **kwargs):
                if _kind == "B" and not kwargs.get("full_backward", True):
                    _kind = "I"
                tracker.action = f"{_kind}{_stage}.{place(chunk_id)}"
                return _original(chunk_id, *args, **kwargs)

            setattr(stage, method, action)
        for method, kind in _SET_UP.items():
            original = getattr(stage, method, None)
            if original is None:
                continue

            def set_up(*args, _original=original, _label=f"{kind}{stage.stage_index}", **kwargs):
                tracker.action = _label
                return _original(*args, **kwargs)

            setattr(stage, method, set_up)
