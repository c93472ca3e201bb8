"""Hybrid models, whose recurrent layers carry a state per sequence beside the attention layers'
KV cache (runner/engine/recurrent_state.py): LFM2's short convolutions (and LFM2-MoE's, with its
biased expert routing), the gated DeltaNet of Qwen3.5 and Qwen3-Next, Granite 4.0-H's and
Nemotron-H's Mamba2 layers (and Nemotron-H-MoE's, with its biased routing of ReLU^2 experts within
latent projections), Falcon-H1's beside its attention, and plain Mamba2's without attention (a
sequence's state alone). Whole models against
transformers in fp32, through one prefill, one-token steps and prefills split anywhere; the
state going back into a verify pass, saved and restored, per sequence in a batch; llama.cpp's
perplexity on ggrun's files."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from kernels_cpu.step_program import Op
from runner.engine.backend import make_backend
from runner.engine.batching import Batcher
from runner.engine.generate import generate
from runner.engine.kv_state import KVState
from runner.engine.kv_pool import STATE_CHECKPOINTS, states_held
from runner.engine.load import LoadOptions, load_model, memory_fit
from runner.engine.memory_fit import MemoryFitError
from runner.engine.sampler import Sampler, SamplingOptions
from runner.engine.speculative import (
    SpeculationStats,
    generate_speculative,
    make_drafter,
)

from .hf_folders import HYBRID_CONFIGS, converted_files, logits_by_passes, transformers_logits
from .llama_cpp import PERPLEXITY_TEXT, llama_cpp_perplexity

GREEDY = SamplingOptions(temperature=0)
SPLITS = (1, 2, 3, 7, 8, 40, 41)  # (passes of one token, a few, and many, at odd places)


@pytest.fixture(scope="module")
def hybrid_files(hybrid_folders, tmp_path_factory):
    """Each hybrid converted by ggrun to F32, and to Q4_K_M with its exact values (F32 again)."""
    return converted_files(hybrid_folders, tmp_path_factory.mktemp("hybrid-gguf"))


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_hybrids_match_transformers(hybrid_folders, hybrid_files, arch, device):
    if device == "torch-cpu":
        pytest.importorskip("torch")
    lm = load_model(hybrid_files[arch][0], LoadOptions(kv_type="f32", device=device))
    ids = np.random.default_rng(1).integers(0, lm.params.vocab_size, 64).tolist()
    want = transformers_logits(hybrid_folders[arch], ids)
    for got in logits_by_passes(lm, ids, SPLITS):
        assert np.array_equal(got.argmax(1), want.argmax(1))
        assert np.abs(got - want).max() < 1e-4 * np.abs(want).max()
    if device == "cpu":  # the steps replayed a recorded program that runs the recurrent layers inside it
        program = lm.backend.recorded_program(lm.model, lm.model.kv_type, 1, False)
        assert Op.SHORT_CONV in program.code[:, 0] and lm.backend.replay_checked
        assert (Op.DELTA_RULE in program.code[:, 0]) == arch.startswith("qwen")
        assert (Op.ROUTE in program.code[:, 0]) == (lm.params.n_expert > 0)  # (LFM2-MoE's with its selection bias)
        assert (Op.SSM_SCAN in program.code[:, 0]) == arch.startswith(("granite", "nemotron", "mamba2", "falcon"))


@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_quantized_hybrids_compute_their_exact_values(hybrid_files, arch):
    """Q4_K_M on the precise path against the same weights widened to F32 (within 2%: in eight
    layers of a mixture, an expert chosen otherwise by a rounding moves a few logits that much)."""
    _, q4, widened = hybrid_files[arch]
    ids = np.random.default_rng(3).integers(0, 50257, 24).tolist()
    exact = load_model(widened, LoadOptions(kv_type="f32"))
    exact = exact.model.forward(ids, exact.model.new_cache(64), all_logits=True)
    for got in logits_by_passes(load_model(q4, LoadOptions(kv_type="f32", precise=True)), ids, SPLITS):
        assert np.abs(got - exact).max() < 2e-2 * np.abs(exact).max()


def _delta_rule_reference(q, k, v, decay, beta, state, grouped):
    """The gated delta rule in float64, value head h over key head h // (value heads / key heads)
    where grouped (Qwen3-Next), else h % key heads (Qwen3.5)."""
    per_key, s, out = v.shape[1] // q.shape[1], state.astype(np.float64), np.zeros(v.shape)
    for t in range(q.shape[0]):
        for h in range(v.shape[1]):
            g = h // per_key if grouped else h % q.shape[1]
            s[h] *= np.exp(decay[t, h])
            s[h] += np.outer(k[t, g], (v[t, h] - s[h].T @ k[t, g]) * beta[t, h])
            out[t, h] = s[h].T @ q[t, g]
    return out, s


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("n", [1, 3, 5, 70, 193])  # (torch: token after token, then in chunks of 64, the last cut short)
def test_the_delta_rule_reads_each_value_heads_key_head(device, grouped, n):
    """backend.delta_rule on either layout of the value heads, its state carried in place."""
    if device == "torch-cpu":
        pytest.importorskip("torch")
    be, rng = make_backend(device), np.random.default_rng(5)
    q, k = (rng.standard_normal((n, 2, 8)).astype(np.float32) / 3 for _ in range(2))
    v = rng.standard_normal((n, 6, 4)).astype(np.float32)
    decay, beta = -rng.random((n, 6)).astype(np.float32), rng.random((n, 6)).astype(np.float32)
    start = rng.standard_normal((6, 8, 4)).astype(np.float32)
    want, want_state = _delta_rule_reference(q, k, v, decay, beta, start, grouped)
    state = be.new_state(start.shape)
    be.write_state(state, start)
    got = be.to_numpy(be.delta_rule(*map(be.asarray, (q, k, v, decay, beta)), state, grouped))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.abs(be.read_state(state) - want_state).max() < 1e-5 * np.abs(want_state).max()


@pytest.fixture(scope="module")
def hybrids(hybrid_files):
    return {arch: load_model(files[0], LoadOptions(kv_type="f32")) for arch, files in hybrid_files.items()}


@pytest.mark.parametrize("device", ["cpu", "torch-cpu"])
@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_the_state_goes_back_into_its_last_pass_only(hybrids, hybrid_files, arch, device):
    """A truncation inside the last pass leaves the state that pass had there (the next logits as
    a cache that stopped there); further back it is refused, changing nothing, but to the start."""
    if device == "torch-cpu":
        pytest.importorskip("torch")
    lm = hybrids[arch] if device == "cpu" else load_model(hybrid_files[arch][0], LoadOptions(kv_type="f32", device=device))
    model, ids = lm.model, list(range(100, 130))
    stopped = model.new_cache(64)
    model.forward(ids[:16], stopped)
    model.forward(ids[16:20], stopped)
    want = model.forward([7], stopped)
    cache = model.new_cache(64)
    cache.recurrent.undo = True  # (as speculative decoding asks)
    model.forward(ids[:16], cache)
    model.forward(ids[16:24], cache)
    assert cache.truncation_keeps(20) and not cache.truncation_keeps(10)
    with pytest.raises(ValueError, match="cannot go back to position 10"):
        cache.truncate(10)
    assert cache.used == 24
    cache.truncate(20)
    assert np.abs(model.forward([7], cache) - want).max() <= 1e-5 * np.abs(want).max()
    cache.truncate(0)
    fresh = model.new_cache(64)
    assert np.array_equal(model.forward(ids[:5], cache), model.forward(ids[:5], fresh))


class PartlyRight:
    """Drafts of 1 to 6 tokens of the plain continuation, the last one wrong: the target's state
    goes back over a rejected token after every depth of accepted ones."""

    def __init__(self, prompt: list[int], continuation: list[int]):
        self.n_prompt, self.continuation = len(prompt), continuation

    def propose(self, sequence, n, n_min):
        done = len(sequence) - self.n_prompt
        draft = list(self.continuation[done:done + min(n, 1 + done % 6)])
        return draft[:-1] + [draft[-1] + 1] if draft else []


@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_greedy_speculation_on_a_hybrid_is_plain_decoding(hybrids, arch, monkeypatch, tmp_path):
    """Token for token plain decoding, the target's state rolled back over rejected drafts (of a
    hybrid draft model, itself going back to where its drafts began, and of drafts right up to a
    point), the cache left as plain decoding leaves it."""
    monkeypatch.setenv("GGRUN_CACHE_DIR", str(tmp_path))
    lm = hybrids[arch]
    model = lm.model
    prompt = [1] + list(range(300, 320)) * 2
    plain = model.new_cache(256)
    want = list(generate(model, plain, prompt, Sampler(GREEDY), 40, stop_ids=()))
    after = model.forward([7], plain)
    for drafter in (make_drafter(lm, "self:Q4_0", 0, 256, False, 0.0,
                                 lambda path: load_model(path, LoadOptions(kv_type="f32"))),
                    PartlyRight(prompt, want)):
        spec, cache = SpeculationStats(), model.new_cache(256)
        got = list(generate_speculative(model, cache, prompt, Sampler(GREEDY), 40, (), drafter, draft_max=6,
                                        spec=spec))
        assert got == want
        assert spec.proposed > spec.accepted
        assert np.abs(model.forward([7], cache) - after).max() <= 1e-4 * np.abs(after).max()
    assert spec.accepted > 10


@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_a_hybrids_state_saves_and_restores(hybrids, arch, tmp_path):
    model, ids = hybrids[arch].model, list(range(200, 240))
    cache = model.new_cache(64)
    model.forward(ids, cache)
    cache.snapshot().save(tmp_path / "state.npz")
    want = model.forward([5, 6], cache, all_logits=True)
    fresh = model.new_cache(64)
    fresh.restore(KVState.load(tmp_path / "state.npz", fresh))
    assert np.array_equal(model.forward([5, 6], fresh, all_logits=True), want)


@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_hybrid_sequences_batch_as_they_run_alone(hybrids, arch):
    lm = hybrids[arch]
    prompts = [list(range(10, 30)), list(range(500, 507)), [1, 2, 3] * 9]
    want = [list(generate(lm.model, lm.model.new_cache(128), p, Sampler(GREEDY), 12, stop_ids=()))
            for p in prompts]
    batcher = Batcher(lm, slots=3, n_ctx=128)
    seqs = [batcher.add(p, Sampler(GREEDY), 12, stop_ids=()) for p in prompts]
    seqs.append(batcher.add(prompts[0], Sampler(GREEDY), 12, stop_ids=()))  # (the same prompt again: not reused)
    while batcher.step():
        pass
    assert [s.tokens for s in seqs] == want + want[:1]
    # (passes of three lanes replayed, in agreement with eager ones; experts' products of several
    # tokens run eagerly)
    if lm.backend.replays_lanes and not lm.params.n_expert:
        assert lm.backend.recorded_program(lm.model, lm.model.kv_type, 3, True, lanes=(1, 1, 1)) is not None


def test_the_memory_arithmetic_counts_what_a_hybrids_cache_holds(hybrids):
    """KV caches of the attention layers alone, and the recurrent state beside them."""
    for lm in hybrids.values():
        fit = memory_fit(lm.file, lm.params, "f32")
        cache = lm.model.new_cache(256)
        assert sum(a.nbytes for a in cache.keys + cache.values) == fit.kv_bytes(256)
        assert sum(a.nbytes for a in cache.recurrent.arrays.values()) == fit.state_bytes > 0
        assert fit.cache_bytes(256, users=2) == 2 * (fit.kv_bytes(256) + fit.state_bytes)


def test_a_servers_memory_check_counts_its_pools_state_checkpoints(hybrids, hybrid_files, monkeypatch):
    """A pool keeps recurrent states for its running sequences and its checkpoints: at most
    states_held of them however many prompts pass (LRU), and the memory check that a server's
    load runs counts them all, refusing where one state each would have fitted."""
    lm = hybrids["lfm2"]
    block = lm.backend.kv_block
    batcher = Batcher(lm, slots=2, n_ctx=1024, kv_tokens=(2 * STATE_CHECKPOINTS + 12) * block)  # (room to keep all)
    for j in range(STATE_CHECKPOINTS + 4):  # (each prompt fills a block of its own)
        batcher.add(list(range(1000 + j, 1000 + j + block + 3)), Sampler(GREEDY), 1, stop_ids=())
    while batcher.step():
        pass
    assert len(batcher.pool.checkpoints) == STATE_CHECKPOINTS and states_held(2) == 2 + STATE_CHECKPOINTS
    fit = memory_fit(lm.file, lm.params, "f32")
    one_each = fit.cache_bytes(1024, users=2)
    assert fit.cache_bytes(1024, users=2, states=states_held(2)) == one_each + STATE_CHECKPOINTS * fit.state_bytes
    monkeypatch.setattr("runner.engine.load.available_host_memory", lambda: int(one_each) + 1)
    options = LoadOptions(kv_type="f32", n_ctx=1024, kv_tokens=2048)
    load_model(hybrid_files["lfm2"][0], options)
    with pytest.raises(MemoryFitError, match="recurrent states"):
        load_model(hybrid_files["lfm2"][0], replace(options, states=states_held(2)))


@pytest.mark.parametrize("arch", ["lfm2", "qwen3_next", "mamba2"])
def test_a_hybrid_resumes_a_shared_prefix_from_its_state_checkpoint(hybrids, arch):
    """A prompt that starts with another's first block prefills only what follows it, from the
    state the pool kept after that block (a run's there); the text is what a run alone gives."""
    lm = hybrids[arch]
    batcher = Batcher(lm, slots=1, n_ctx=1024)
    block = batcher.pool.block
    system = list(range(1000, 1000 + block + 40))
    prompts = [system + [5, 6, 7], system + [9, 10], system[:20]]
    want = [list(generate(lm.model, lm.model.new_cache(1024), p, Sampler(GREEDY), 8, stop_ids=())) for p in prompts]
    seqs = []
    for prompt in prompts:
        seqs.append(batcher.add(prompt, Sampler(GREEDY), 8, stop_ids=()))
        while batcher.step():
            pass
    assert [s.tokens for s in seqs] == want
    assert [s.cached_tokens for s in seqs] == [0, block, 0]
    alone = lm.model.new_cache(1024)
    lm.model.forward(system[:block], alone)
    resumed = lm.model.sequence_cache(batcher.pool, 1024)
    assert resumed.start(prompts[1], True, 1024) == block
    got = resumed.recurrent.export()
    for name, state in alone.recurrent.export().items():
        assert np.abs(got[name] - state).max() <= 1e-5 * np.abs(state).max()


@pytest.mark.parametrize("arch", list(HYBRID_CONFIGS))
def test_llama_cpp_computes_ggruns_hybrid_files_alike(hybrid_files, llama_cpp_tools, tmp_path, arch):
    """llama.cpp loads ggrun's converted file and its perplexity on a text is ggrun's (both exact).
    (Qwen3.5-MoE's within 0.2%: llama.cpp's perplexity of this random mixture, near 8e6, is 0.09% above
    ggrun's from the first chunk on, where ggrun's logits equal transformers' within 1e-4; the others,
    LFM2-MoE's biased routing and Granite 4.0-H's mixture included, within 0.01%: the Mamba2 hybrids'
    within 1e-8 when measured.)"""
    from runner.measure.perplexity import perplexity
    (tmp_path / "text.txt").write_text(PERPLEXITY_TEXT)
    theirs = llama_cpp_perplexity(llama_cpp_tools, hybrid_files[arch][0], tmp_path / "text.txt")
    ours = perplexity(load_model(hybrid_files[arch][0], LoadOptions(kv_type="f32")), PERPLEXITY_TEXT, 128,
                      progress=False).ppl
    assert abs(ours / theirs - 1) < (2e-3 if arch == "qwen3_5_moe_text" else 1e-4), (ours, theirs)


def test_a_file_asking_for_grouped_expert_routing_is_refused(hybrid_files, tmp_path):
    """expert_group_count above 1 (DeepSeek-V3's grouped routing, which llama.cpp computes and ggrun's
    router does not) is refused by name, not run as plain routing."""
    from gguf import GGUFValueType

    from gguf_io import GGUFError, GGUFFile, MetadataValue, read_params

    from .gguf_copy import rewritten
    grouped = rewritten(hybrid_files["nemotron_h_moe"][0], tmp_path / "grouped.gguf",
                        {"nemotron_h_moe.expert_group_count": MetadataValue(GGUFValueType.UINT32, 2)})
    with pytest.raises(GGUFError, match="expert_group_count = 2 asks for grouped expert routing"):
        read_params(GGUFFile(grouped))


def test_a_hybrid_chat_resumes_from_its_saved_state_and_outlives_its_context(hybrids, tmp_path):
    """/save and /load keep the recurrent state with the KV cache; a chat goes on past its context
    (attention layers ring, recurrent layers carry their state on)."""
    from runner.engine.conversation import ChatSession, kv_path
    from runner.terminal.chat_repl import command
    lfm2 = hybrids["lfm2"]
    session = ChatSession(lfm2, 96, GREEDY, "Be brief.", max_reply=8)
    session.save_kv = True
    session.send("Name a colour.")
    saved, said = tmp_path / "talk.json", []
    command(session, f"/save {saved}", said.append)
    assert kv_path(saved).exists()
    want = session.send("And another?")
    resumed = ChatSession(lfm2, 96, GREEDY, None, max_reply=8)
    command(resumed, f"/load {saved}", said.append)
    assert "nothing prefilled" in said[1]
    assert resumed.send("And another?") == want
    for turn in range(8):
        resumed.send(f"Turn {turn}: one more, please.")
    assert resumed.cache.evicted > 0 and resumed.cache.used > 96


def test_a_granite_hybrid_with_rope_rotates_as_transformers_does(hybrid_folders, tmp_path):
    """Granite 4.0-H's attention layers rotate where the config's position_embedding_type is "rope"
    (rope.scaling.finetuned true; the published models apply none)."""
    import json
    import shutil

    from convert.convert import convert_hf
    folder = shutil.copytree(hybrid_folders["granitemoehybrid"], tmp_path / "rope")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "position_embedding_type": "rope"}))
    convert_hf(folder, tmp_path / "rope.gguf", "F32", progress=False)
    lm = load_model(tmp_path / "rope.gguf", LoadOptions(kv_type="f32"))
    assert lm.params.rope_finetuned
    ids = list(range(100, 140))
    want = transformers_logits(folder, ids)
    got = lm.model.forward(ids, lm.model.new_cache(64), all_logits=True)
    assert np.array_equal(got.argmax(1), want.argmax(1)) and np.abs(got - want).max() < 1e-4 * np.abs(want).max()
