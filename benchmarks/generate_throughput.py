"""Generation speed: titanctl's decoder vs transformers' `generate()`, greedy, same weights.

The model (a flavor, random weights from a seed) is exported once as a Hugging Face folder by
titanctl; titanctl loads it through its own reader, transformers with ``from_pretrained``. Each
contender is loaded once, then they decode the same prompt in alternating rounds, so load from
other processes on the machine hits them alike. Prefill (prompt forward + first token) and decode
(every later token) rates are printed apart, with their ratios, and whether the tokens agree.
Compiling titanctl's decode step happens once, before the rounds, and is reported on its own.

    .venv/bin/python benchmarks/generate_throughput.py [--rounds 5] [--prompt-len 64] [--new-tokens 160]
        [--flavor debugmodel] [--threads N] [--no-compile] [--isa native|avx2|both] [--kernels]

``--isa avx2`` runs the comparison with torch's and oneDNN's AVX2 code paths (the script launches
itself with ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2``, which must be set before torch
is imported): an AVX-512 machine then measures what an AVX2-only CPU runs. ``--isa both`` prints
the native run, the AVX2 run and a summary of both. ``--kernels`` adds titanctl contenders with
the kernel choices the decoder did not make on the ISA (``titanctl.inference.generate.COMPILED_ATTENTION``):
the other attention (math or fused flash) in the compiled step, oneDNN's linears, the other thread
count.

``--tp 2`` compares tensor-parallel decoding over 2 processes (the script launches torchrun itself)
with one process, in alternating rounds inside one job: while rank 0 decodes alone with ``--threads``
threads, the other ranks wait at a barrier. The ranks exchange through shared memory, as infer-tp's
do on one host, or with ``--no-shared-memory`` through gloo, as ranks on different hosts do.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend

from titanctl.checkpoint.convert import save_state_dict
from titanctl.data.datasets import load_documents
from titanctl.data.tokenizer import Tokenizer
from titanctl.inference import shm_exchange
from titanctl.inference import tensor_parallel as inference_tp
from titanctl.inference.generate import GREEDY, Decoder, compiled_attention, find_checkpoint, load_model
from titanctl.models.common.decoder import Transformer
from titanctl.models.llama.args import LLAMA3_FLAVORS
from titanctl.models.shapes import num_params
from titanctl.parallel.layouts.weight_init import initialize_weights


@dataclass
class Timing:
    prefill_seconds: float  # prompt forward + first token
    decode_seconds: float  # the other tokens
    tokens: list[int]


def prompt_ids(length: int) -> list[int]:
    text = " ".join(doc for _, doc in zip(range(20), load_documents("bundled_val", None)))
    ids = Tokenizer().encode(text, bos=True, eos=False)
    if len(ids) < length:
        raise SystemExit(f"the bundled text gives only {len(ids)} prompt tokens")
    return ids[:length]


def export_model(flavor: str, folder: Path, max_seq_len: int):
    """A seeded random model of ``flavor``, written as a Hugging Face folder by titanctl."""
    args = LLAMA3_FLAVORS[flavor].replace(vocab_size=Tokenizer().vocab_size, max_seq_len=max_seq_len)
    model = Transformer(args)
    initialize_weights(model, seed=0)
    save_state_dict(model.state_dict(), args, folder, "hf")
    return args


class Ours:
    """titanctl's Decoder; ``threads``: the thread count it runs (and was compiled) at (0: as is)."""

    def __init__(self, folder: Path, max_seq_len: int, compile: bool, mesh=None, *, threads: int = 0,
                 attention: SDPBackend | None = None, onednn: bool = False):
        source = find_checkpoint(folder)
        model = load_model(source, source.args.replace(max_seq_len=max_seq_len), torch.device("cpu"), mesh)
        if onednn:
            from titanctl.parallel.converters.onednn_linear import use_onednn_linears

            use_onednn_linears(model)
        self.threads = threads
        self._threads()
        self.decoder = Decoder(model, max_seq_len, compile=compile, attention=attention)
        self.compile_seconds = self.decoder.warm_up(GREEDY)

    def _threads(self) -> None:
        if self.threads:
            torch.set_num_threads(self.threads)

    def __call__(self, prompt: list[int], new_tokens: int) -> Timing:
        self._threads()
        g = self.decoder.generate(prompt, new_tokens)
        return Timing(g.prefill_seconds, g.decode_seconds, g.tokens)


class Theirs:
    """transformers' generate(), greedy, its default (dynamic) cache; a streamer marks the first token."""

    def __init__(self, folder: Path, threads: int = 0, decode_threads: int = 0, stop_tokens=None):
        """``threads``: for the prefill (0: as is); ``decode_threads``: from the first new token on
        (0: the same); ``stop_tokens``: end at any of them (default: run the full length)."""
        import transformers

        self.model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.transformers = transformers
        self.threads, self.decode_threads = threads, decode_threads
        self.stop_tokens = sorted(stop_tokens) if stop_tokens else None

    def __call__(self, prompt: list[int], new_tokens: int) -> Timing:
        marks: list[float] = []
        decode_threads = self.decode_threads

        class Clock:  # put() gets the prompt first, then each new token
            def put(self, value):
                marks.append(time.perf_counter())
                if len(marks) == 2 and decode_threads:  # the prefill is done: decode at its own count
                    torch.set_num_threads(decode_threads)

            def end(self):
                pass

        if self.threads:
            torch.set_num_threads(self.threads)
        start = time.perf_counter()
        with torch.no_grad():
            config = self.transformers.GenerationConfig(do_sample=False, eos_token_id=self.stop_tokens,
                                                        pad_token_id=0, max_new_tokens=new_tokens)
            out = self.model.generate(torch.tensor([prompt]), generation_config=config, streamer=Clock())
        end = time.perf_counter()
        return Timing(marks[1] - start, end - marks[1], out[0, len(prompt):].tolist())


def alternating(contenders: dict, prompt: list[int], new_tokens: int, rounds: int, between=None) -> dict:
    """Median prefill and decode tokens/s of each contender over alternating rounds, and its tokens."""
    for run in contenders.values():  # warm up
        run(prompt, 8)
    seen: dict[str, dict] = {name: {"prefill": [], "decode": [], "tokens": None} for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            if between is not None:
                between()
            t = run(prompt, new_tokens)
            seen[name]["prefill"].append(len(prompt) / t.prefill_seconds)
            seen[name]["decode"].append((len(t.tokens) - 1) / t.decode_seconds)
            seen[name]["tokens"] = t.tokens
    return {name: {**s, "prefill": statistics.median(s["prefill"]), "decode": statistics.median(s["decode"])}
            for name, s in seen.items()}


def print_rates(rates: dict) -> None:
    print(f"{'':28s}{'prefill tokens/s':>18s}{'decode tokens/s':>18s}")
    for name, r in rates.items():
        print(f"{name:28s}{r['prefill']:18,.0f}{r['decode']:18,.1f}")


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def one_process(opts) -> dict:
    if opts.threads:
        torch.set_num_threads(opts.threads)
    threads = torch.get_num_threads()
    other_threads = 1 if threads > 1 else min(2, os.cpu_count() or 1)
    prompt = prompt_ids(opts.prompt_len)
    length = opts.prompt_len + opts.new_tokens
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="titanctl-genbench-") as tmp:
        args = export_model(opts.flavor, Path(tmp), length)
        mode = "compiled" if opts.compile else "eager"
        contenders = {f"titanctl ({mode})": Ours(Path(tmp), length, opts.compile, threads=threads)}
        if opts.compile:
            contenders["titanctl (eager)"] = Ours(Path(tmp), length, compile=False, threads=threads)
        if opts.kernels and opts.compile:
            # the attention the decoder does not use on this ISA (COMPILED_ATTENTION)
            chosen = compiled_attention(torch.device("cpu"))
            other, label = ((SDPBackend.FLASH_ATTENTION, "flash") if chosen == SDPBackend.MATH
                            else (SDPBackend.MATH, "math"))
            contenders[f"titanctl (compiled, {label} attention)"] = Ours(
                Path(tmp), length, True, threads=threads, attention=other)
            contenders["titanctl (compiled, oneDNN linears)"] = Ours(Path(tmp), length, True, threads=threads,
                                                                     onednn=True)
            if other_threads != threads:
                contenders[f"titanctl (compiled, {other_threads} threads)"] = Ours(
                    Path(tmp), length, True, threads=other_threads)
        contenders["transformers generate()"] = Theirs(Path(tmp), threads)
    rates = alternating(contenders, prompt, opts.new_tokens, opts.rounds)
    capability = torch.backends.cpu.get_cpu_capability()
    print(f"model {opts.flavor} ({num_params(args) / 1e6:.1f}M params), prompt {len(prompt)} tokens, "
          f"{opts.new_tokens} new tokens, greedy, fp32, {threads} threads, CPU capability {capability}, "
          f"median of {opts.rounds} alternating rounds, load average {load_before} -> {load_average()}")
    print_rates(rates)
    theirs = rates["transformers generate()"]
    ratios = {}
    for name, r in rates.items():
        if name.startswith("titanctl"):
            ratios[name] = {"prefill": r["prefill"] / theirs["prefill"], "decode": r["decode"] / theirs["decode"],
                            "same_tokens": r["tokens"] == theirs["tokens"]}
            differ = next((i for i, (a, b) in enumerate(zip(r["tokens"], theirs["tokens"])) if a != b), None)
            print(f"ratio {name}/transformers: prefill {ratios[name]['prefill']:.2f}, "
                  f"decode {ratios[name]['decode']:.2f}; tokens identical: {ratios[name]['same_tokens']}"
                  + ("" if differ is None else f" (from token {differ} of {len(r['tokens'])} on)"))
    compile_seconds = {name: c.compile_seconds for name, c in contenders.items()
                       if isinstance(c, Ours) and c.compile_seconds}
    for name, seconds in compile_seconds.items():
        print(f"compile time of the decode step, {name}: {seconds:.1f} s (once per process, not in the rates)")
    return {"capability": capability, "threads": threads, "rates": {
        name: {"prefill": r["prefill"], "decode": r["decode"]} for name, r in rates.items()},
        "ratios": ratios, "compile_seconds": compile_seconds}


ISA_ENV = {"native": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}}


def isa_environment(isa: str) -> dict[str, str]:
    """This process's environment for a child that runs ``isa``'s code paths. Without
    TORCHINDUCTOR_CACHE_DIR: importing torch here set it to the default folder, and a child for
    another capability would reuse kernels compiled for this one (torch 2.13's cache does not
    tell them apart; an AVX-512 decode step reused under ATEN_CPU_CAPABILITY=avx2 chose other
    tokens from the first step on); the child's titanctl import picks a folder per capability."""
    drop = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "TORCHINDUCTOR_CACHE_DIR")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return {**env, **ISA_ENV[isa], "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def relaunch_per_isa(isas: list[str]) -> None:
    """Run this script once per ISA in a subprocess with that ISA's environment (read by torch and
    oneDNN at import), print each run's output as it comes, then a summary of their ratios."""
    results = {}
    argv = [a for a in sys.argv[1:] if not a.startswith("--isa")]
    if "--isa" in sys.argv[1:]:  # "--isa X" as two words: drop X too
        i = sys.argv.index("--isa")
        argv = sys.argv[1:i] + sys.argv[i + 2:]
    for isa in isas:
        print(f"===== {isa}: {' '.join(f'{k}={v}' for k, v in ISA_ENV[isa].items()) or '(no ISA variables)'}",
              flush=True)
        with tempfile.TemporaryDirectory(prefix="titanctl-genbench-isa-") as tmp:
            out = Path(tmp) / "result.json"
            env = isa_environment(isa)
            code = subprocess.run([sys.executable, __file__, *argv, "--isa", "native", "--json", str(out)],
                                  env=env).returncode
            if code != 0:
                sys.exit(code)
            results[isa] = json.loads(out.read_text())
    print("===== summary: titanctl / transformers generate(), median of the rounds' rates")
    for isa, result in results.items():
        for name, ratio in result["ratios"].items():
            compiled = result["compile_seconds"].get(name)
            print(f"{isa:6s} ({result['capability']:7s}) {name:40s} decode {ratio['decode']:.2f}x, "
                  f"prefill {ratio['prefill']:.2f}x, same tokens: {ratio['same_tokens']}"
                  + (f"; compile {compiled:.1f} s" if compiled else ""))


def tensor_parallel(opts) -> None:
    """Under torchrun: TP over all ranks vs rank 0 alone, alternating."""
    from torch.distributed.device_mesh import init_device_mesh

    from titanctl.cli.console import finish
    from titanctl.parallel.runtime.env import init_process

    env = init_process(120)
    if not opts.shared_memory:
        shm_exchange.create = lambda group: None
    tp_threads = torch.get_num_threads()
    solo_threads = opts.threads or os.cpu_count() or 1
    mesh = init_device_mesh("cpu", (env.world_size,), mesh_dim_names=("tp",))
    prompt = prompt_ids(opts.prompt_len)
    length = opts.prompt_len + opts.new_tokens
    folder = [tempfile.mkdtemp(prefix="titanctl-genbench-") if env.rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)
    folder = Path(folder[0])
    if env.rank == 0:
        args = export_model(opts.flavor, folder, length)
    dist.barrier()
    sharded = Ours(folder, length, opts.compile, mesh)
    solo = Ours(folder, length, opts.compile) if env.rank == 0 else None  # safetensors: no collective

    def tp_run(prompt, new_tokens):
        torch.set_num_threads(tp_threads)
        return sharded(prompt, new_tokens)

    def solo_run(prompt, new_tokens):
        if env.rank == 0:
            torch.set_num_threads(solo_threads)
            timing = solo(prompt, new_tokens)
        dist.barrier()  # the others wait here while rank 0 decodes alone
        return timing if env.rank == 0 else Timing(1.0, 1.0, [0, 0])

    rates = alternating({f"tensor parallel {env.world_size}": tp_run, "1 process": solo_run}, prompt,
                        opts.new_tokens, opts.rounds, between=dist.barrier)
    model = sharded.decoder.model
    gather = inference_tp.rank_gather(model)
    exchange = exchange_seconds(gather, model.args.dim)
    transport = "shared memory" if gather.exchange is not None else "gloo"
    if env.rank == 0:
        mode = "compiled" if opts.compile else "eager"
        print(f"model {opts.flavor} ({num_params(args) / 1e6:.1f}M params), prompt {len(prompt)} tokens, "
              f"{opts.new_tokens} new tokens, greedy, fp32, {mode} decode step, median of {opts.rounds} "
              f"alternating rounds; TP: {transport}, {tp_threads} thread(s) per rank; "
              f"1 process: {solo_threads} thread(s)")
        print_rates(rates)
        tp, one = rates[f"tensor parallel {env.world_size}"], rates["1 process"]
        print(f"ratio tensor parallel {env.world_size}/1 process: decode {tp['decode'] / one['decode']:.2f}, "
              f"prefill {tp['prefill'] / one['prefill']:.2f}; tokens identical: {tp['tokens'] == one['tokens']}")
        collectives = 2 * model.args.n_layers + ("output" in inference_tp.sharded_linears(model, env.world_size))
        print(f"one collective of a decoded token ({transport}, tight loop): {exchange * 1e6:.0f} us; a token needs "
              f"{collectives}: {collectives * exchange * 1e3:.2f} ms of the {1e3 / tp['decode']:.2f} ms it takes")
        if opts.compile:
            print(f"compile time of the decode step: TP {sharded.compile_seconds:.1f} s, "
                  f"1 process {solo.compile_seconds:.1f} s (not in the rates)")
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    finish(0)


def exchange_seconds(gather, dim: int, repeats: int = 300) -> float:
    """Median seconds of the sum-over-ranks a decoded token waits for after wo and w2, in a tight loop."""
    partial = torch.randn(1, 1, dim)
    times = []
    for _ in range(5):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            gather(partial).sum(0)
        times.append((time.perf_counter() - start) / repeats)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's own choice)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="compile titanctl's decode step (default); --no-compile: eager only")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel degree: > 1 compares with 1 process")
    parser.add_argument("--shared-memory", action=argparse.BooleanOptionalAction, default=True,
                        help="TP ranks exchange through shared memory (default; what infer-tp does on one host) "
                             "or, with --no-shared-memory, through gloo (what ranks on different hosts do)")
    parser.add_argument("--isa", choices=("native", "avx2", "both"), default="native",
                        help="CPU code paths: this CPU's (default), AVX2 (ATEN_CPU_CAPABILITY=avx2, "
                             "ONEDNN_MAX_CPU_ISA=AVX2, in a subprocess), or both, one after the other")
    parser.add_argument("--kernels", action="store_true",
                        help="also time titanctl with the kernel choices it did not make (the other attention "
                             "in the compiled step, oneDNN linears, the other thread count)")
    parser.add_argument("--json", type=Path, help=argparse.SUPPRESS)  # where a per-ISA run leaves its result
    opts = parser.parse_args()
    if opts.isa != "native":
        if opts.tp != 1:
            parser.error("--isa avx2/both compares one process; run --tp with ATEN_CPU_CAPABILITY set instead")
        relaunch_per_isa(["native", "avx2"] if opts.isa == "both" else ["avx2"])
    elif opts.tp == 1:
        result = one_process(opts)
        if opts.json is not None:
            opts.json.write_text(json.dumps(result))
    elif "WORLD_SIZE" in os.environ:
        tensor_parallel(opts)
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.tp}",
               __file__, *sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
