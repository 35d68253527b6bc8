"""Generate under torchrun with tensor parallel over all ranks; every rank writes what it decoded.

    torchrun --nproc_per_node N gen_worker.py DCP_FOLDER HF_FOLDER PROMPT MAX_NEW OUT [GPT_OSS_FOLDER]

OUT/rank{r}.json: {"sample_7", "sample_7_again", "sample_8", "hf_greedy", "greedy_compiled", "hf_greedy_compiled"} ->
token lists; "{dcp,hf}_over_shared_memory", "{dcp,hf}_decode_uses_process_group" -> how ranks exchanged;
with GPT_OSS_FOLDER (a transformers-saved gpt-oss folder) also "gpt_oss_greedy".
"""

import json
import sys
from pathlib import Path

from tests.fork_server import hand_over

if __name__ == "__main__":  # not when a test imports the module
    hand_over()  # run as a fork of the test session's server, when it has one

from torch.distributed.device_mesh import init_device_mesh

from titanctl.cli.console import finish
from titanctl.data.tokenizer import Tokenizer
from titanctl.inference import shm_exchange
from titanctl.inference import tensor_parallel as inference_tp
from titanctl.inference.generate import check_tp_degree, find_checkpoint, generate, load_model
from titanctl.parallel.runtime.env import init_process

# Hot enough that the tiny model, which knows its one sentence by heart, draws different tokens per seed.
SAMPLING = {"temperature": 1.5, "top_k": 200}


def load(folder, prompt_len, max_new, env, mesh):
    source = find_checkpoint(Path(folder))
    args = source.args.replace(max_seq_len=prompt_len + max_new)
    check_tp_degree(args, env.world_size)
    return load_model(source, args, env.device, mesh)


def main() -> None:
    dcp_folder, hf_folder, prompt, max_new, out = sys.argv[1:6]
    max_new = int(max_new)
    env = init_process(60)
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    ids = Tokenizer().encode(prompt, bos=True, eos=False)
    results = {}
    model = load(dcp_folder, len(ids), max_new, env, mesh)
    results["dcp_over_shared_memory"] = inference_tp.rank_gather(model).exchange is not None
    results["dcp_decode_uses_process_group"] = inference_tp.decode_uses_process_group(model)
    for name, seed in (("sample_7", 7), ("sample_7_again", 7), ("sample_8", 8)):
        results[name] = generate(model, ids, max_new, seed=seed, **SAMPLING).tokens
    # The compiled decode step calls the shared memory exchange from Inductor's C++ wrapper.
    results["greedy_compiled"] = generate(model, ids, max_new, temperature=0, compile=True).tokens
    # Ranks on different hosts (or not on x86-64) exchange over the process group instead of shared memory.
    shm_exchange.create = lambda group: None
    model = load(hf_folder, len(ids), max_new, env, mesh)
    results["hf_greedy"] = generate(model, ids, max_new, temperature=0).tokens
    results["hf_over_shared_memory"] = inference_tp.rank_gather(model).exchange is not None
    results["hf_decode_uses_process_group"] = inference_tp.decode_uses_process_group(model)
    # Traced process-group collectives in the compiled step (Inductor's Python wrapper).
    results["hf_greedy_compiled"] = generate(model, ids, max_new, temperature=0, compile=True).tokens
    if len(sys.argv) > 6:  # gpt-oss: sinks split with the heads, o_proj's bias added once after the sum
        model = load(sys.argv[6], len(ids), max_new, env, mesh)
        results["gpt_oss_greedy"] = generate(model, ids, max_new, temperature=0).tokens
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{env.rank}.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
    finish(0)  # destroy the process group, then os._exit (see titanctl.cli.console.finish: gloo aborts at exit otherwise)
