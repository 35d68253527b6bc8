"""`titanctl rl`: reinforcement learning with verifiable rewards after SFT, over the shared core.

One file per concern: ``prompts`` (rows with answers, rendered, in a resumable order), ``rollout`` (the
policy samples its own completions over a static KV cache), ``rewards``, ``advantages`` (group-relative),
``losses`` (GRPO, DAPO, Dr.GRPO, GSPO; TIS/MIS), ``update`` (one policy update over microbatches, with
global counts), ``batch_invariant`` (kernels that make the sampler's logprobs equal the trainer's bit for
bit), ``layouts`` (what each parallel layout means for sampling) and ``loop`` (the run).
"""
