"""Static-KV-cache decoding (one process; tensor parallel is in tests/distributed/test_infer_tp.py,
sampling in test_sampling.py, parity with transformers in test_generate_parity.py)."""

from __future__ import annotations

import pytest
import torch

from titanctl.errors import CheckpointError, ParallelError
from titanctl.inference.generate import CACHE_BUCKET, Decoder, cache_length, check_tp_degree, find_checkpoint, generate
from titanctl.inference.sampling import Sampling
from titanctl.models.common.args import ModelArgs
from titanctl.models.common.decoder import Transformer
from titanctl.parallel.layouts.weight_init import initialize_weights

ARGS = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=32, max_seq_len=64)
PROMPT = [1, 17, 99, 3, 250, 42, 7]


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread is faster on a shared machine
    m = Transformer(ARGS)
    initialize_weights(m, seed=3)
    yield m.eval()
    torch.set_num_threads(threads)


def positions(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)


@torch.no_grad()
def test_static_cache_logits_equal_the_full_forward_at_every_position(model):
    tokens = torch.tensor([PROMPT + [5, 6, 8, 200, 11]])  # (1, 12)
    full = model(tokens)
    model.setup_kv_cache(16)
    try:
        parts = [model(tokens[:, :7], input_pos=positions(0, 7))]  # prefill: causal over the prompt
        parts.append(model(tokens[:, 7:10], input_pos=positions(7, 10)))  # several new tokens at once
        parts += [model(tokens[:, i : i + 1], input_pos=positions(i, i + 1)) for i in (10, 11)]  # one at a time
    finally:
        model.clear_kv_cache()
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_decoder_steps_give_the_full_forward_logits(model):
    """What the generator runs (prefill, then its decode step at a position tensor) sees the
    logits of the full forward at every position, also when the cache holds an older sequence."""
    tokens = torch.tensor([PROMPT + [5, 6, 8, 200, 11]])
    full = model(tokens)
    decoder = Decoder(model, 16)
    try:
        decoder.generate([9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], 3)  # leaves other keys in the cache
        logits = [model(tokens[:, :7], input_pos=positions(0, 7))]
        for i in range(7, 12):
            logits.append(model(tokens[:, i : i + 1], input_pos=torch.tensor([i])))
    finally:
        decoder.close()
    torch.testing.assert_close(torch.cat(logits, dim=1), full, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_forward_without_input_pos_ignores_the_cache(model):
    tokens = torch.tensor([PROMPT])
    before = model(tokens)
    model.setup_kv_cache()
    try:
        model(tokens[:, :3], input_pos=positions(0, 3))
        assert torch.equal(model(tokens), before)
    finally:
        model.clear_kv_cache()
    assert all(layer.attention.cache is None for layer in model.layers.values())


def test_cache_is_preallocated_with_the_heads_of_wk(model):
    model.setup_kv_cache(10)
    try:
        cache = model.layers["0"].attention.cache
        assert cache.k.shape == cache.v.shape == (1, ARGS.kv_heads, 10, ARGS.head_dim)
        assert not any(name.startswith("layers.0.attention.cache") for name in model.state_dict())
    finally:
        model.clear_kv_cache()


def test_cache_longer_than_rope_table_and_overflow_are_refused(model):
    with pytest.raises(ValueError, match="max_seq_len"):
        model.setup_kv_cache(ARGS.max_seq_len + 1)
    decoder = Decoder(model, 10)
    try:
        with pytest.raises(ValueError, match="exceed the 10-position KV cache"):
            decoder.generate(PROMPT, 4)
    finally:
        decoder.close()


def test_greedy_with_cache_equals_recomputing_everything(model):
    cached = generate(model, PROMPT, 20, temperature=0)
    recomputed = generate(model, PROMPT, 20, temperature=0, kv_cache=False)
    assert cached.tokens == recomputed.tokens
    assert len(cached.tokens) == 20 and cached.stop_reason == "max_new_tokens"
    assert cached.tokens_per_second > 0 and cached.prompt_tokens == PROMPT


def test_sampling_is_reproducible_per_seed(model):
    a = generate(model, PROMPT, 24, temperature=1.0, top_k=50, seed=7)
    b = generate(model, PROMPT, 24, temperature=1.0, top_k=50, seed=7)
    c = generate(model, PROMPT, 24, temperature=1.0, top_k=50, seed=8)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens
    # the cache changes nothing but rounding: the same seed draws the same tokens without it
    assert generate(model, PROMPT, 24, temperature=1.0, top_k=50, seed=7, kv_cache=False).tokens == a.tokens


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(model):
    """One compiled decoder, greedy and sampled (two graphs); compile time is reported apart, and
    compiling comes after the first token (the prefill is eager): the user sees it first."""
    decoder = Decoder(model, len(PROMPT) + 16, compile=True)
    events = []
    try:
        greedy = decoder.generate(PROMPT, 16, on_first_token=lambda t: events.append(("first", t)),
                                  say=lambda text: events.append(("say", text)))
        sampled = decoder.generate(PROMPT, 16, Sampling(1.0, 50), seed=7)
        again = decoder.generate(PROMPT, 16, Sampling(1.0, 50), seed=7)
    finally:
        decoder.close()
    assert events[0] == ("first", greedy.tokens[0])
    assert events[1][0] == "say" and events[1][1].startswith("compiling the decode step")
    assert events[2][0] == "say" and events[2][1].startswith("decoding up to 15 more tokens (compiled")
    assert greedy.compile_seconds > 0 and sampled.compile_seconds > 0 and again.compile_seconds == 0
    assert greedy.tokens == generate(model, PROMPT, 16).tokens
    assert sampled.tokens == again.tokens == generate(model, PROMPT, 16, temperature=1.0, top_k=50, seed=7).tokens


def test_thread_counts_measured_on_the_work_change_no_token(model):
    """With candidate thread counts the prefill runs in chunks (one per candidate, then the rest)
    and eager decoding measures its first steps at each: the same tokens as at one count, the
    counts used are candidates, and torch's setting is left as it was."""
    new = 52  # enough tokens for the decode steps' probe
    plain = generate(model, PROMPT, new, temperature=0)
    before = torch.get_num_threads()
    probed = generate(model, PROMPT, new, temperature=0, threads=[2, 1])
    assert torch.get_num_threads() == before
    assert probed.tokens == plain.tokens
    assert set(probed.threads) == {"prefill", "decode"} and set(probed.threads.values()) <= {1, 2}
    assert plain.threads == {"prefill": before, "decode": before}
    sampled = generate(model, PROMPT, new, temperature=1.0, top_k=50, seed=7)
    assert generate(model, PROMPT, new, temperature=1.0, top_k=50, seed=7, threads=[2, 1]).tokens == sampled.tokens
    with pytest.raises(ValueError, match="at least 1"):
        Decoder(model, 16, threads=[0])


@torch.no_grad()
@pytest.mark.parametrize("threads", [(), (2, 1)], ids=["one_forward", "chunks_per_thread_count"])
def test_prefill_writes_the_cache_and_chooses_as_the_full_forward(model, threads):
    """The prefill reads only the cache's written prefix (causal for a forward from position 0)
    and computes the output layer at its last position only; in chunks when it measures thread
    counts. Its cache and first token are the plain forward's."""
    tokens = torch.tensor([PROMPT])
    full = model(tokens)[0, -1]
    decoder = Decoder(model, 32, threads=threads)
    try:
        first = decoder.generate(PROMPT, 1).tokens
        written = [(layer.attention.cache.k.clone(), layer.attention.cache.v.clone())
                   for layer in model.layers.values()]
        model(tokens, input_pos=positions(0, len(PROMPT)))  # the plain cached forward, over the whole cache
        for (k, v), layer in zip(written, model.layers.values()):
            cache = layer.attention.cache
            assert type(cache).__name__ == "KVCache"  # the prefill's view of it is gone
            torch.testing.assert_close(k[:, :, : len(PROMPT)], cache.k[:, :, : len(PROMPT)], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(v[:, :, : len(PROMPT)], cache.v[:, :, : len(PROMPT)], atol=1e-6, rtol=1e-5)
    finally:
        decoder.close()
    assert first == [int(full.argmax())]


@pytest.mark.slow
def test_run_says_each_phase_and_reports_rates_apart(model, tmp_path):
    """What infer-tp does, in this process: the first token is told before the decode step is
    compiled, and the report holds the prefill and decode rates with compile time and threads apart."""
    import torch.distributed.checkpoint as dcp

    from titanctl.checkpoint.trust.metadata import write_metadata
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.inference.generate import run

    args = ARGS.replace(vocab_size=Tokenizer().vocab_size, max_seq_len=256)
    small = Transformer(args)
    initialize_weights(small, seed=3)
    dcp.save({k: v.detach().clone() for k, v in small.state_dict().items()}, checkpoint_id=str(tmp_path),
             no_dist=True)
    write_metadata(tmp_path, args, step=1, weights_only=True, dtype="float32")
    said: list[str] = []
    threads = torch.get_num_threads()
    try:
        report = run(tmp_path, "To be, or not to be", max_new_tokens=64, temperature=0, compile=None, say=said.append)
    finally:
        torch.set_num_threads(threads)
    order = [next(i for i, text in enumerate(said) if text.startswith(start))
             for start in ("loading", "prefill of", "first token", "compiling the decode step", "decoding up to")]
    assert order == sorted(order), said
    data = report.as_dict()
    assert data["compiled"] and data["compile_seconds"] > 0  # 64 new tokens: compiled by default
    assert data["cache_length"] == cache_length(len(data["prompt_tokens"]) + 64, 256) > 64
    assert data["first_token_seconds"] > 0
    assert data["prefill_tokens_per_second"] > 0 and data["decode_tokens_per_second"] > 0
    assert set(data["threads"]) == {"prefill", "decode"}
    eager = generate(small, data["prompt_tokens"], 64, temperature=0, stop_tokens=Tokenizer().stop_tokens)
    assert data["tokens"] == eager.tokens


def test_cache_length_rounds_up_within_the_context():
    """infer-tp's cache: prompts of nearby lengths share one shape (one compiled decode step)."""
    assert cache_length(1, 4096) == cache_length(CACHE_BUCKET, 4096) == CACHE_BUCKET
    assert cache_length(CACHE_BUCKET + 1, 4096) == 2 * CACHE_BUCKET
    needed = 3 * CACHE_BUCKET - 5
    assert cache_length(needed, 4096) == 3 * CACHE_BUCKET
    assert cache_length(needed, needed + 2) == needed + 2  # never past the model's context
    assert cache_length(needed, needed) == needed


def test_top_k_1_is_greedy(model):
    greedy = generate(model, PROMPT, 12, temperature=0)
    assert generate(model, PROMPT, 12, temperature=0.7, top_k=1, seed=5).tokens == greedy.tokens


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_stop_token_ends_generation(model, interval):
    greedy = generate(model, PROMPT, 12, temperature=0)
    stop = greedy.tokens[3]
    decoder = Decoder(model, len(PROMPT) + 12, stop_check_interval=interval)
    try:
        stopped = decoder.generate(PROMPT, 12, stop_tokens={stop})
    finally:
        decoder.close()
    first = greedy.tokens.index(stop)
    assert stopped.tokens == greedy.tokens[: first + 1]
    assert stopped.stop_reason == "stop_token"


def test_tp_degree_must_divide_the_heads():
    check_tp_degree(ARGS, 2)
    with pytest.raises(ParallelError, match="n_heads = 4 is not divisible by the 3 processes"):
        check_tp_degree(ARGS, 3)
    with pytest.raises(ParallelError, match="n_kv_heads = 2 is not divisible by the 4 processes"):
        check_tp_degree(ARGS.replace(n_heads=8), 4)


def test_find_checkpoint_kinds_and_errors(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        find_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="is not a checkpoint"):
        find_checkpoint(tmp_path)
    import torch.distributed.checkpoint as dcp

    from titanctl.checkpoint.trust.metadata import write_metadata

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(ARGS).state_dict().items()}
    for step in (5, 12, 9):
        folder = tmp_path / "run" / f"step-{step}"
        dcp.save({k: torch.zeros(shape) for k, shape in shapes.items()}, checkpoint_id=str(folder), no_dist=True)
        write_metadata(folder, ARGS, step=step, weights_only=True, dtype="float32")
    (tmp_path / "run" / "step-20").mkdir()  # incomplete: no titanctl.json
    newest = find_checkpoint(tmp_path / "run")
    assert newest.folder.name == "step-12" and newest.args == ARGS and newest.kind == "dcp"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / ".metadata").write_bytes(b"")
    assert find_checkpoint(plain).args is None  # the model must come from a recipe
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        find_checkpoint(hf)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_training_dcp_checkpoint_loads_its_model_keys(model, tmp_path, dtype):
    """A full checkpoint has optimizer/train state beside the model keys; bf16 exports load into fp32."""
    import torch.distributed.checkpoint as dcp

    from titanctl.checkpoint.trust.metadata import write_metadata
    from titanctl.inference.generate import build_model, load_weights

    weights = {k: v.detach().to(dtype).clone() for k, v in model.state_dict().items()}
    state = {**weights, "optimizer": {"state": {"exp_avg": torch.ones(3)}}, "train_state": {"step": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)
    write_metadata(tmp_path, ARGS, step=7, weights_only=False, dtype=str(dtype).removeprefix("torch."))
    source = find_checkpoint(tmp_path)
    assert source.describe() == "DCP step 7"
    loaded = build_model(source.args, torch.device("cpu"))
    load_weights(loaded, source)
    for name, tensor in loaded.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, weights[name].float()), name
    assert torch.equal(loaded.rope_cache, model.rope_cache)


def test_dcp_checkpoint_of_another_model_is_refused(model, tmp_path):
    import torch.distributed.checkpoint as dcp

    from titanctl.checkpoint.trust.metadata import write_metadata
    from titanctl.inference.generate import build_model, load_weights

    dcp.save({k: v.detach().clone() for k, v in model.state_dict().items()}, checkpoint_id=str(tmp_path),
             no_dist=True)
    write_metadata(tmp_path, ARGS.replace(dim=128), step=1, weights_only=True, dtype="float32")
    with pytest.raises(CheckpointError, match="has shape"):  # refused before a model of its size is built
        source = find_checkpoint(tmp_path)
        load_weights(build_model(source.args, torch.device("cpu")), source)


@pytest.mark.parametrize("backend", ["MATH", "FLASH_ATTENTION"])
def test_one_position_attends_by_kv_group_as_grouped_query_attention(backend):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from titanctl.models.common.attention import cached_attention

    torch.manual_seed(0)
    q = torch.randn(2, 8, 1, 16)
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    mask = torch.arange(40)[None, :] <= 29  # (1, S): 30 positions written
    with sdpa_kernel(getattr(SDPBackend, backend)):
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        got = cached_attention(q, k, v, mask)
        # Head h belongs to key/value head h // 4: other keys for group 1 change only its 4 heads.
        k2 = k.clone()
        k2[:, 1] = torch.randn(2, 40, 16)
        changed = (cached_attention(q, k2, v, mask) != got).flatten(2).any(-1)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert changed[:, :4].logical_not().all() and changed[:, 4:].all()


# ------------------------------------------------------------------------------ long prompts and memory


def long_prompt_model(family: str):
    from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
    from titanctl.models.registry import build_model

    args = ARGS.replace(max_seq_len=256) if family == "llama3" else \
        DEEPSEEK_V3_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=256, max_seq_len=256)
    m = build_model(args)
    initialize_weights(m, seed=3)
    return m.eval()


class _AttentionShapes(torch.overrides.TorchFunctionMode):
    """(queries, keys) of every attention call."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[int, int]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.seen.append((args[0].shape[-2], args[1].shape[-2]))
        return func(*args, **(kwargs or {}))


@torch.no_grad()
@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
def test_a_long_prompt_prefills_in_chunks_over_the_written_positions_only(monkeypatch, family):
    """Issue 47: a 43k-token prompt to a DeepSeek folder allocated 7.4 GB at once (one forward's mask,
    prompt x cache, where latent attention read the whole cache; every layer's causal mask was kept
    besides). Chunks bound queries x keys; each attends to the positions up to its end (latent attention
    too); the cache and the tokens are the one forward's."""
    import titanctl.inference.generate as generation

    model = long_prompt_model(family)
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(0)).tolist()

    def prefill(elements: int):
        monkeypatch.setattr(generation, "PREFILL_MASK_ELEMENTS", elements, raising=False)
        decoder, shapes = Decoder(model, 192), _AttentionShapes()
        try:
            with shapes:  # the prefill alone
                decoder.generate(prompt, 1)
            caches = [{name: b[:, : len(prompt)].clone() if b.dim() == 3 else b[:, :, : len(prompt)].clone()
                       for name, b in layer.attention.cache.named_buffers() if name != "positions"}
                      for layer in model.layers.values()]
            tokens = decoder.generate(prompt, 4).tokens
        finally:
            decoder.close()
        return tokens, caches, set(shapes.seen)

    whole_tokens, whole_caches, whole_shapes = prefill(2**27)
    assert whole_shapes == {(150, 150)}  # one forward over the written prefix
    tokens, caches, shapes = prefill(1)  # the smallest chunks: CACHE_BUCKET tokens
    assert CACHE_BUCKET == 64 and shapes == {(64, 64), (64, 128), (22, 150)}
    assert tokens == whole_tokens
    for chunked, whole in zip(caches, whole_caches):
        for name in whole:
            torch.testing.assert_close(chunked[name], whole[name], atol=1e-5, rtol=1e-5)


def test_the_memory_estimate_is_what_the_cache_allocates():
    from titanctl.inference.generate import generation_bytes
    from titanctl.models.shapes import num_params

    for family in ("llama3", "deepseek_v3"):
        model = long_prompt_model(family)
        weights, cache = generation_bytes(model.args.replace(max_seq_len=192), tp=1)
        assert weights == 4 * num_params(model.args)
        model.setup_kv_cache(192)
        allocated = sum(b.numel() * b.element_size() for layer in model.layers.values()
                        for name, b in layer.attention.cache.named_buffers() if name != "positions")
        model.clear_kv_cache()
        # Latent attention: its cache, and one layer's keys and values expanded from it in each decode step.
        assert cache == allocated if family == "llama3" else allocated < cache < 10 * allocated


def test_the_prediction_depths_get_no_cache_and_the_estimate_counts_none():
    """Decoding runs the main layers only: a DeepSeek-V3 with a prediction depth caches its 2 main layers, and
    the memory check's cache is the model's without the depth."""
    from titanctl.inference.generate import generation_bytes
    from titanctl.models.deepseek_v3.args import DEEPSEEK_V3_FLAVORS
    from titanctl.models.registry import build_model

    args = DEEPSEEK_V3_FLAVORS["debugmodel"].replace(n_layers=2, vocab_size=256, max_seq_len=64, mtp_layers=1)
    with torch.device("meta"):
        model = build_model(args)
    model.setup_kv_cache(64)
    assert sorted(k for k, layer in model.layers.items() if layer.attention.cache is not None) == ["0", "1"]
    assert generation_bytes(args, tp=1)[1] == generation_bytes(args.replace(mtp_layers=0), tp=1)[1]


def test_a_generation_that_does_not_fit_in_memory_is_refused_before_loading(tmp_path, monkeypatch):
    """Issue 47: the KV cache is sized by the prompt and --max-new-tokens; when it and the weights exceed the
    memory available, one line says so before a weight is loaded."""
    import torch.distributed.checkpoint as dcp

    import titanctl.inference.generate as generation
    from titanctl.checkpoint.trust.metadata import write_metadata
    from titanctl.data.tokenizer import Tokenizer
    from titanctl.errors import ConfigError

    args = ARGS.replace(vocab_size=Tokenizer().vocab_size, max_seq_len=256)
    small = Transformer(args)
    dcp.save({k: torch.zeros_like(v) for k, v in small.state_dict().items()}, checkpoint_id=str(tmp_path),
             no_dist=True)
    write_metadata(tmp_path, args, step=1, weights_only=True, dtype="float32")
    weights = 4 * sum(p.numel() for p in small.parameters())  # float32
    cache = 4 * args.n_layers * 2 * args.kv_heads * args.head_dim * 256  # keys and values: the whole context

    def loaded(*a, **kw):
        raise AssertionError("loaded the model")

    monkeypatch.setattr(generation, "load_model", loaded)
    monkeypatch.setattr(generation, "available_bytes", lambda: weights + cache - 1, raising=False)
    with pytest.raises(ConfigError, match=r"the \d+-token prompt and --max-new-tokens 200 need a KV cache of 256 "
                                          r"positions: 0.00 GiB beside the model's 0.00 GiB per process, but this host "
                                          r"has available 0.00 GiB; give a shorter prompt or fewer new tokens"):
        generation.run(tmp_path, "To be, or not to be", max_new_tokens=200, temperature=0)


def test_inductor_options_measured_on_cpu_stay_on_cpu(model):
    """The C++ wrapper and one kernel thread were measured on CPUs; a model on another device (a GPU;
    meta stands in for it here) compiles its decode step with inductor's defaults."""
    from titanctl.inference.generate import _compile_options

    assert _compile_options(model) == {"cpp_wrapper": True, "cpp.threads": 1}
    with torch.device("meta"):
        elsewhere = Transformer(ARGS)
    elsewhere.init_buffers(torch.device("meta"))
    assert _compile_options(elsewhere) == {}


@torch.no_grad()
def test_a_long_prefill_says_how_far_it_is(monkeypatch):
    """Issue 57: a 43k-token prefill ran for minutes with nothing said after "prefill of ... tokens"."""
    import titanctl.inference.generate as generation

    monkeypatch.setattr(generation, "PREFILL_MASK_ELEMENTS", 1)  # chunks of CACHE_BUCKET tokens
    monkeypatch.setattr(generation, "PREFILL_PROGRESS_SECONDS", 0.0)  # a line after every chunk but the last
    decoder, heard = Decoder(long_prompt_model("llama3"), 192), []
    try:
        decoder.generate(list(range(150)), 1, say=heard.append)
    finally:
        decoder.close()
    progress = [line for line in heard if line.startswith("prefill:")]
    assert [line.split(" in ")[0] for line in progress] == ["prefill: 64 of 150 prompt tokens",
                                                             "prefill: 128 of 150 prompt tokens"]
    assert all(line.endswith("s left") for line in progress)
