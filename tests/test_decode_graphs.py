"""A continuous batch's decoding step replayed from a graph per (rows, columns) bucket
(rawserve.worker.decode_graphs).

Recording a CUDA graph needs a GPU; everything around it runs here, on a real tiny GPT-2:
the step on fixed views (rows padded to a bucket, the cache's columns to a power of two,
the new column written where a tensor says, the window cut by the mask) gives the
tokens the loop gives without it, through joins, leaves, a buffer that grows and one
that compacts; the graphs go when the buffers are new; a failed recording or a replay
that differs leaves the model stepping as it is. Only the CUDA part of the recording is
replaced (tests/graph_recording.py): the step is recorded by its own code, refusing any
read of a tensor's values back to the host meanwhile as CUDA refuses it, and a replay
runs it again, on the same tensors, into the tensors the recording returned."""

from __future__ import annotations

import copy
import dataclasses
import logging
import random
import types
from collections.abc import Sequence

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from rawserve.worker import decode_graphs, kv_slots, prefill_graphs  # noqa: E402
from rawserve.worker.continuous import ContinuousBatcher, Generation  # noqa: E402
from rawserve.worker.decode_graphs import GraphedDecode, column_bucket, row_bucket  # noqa: E402
from rawserve.worker.prefill_graphs import GraphedPrefill  # noqa: E402
from tests import graph_recording  # noqa: E402

POSITIONS = 256


@pytest.fixture
def recorded(monkeypatch):
    """The decoding steps' graphs recorded in the test, each with its (rows, columns); the
    prefills' in `recorded.prefills`, with their (rows, tokens). Each is recorded by the
    graphed pass's own recording, as a GPU records (tests/graph_recording.py): a read of
    a tensor's values back to the host while it records fails it."""
    graphs = Recorded()
    graph_recording.recorded_as_a_gpu_records(monkeypatch)
    record_step, record_prefill = GraphedDecode._record, GraphedPrefill._record

    def step(self, slots, rows, columns):
        graph, logits = record_step(self, slots, rows, columns)
        graph.shape = rows, columns
        graphs.append(graph)
        return graph, logits

    def prefill(self, ids, mask):
        graph, outputs = record_prefill(self, ids, mask)
        graph.shape = tuple(ids.shape)
        graphs.prefills.append(graph)
        return graph, outputs

    monkeypatch.setattr(GraphedDecode, "_record", step)
    monkeypatch.setattr(GraphedPrefill, "_record", prefill)
    return graphs


class Recorded(list):
    def __init__(self):
        super().__init__()
        self.prefills: list[graph_recording.Rerun] = []


class NoText:
    eos_token_id = None
    unk_token_id = None
    all_special_ids: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[None]:
        return [None] * len(tokens)  # no byte tokens


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=POSITIONS, n_embd=32, n_layer=2, n_head=2,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


def run(model, cuda_graphs: bool, rounds: Sequence[Sequence[tuple[int, int]]], rows: int = 64):
    """Each round's (prompt length, new tokens) sequences join after a few steps of the
    last; every sequence's tokens, by key."""
    rng = random.Random(7)
    batcher = ContinuousBatcher(model, NoText(), POSITIONS, rows, cuda_graphs=cuda_graphs)
    made: dict[int, list[int]] = {}
    key = 0
    for round_ in rounds:
        for length, new in round_:
            prompt = [rng.randrange(1, 512) for _ in range(length)]
            batcher.add(Generation(key, prompt, new))
            key += 1
        for _ in range(3):
            for generation in batcher.step():
                made[generation.key] = generation.tokens
    while batcher.busy:
        for generation in batcher.step():
            made[generation.key] = generation.tokens
    return made, batcher


def test_copies_of_a_prompt_replay_one_row_of_a_prefill_graph_each_then_go_on_alike(
    model, recorded
):
    def copies(cuda_graphs: bool) -> dict[int, list[int]]:
        batcher = ContinuousBatcher(model, NoText(), POSITIONS, 8, cuda_graphs=cuda_graphs)
        for key, prompt in enumerate([[5, 6, 7], [9] * 12, [5, 6, 7], [5, 6, 7], [9] * 12]):
            batcher.add(Generation(key, prompt, 6))
        made = {}
        while batcher.busy:
            made.update((g.key, g.tokens) for g in batcher.step())
        return made

    plain = copies(False)
    assert copies(True) == plain
    assert plain[0] == plain[2] == plain[3] and plain[1] == plain[4]  # greedy copies
    assert [p.shape for p in recorded.prefills] == [(2, 16)]  # one row a prompt


def test_a_step_runs_at_the_next_bucket_of_rows_and_a_power_of_two_of_columns():
    assert row_bucket(1, 64) == 1
    assert row_bucket(3, 64) == 4
    assert row_bucket(50, 64) == 64
    assert row_bucket(50, 56) == 56  # never more rows than the buffers hold
    assert row_bucket(513, 1024) is None  # past the largest bucket: as it is
    assert column_bucket(0, 512) == 128
    assert column_bucket(127, 512) == 128
    assert column_bucket(128, 512) == 256  # the new column is attended: past `end`
    assert column_bucket(300, 512) == 512
    assert column_bucket(300, 320) == 320  # never past the buffers' length
    assert column_bucket(10, 64) == 64


ROUNDS = [
    [(5, 12), (17, 3), (9, 40)],  # one ends at once, the others go on
    [(30, 70), (2, 1)],  # a longer prompt joins the running rows; one token only
    [(11, 90)] + [(4, 6)] * 9,  # rows past the buffers' first rows: they grow
    [(60, 20)],
]


def test_graphed_steps_make_the_tokens_the_loop_makes_without_them(model, recorded):
    plain, _ = run(model, False, ROUNDS)
    graphed, batcher = run(model, True, ROUNDS)
    assert graphed == plain
    assert sum(len(tokens) for tokens in plain.values()) == sum(n for r in ROUNDS for _, n in r)
    rows = {g.shape[0] for g in recorded}
    assert len(rows) >= 3 and {g.shape[1] for g in recorded} >= {64, 128}  # several buckets
    assert sum(g.replays for g in recorded) > 50  # the steps ran from the graphs
    assert not batcher.decode_graphs.shelf.failed
    # the joins' prefills too, each round's rows and tokens padded to a bucket
    assert {p.shape for p in recorded.prefills} == {(4, 32), (2, 32), (16, 16), (1, 64)}
    assert not batcher.prefill_graphs.shelf.failed


def test_the_graphs_go_when_the_buffers_are_new_and_the_tokens_stay_right(
    model, recorded, monkeypatch
):
    monkeypatch.setattr(kv_slots, "FIRST_LENGTH_CAPACITY", 8)  # columns outgrown at once
    rounds = [[(6, 50), (3, 45)], [(20, 30)], [(2, 60)]]
    plain, _ = run(model, False, rounds)
    graphed, batcher = run(model, True, rounds)
    assert graphed == plain
    assert batcher._slots.layout > 1  # the buffers were allocated again, more than once
    assert batcher.decode_graphs.layout == batcher._slots.layout  # the graphs left are theirs
    assert len(recorded) > len(batcher.decode_graphs.shelf.graphs)  # old ones were dropped


def test_graphs_that_go_take_their_memory_pool_with_them(model, recorded):
    """A pool whose graphs are all freed is freed too: recording into its old handle
    fails (an internal assertion of PyTorch's allocator, seen on an H100)."""
    batcher = ContinuousBatcher(model, NoText(), POSITIONS, 8, cuda_graphs=True)
    batcher.add(Generation(0, [5, 6, 7], 4))
    batcher.step()
    graphed = batcher.decode_graphs
    graphed.shelf.pool = "a pool's handle"
    batcher._slots.layout += 1  # as when the buffers are allocated anew
    batcher.step()  # its step recorded anew, into a pool of its own
    assert graphed.shelf.pool not in (None, "a pool's handle")
    assert graphed.layout == batcher._slots.layout and len(recorded) == 2


def test_a_failed_recording_leaves_the_model_stepping_as_it_is(model, monkeypatch, caplog):
    def fail(self, slots, rows, columns):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(GraphedDecode, "_record", fail)
    plain, _ = run(model, False, ROUNDS[:2])
    graphed, batcher = run(model, True, ROUNDS[:2])
    assert graphed == plain
    assert batcher.decode_graphs.shelf.failed and not batcher.decode_graphs.shelf.graphs
    assert "recording a decoding step failed" in caplog.text


def test_a_replay_that_differs_from_the_step_as_it_is_turns_the_graphs_off(
    model, recorded, monkeypatch, caplog
):
    fixed_step = GraphedDecode.fixed_step

    def wrong(self, slots, rows, columns):
        return fixed_step(self, slots, rows, columns) + 1.0  # a pass that records wrongly

    monkeypatch.setattr(GraphedDecode, "fixed_step", wrong)
    plain, _ = run(model, False, ROUNDS[:2])
    graphed, batcher = run(model, True, ROUNDS[:2])
    assert graphed == plain  # the first step was answered by the step as it is
    assert batcher.decode_graphs.shelf.failed
    assert "differs from the pass as it is" in caplog.text


def test_a_padded_row_never_turns_nan_and_a_finished_rows_column_is_masked(model, recorded):
    """Rows padded into a bucket read free rows of the buffers (old keys, an old mask):
    the window and their own new column keep them finite, so no NaN reaches the keys a
    later row joins beside. A row that finished leaves its column masked: the rows
    beside it and the row that joins give the tokens the step as it is gives."""
    rounds = [[(3, 5), (40, 60), (7, 2)], [(5, 30)]]
    plain, _ = run(model, False, rounds)
    graphed, batcher = run(model, True, rounds)
    assert graphed == plain
    assert not batcher.decode_graphs.shelf.failed and len(recorded) >= 2  # the graphs answered
    for graph in recorded:
        assert torch.isfinite(graph.output).all()


def test_a_row_that_joins_the_slot_a_longer_row_left_never_reads_its_old_keys(model, recorded):
    """The leaving row's keys and mask stay in its slot's columns before the window's
    start, where the fixed views still reach: the window's bounds mask them out."""
    rounds = [[(5, 40), (60, 2)], [], [(2, 20)]]
    plain, _ = run(model, False, rounds)
    graphed, batcher = run(model, True, rounds)
    assert graphed == plain
    assert not batcher.decode_graphs.shelf.failed and len(recorded) >= 2  # the graphs answered


def test_a_prefill_runs_at_powers_of_two_of_rows_and_tokens_within_the_model(model):
    graphed = GraphedPrefill(model, "cache", 100, lambda ids, mask: ([], [], ids))
    assert graphed._shape(1, 5) == (1, 8)
    assert graphed._shape(3, 20) == (4, 32)
    assert graphed._shape(16, 64) == (16, 64)
    assert graphed._shape(16, 65) is None  # 16 x 128 padded tokens: past the most
    assert graphed._shape(1, 97) == (1, 100)  # never more tokens than the model reads
    assert graphed._shape(1, 101) is None  # too long: runs as it is, and fails as it would


def test_a_prefill_too_large_to_keep_a_graph_of_runs_as_it_is(model, recorded, monkeypatch):
    monkeypatch.setattr(prefill_graphs, "MAX_PREFILL_TOKENS", 64)
    rounds = [[(40, 3)], [(20, 3)] * 3, [(70, 2)]]  # 1 x 64; 4 x 32 (128); 1 x 128
    plain, _ = run(model, False, rounds)
    graphed, batcher = run(model, True, rounds)
    assert graphed == plain
    assert [p.shape for p in recorded.prefills] == [(1, 64)]
    assert not batcher.prefill_graphs.shelf.failed
    monkeypatch.setattr(prefill_graphs, "MAX_PREFILL_BYTES", 1000)  # a few tokens' keys
    assert batcher.prefill_graphs._shape(1, 8) is None


def test_a_prefill_that_replays_differently_turns_its_graphs_off_not_the_steps(
    model, recorded, monkeypatch, caplog
):
    fixed_prefill = GraphedPrefill.fixed_prefill

    def wrong(self, ids, mask):
        logits, layers = fixed_prefill(self, ids, mask)
        return logits - 1.0, layers

    monkeypatch.setattr(GraphedPrefill, "fixed_prefill", wrong)
    plain, _ = run(model, False, ROUNDS)
    graphed, batcher = run(model, True, ROUNDS)
    assert graphed == plain
    assert batcher.prefill_graphs.shelf.failed and not batcher.decode_graphs.shelf.failed
    assert "recording a prefill failed" in caplog.text


def test_models_whose_attention_takes_no_4d_mask_step_as_they_are(model):
    assert GraphedDecode.supports(model)
    flash = transformers.GPT2LMHeadModel(copy.deepcopy(model.config))
    flash.config._attn_implementation = "flash_attention_2"
    assert not GraphedDecode.supports(flash)
    batcher = ContinuousBatcher(flash, NoText(), POSITIONS, 4, cuda_graphs=True)
    assert batcher.decode_graphs is None and batcher.prefill_graphs is None
    # a sliding window: the graphs' masks would let a row see past it
    mistral = transformers.MistralConfig(num_hidden_layers=1, sliding_window=16)
    mistral._attn_implementation = "sdpa"
    assert not GraphedDecode.supports(types.SimpleNamespace(config=mistral))
    mistral.sliding_window = None
    assert GraphedDecode.supports(types.SimpleNamespace(config=mistral))
    gemma = transformers.Gemma2Config(num_hidden_layers=2, sliding_window=None)
    gemma._attn_implementation = "sdpa"  # its layers still slide by kind, one in two
    assert not GraphedDecode.supports(types.SimpleNamespace(config=gemma))


def test_past_the_most_shapes_new_ones_step_as_they_are(model, recorded, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(decode_graphs, "MAX_DECODE_GRAPHS", 1)
    plain, _ = run(model, False, ROUNDS)
    graphed, batcher = run(model, True, ROUNDS)
    assert graphed == plain
    assert len(batcher.decode_graphs.shelf.graphs) <= 1 and not batcher.decode_graphs.shelf.failed
    assert "a decoding step: 1 shapes recorded" in caplog.text


def test_recording_at_the_warm_up_covers_every_row_bucket_and_nobody_hears_it(model, recorded):
    heard: list = []
    batcher = ContinuousBatcher(
        model, NoText(), POSITIONS, 16, lambda g, t, p: heard.append(t), cuda_graphs=True
    )
    batcher._slots.free_memory = lambda: 1 << 30  # a GPU's buffers: every row at once
    count = batcher.record_graphs([5, 6, 7, 8, 9])
    assert {g.shape[0] for g in recorded} == {1, 2, 4, 8, 12, 16}  # every bucket to 16 rows
    # the rows' prefills, then one prompt's at every power of two of tokens the model takes
    # (256 positions, 3 tokens made: up to 128)
    rows_prefills = {(1, 8), (2, 8), (4, 8), (8, 8), (16, 8)}
    lengths_prefills = {(1, 16), (1, 32), (1, 64), (1, 128)}
    assert {p.shape for p in recorded.prefills} == rows_prefills | lengths_prefills
    assert {g.shape for g in recorded if g.shape[0] == 1} >= {(1, 128), (1, 256)}
    assert count == len(recorded) + len(recorded.prefills) and not heard
    assert not batcher.busy and batcher._slots.rows == 0
    before = len(recorded)
    batcher.add(Generation("a client", [5, 6, 7], 4))
    while batcher.busy:
        batcher.step()
    assert heard and len(recorded) == before  # its steps found their graphs


def test_a_generation_worker_records_its_graphs_at_the_warm_up(tiny_model, recorded, caplog):
    from rawserve.worker.causal_lm import CausalLMRunner
    from rawserve.worker.generating import continuous_loop
    from tests.tiny_models import worker_config

    caplog.set_level(logging.INFO)
    runner = CausalLMRunner(tiny_model("text-generation"), "cpu", torch.float32)
    assert runner.use_cuda_graphs().startswith("on:") and runner.decode_graphs
    config = worker_config(runner.model.name_or_path, max_sequences=4, warmup_batch=1)
    loop = continuous_loop(runner, config, lambda message: None, None)
    assert loop is not None and loop.batcher.decode_graphs is not None
    assert {g.shape[0] for g in recorded} == {1, 2, 4}
    assert (1, 64) in {p.shape for p in recorded.prefills}
    assert "recorded at the warm-up" in caplog.text
    unwarmed = dataclasses.replace(config, warmup_batch=0)  # --no-warmup: nothing recorded
    recorded.clear()
    continuous_loop(runner, unwarmed, lambda message: None, None)
    assert not recorded


@pytest.mark.parametrize("reading", ["every pass", "prefills"])
def test_graphs_the_warm_up_failed_to_record_are_off_in_what_the_worker_says(
    tiny_model, recorded, reading
):
    """A recording that reads a tensor back to the host fails on a GPU, and its graphs are
    off for good: the worker's `cuda_graphs` (which /info shows) says so after the
    warm-up, instead of "on"."""
    from rawserve.worker.causal_lm import CausalLMRunner
    from rawserve.worker.generating import continuous_loop
    from tests.tiny_models import worker_config

    runner = CausalLMRunner(tiny_model("text-generation"), "cpu", torch.float32)
    runner.cuda_graphs = runner.use_cuda_graphs()

    def read_back(_module, args, _output) -> None:
        if reading == "every pass" or args[0].shape[1] > 1:  # (a step's input: one token)
            assert bool(args[0].ge(0).all())

    runner.model.get_input_embeddings().register_forward_hook(read_back)
    config = worker_config(runner.model.name_or_path, max_sequences=4, warmup_batch=1)
    loop = continuous_loop(runner, config, lambda message: None, None)
    assert loop is not None and loop.batcher.prefill_graphs.shelf.failed
    why = "recording a prefill failed at the warm-up (the log says why)"
    if reading == "every pass":
        assert loop.batcher.decode_graphs.shelf.failed
        why = why.replace("a prefill", "a decoding step and a prefill")
        assert runner.cuda_graphs == f"off: {why}, so it runs as it is"
    else:
        assert not loop.batcher.decode_graphs.shelf.failed and recorded
        assert runner.cuda_graphs.startswith("on: continuous batching's decoding steps")
        assert runner.cuda_graphs.endswith(f"; but {why}, so that runs as it is")


def test_a_failed_recording_at_the_warm_up_leaves_the_worker_starting(
    tiny_model, monkeypatch, caplog
):
    from rawserve.worker.causal_lm import CausalLMRunner
    from rawserve.worker.generating import continuous_loop
    from tests.tiny_models import worker_config

    def out_of_memory(self, prompt):
        self.add(Generation("warm", prompt, 3))
        self.step()
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(ContinuousBatcher, "record_graphs", out_of_memory)
    runner = CausalLMRunner(tiny_model("text-generation"), "cpu", torch.float32)
    runner.decode_graphs = True
    config = worker_config(runner.model.name_or_path, max_sequences=4, warmup_batch=1)
    loop = continuous_loop(runner, config, lambda message: None, None)
    assert loop is not None and not loop.batcher.busy and not loop.batcher.rows
    assert "recording at the warm-up failed" in caplog.text


def test_every_setting_a_row_may_have_steps_from_graphs_as_it_does_without(tiny_model, recorded):
    """Greedy and sampled rows (seeded, copies of one prompt), log probabilities with the
    likeliest tokens, penalties, a logit bias, min_new_tokens, stop sequences, a grammar,
    a prompt prefilled in chunks and one whose scores are listed, rows joining and
    leaving: each recorded as a GPU records (nothing read back to the host meanwhile),
    the tokens and log probabilities the loop makes without."""
    from rawserve.worker.causal_lm import CausalLMRunner
    from rawserve.worker.scores import ScoreAdjustments

    runner = CausalLMRunner(tiny_model("text-generation"), "cpu", torch.float32)
    encode = runner.tokenizer.encode
    sampled = {"do_sample": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9}

    def generations(key: int) -> list[Generation]:
        """The rows joining at round `key`, each with settings of its own."""
        prompt = encode(["the movie was", "paris is", "a"][key % 3])
        return [
            Generation((key, 0), prompt, 8, logprobs=[], top_n=3),
            Generation((key, 1), prompt, 8, seed=key, logprobs=[], **sampled),
            Generation((key, 2), prompt, 8, seed=key + 7, min_p=0.01, typical_p=0.9, **sampled),
            Generation((key, 3), encode("my day"), 9, repetition_penalty=1.3, min_new_tokens=4),
            Generation(
                (key, 4),
                prompt,
                7,
                adjustments=ScoreAdjustments(((encode(" the")[0], 3.0),), 0.5, 0.2),
                stop=["t t t"],
            ),
            Generation((key, 5), prompt, 6, grammar=runner.grammars.pending(DIGITS).held()),
            Generation((key, 6), encode("my day was good " * 8), 5),  # prefilled in chunks
            scored(Generation((key, 7), encode("paris is"), 4)),  # its prompt's scores
        ]

    def scored(generation: Generation) -> Generation:
        generation.scoring = runner.listing_prefill(generation, {})
        return generation

    def made(cuda_graphs: bool) -> dict:
        batcher = ContinuousBatcher(
            runner.model, runner.tokenizer, runner.max_positions, 24, cuda_graphs=cuda_graphs
        )
        batcher.prefill_chunk = 16  # a chunk a step for a prompt longer than that
        done = {}
        for key in range(3):  # a round joins while the rows before it run
            for generation in generations(key):
                batcher.add(generation)
            for _ in range(3):
                done.update((g.key, g) for g in batcher.step())
        while batcher.busy:
            done.update((g.key, g) for g in batcher.step())
        return done

    plain, graphed = made(False), made(True)
    assert len(plain) == 24 and not any(g.failure for g in plain.values())
    for key, generation in plain.items():
        assert graphed[key].tokens == generation.tokens, key
        assert graphed[key].finish_reason == generation.finish_reason
        assert graphed[key].prefill == generation.prefill
        if generation.logprobs is not None:
            assert graphed[key].logprobs == pytest.approx(generation.logprobs, abs=1e-4)
    assert {plain[(key, 4)].finish_reason for key in range(3)} == {"stop_sequence"}
    assert len(plain[(0, 6)].prompt_ids) > 16 and len(plain[(0, 7)].prefill) == 2
    decode = runner.tokenizer.decode
    texts = [decode(plain[(k, 5)].tokens, skip_special_tokens=True) for k in range(3)]
    assert all(len(text) == 3 and text.isdigit() for text in texts)  # its grammar held
    assert sum(g.replays for g in recorded) > 10 and recorded.prefills


DIGITS = {"type": "regex", "value": "[0-9]{3}"}
