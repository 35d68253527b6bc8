"""Pipeline stages under the estimator: answer for the peers that do not exist; label actions.

A pipeline schedule's first step runs a handshake between neighbouring stages: an agreement on whether
the tensor shapes are known (torch < 2.15: a vote passed between neighbours, ``dist.recv`` of a flag
then ``.item()``; 2.15: an all-reduce, refused on a fake process group), and, for a stage whose
neighbour lives on another rank, the metadata of the tensors it will receive
(``dist.recv_object_list``). A fake process group delivers nothing, so on rank 0 alone these
receives would read garbage. Here each of rank 0's stages gets, instead, what its neighbours would
have sent:

- the agreement: "shapes not known" (dynamic inference, what a real run without static shapes does,
  including the metadata forward/backward that costs memory on the first step);
- a stage's input from the previous stage on another rank: Llama's stages all exchange the same
  hidden states, so it is the output metadata of rank 0's first stage, which is inferred first;
- the gradient a stage receives from the next stage: shaped like that stage's own outputs.

Only attributes of rank 0's own stage objects are replaced; nothing global is patched.

``label_actions`` tells the memory tracker which of the schedule's actions is running, so that
peaks are kept apart by action (see ``shortcuts.microbatch_plan``).
"""

from __future__ import annotations

from titanctl._torch_compat import (
    DERIVE_GRAD_METAS,
    STAGE_BACKWARD_META,
    STAGE_FORWARD_META,
    infer_shapes_on_fake_group,
    replace_stage_handshake,
    stage_output_metas,
    wrap_stage_set_up,
)


def answer_for_fake_peers(pipeline) -> None:
    # Looked up here, before the step: the answers are given inside it.
    forward_meta, backward_meta = STAGE_FORWARD_META.get(), STAGE_BACKWARD_META.get()
    derive_grad_metas = DERIVE_GRAD_METAS.get()
    stages = pipeline.stages
    first = stages[0]
    infer_shapes_on_fake_group(pipeline.schedule, stages)

    for stage in stages:

        def recv_meta(src_stage: int, stage=stage):
            if src_stage < stage.stage_index:  # forward: the previous stage's outputs
                outputs = stage_output_metas(first)
                if outputs is None:
                    raise RuntimeError(f"stage {stage.stage_index} runs before stage {first.stage_index}")
                return forward_meta(forward_metas=outputs)
            # backward: gradients of this stage's outputs
            return backward_meta(backward_metas=derive_grad_metas(stage_output_metas(stage)))

        replace_stage_handshake(
            stage,
            _recv_meta=recv_meta,
            _send_meta=lambda meta, dst_stage: None,
        )


_ACTIONS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}
# The first step's set-up of each stage (_torch_compat.STAGE_SET_UP): shape inference (a forward,
# then a backward, on the first microbatch), each followed by the buffers for every microbatch's
# messages (received activations, received gradients).
_SET_UP = {
    "forward shapes": "shapes F",
    "forward buffers": "buffers F",
    "backward shapes": "shapes B",
    "backward buffers": "buffers B",
}


_SET_UP_KINDS = frozenset(label.split(" ", 1)[0] for label in _SET_UP.values())


def is_schedule_action(label: str) -> bool:
    """Whether ``label`` (an anchor's part after "@") names a schedule action, not a stage's set-up."""
    return bool(label) and label.split(" ", 1)[0] not in _SET_UP_KINDS


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
    the same memory whatever the count, the message buffers it then makes grow with it. (Its
    methods are private: should a torch release rename one, estimating a pipeline fails with a
    TorchInternalsError that names it.)
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
                tracker.begin_action(f"{_kind}{_stage}.{place(chunk_id)}")
                return _original(chunk_id, *args, **kwargs)

            setattr(stage, method, action)
        wrap_stage_set_up(stage, _labelling_set_up(tracker, stage.stage_index))


def _labelling_set_up(tracker, stage_index: int):
    """Wraps a stage's set-up method (``wrap_stage_set_up``) to set its label on ``tracker``."""

    def wrap(step: str, original):
        label = f"{_SET_UP[step]}{stage_index}"

        def set_up(*args, **kwargs):
            tracker.begin_set_up(label)
            return original(*args, **kwargs)

        return set_up

    return wrap
