"""The paged key/value cache (`nn.state.paged`) and the `Server` on it (`pages=`): a stream over
scattered pages equals the fixed cache whatever the pages held before, a batch of streams shares
one pool, and every request's tokens equal its solo `generate`, with and without prefix sharing,
with every page back in the pool after each workload."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dense_armor.huggingface import import_hf
from dense_armor.nn.models.generation import generate
from dense_armor.nn.state.paged import (
    PagedKVCache,
    paged_cache,
    paged_streams,
    stream_axes,
    with_tables,
)
from dense_armor.serving import Server
from dense_armor.serving.pages import PageBook
from test_language_models import DATA, PREFILL, STEP

LENGTHS = [5, 1, 12, 3, 21, 8, 2, 16, 9]
NEW = [6, 3, 9, 4, 2, 7, 5, 4, 8]
LONG = [9, 9, 9, 9, 8, 9, 9, 9, 9]  # request 4 writes 21 + 8 - 1 = 28 positions: 7 pages of 4


def _poisoned(cache):
    """Every pool full of NaN (int8 pools: their scales): rows a stream never wrote."""

    def one(node):
        if not isinstance(node, PagedKVCache):
            return node
        if node.key_scale is not None:
            nan = jnp.full_like(node.key_scale, jnp.nan)
            return eqx.tree_at(lambda c: (c.key_scale, c.value_scale), node, (nan, nan))
        nan = jnp.full_like(node.keys, jnp.nan)
        return eqx.tree_at(lambda c: (c.keys, c.values), node, (nan, nan))

    return jax.tree.map(one, cache, is_leaf=lambda n: isinstance(n, PagedKVCache))


@pytest.mark.parametrize(
    "name, kv_dtype", [("gpt2", None), ("llama_gqa", None), ("llama_gqa", "int8"), ("gemma2", None)]
)
def test_a_stream_over_scattered_pages_equals_the_fixed_cache(name, kv_dtype):
    model, _ = import_hf(DATA / name)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab, 20))
    expected, _ = PREFILL(model, ids, model.init_cache(32, on_overflow="nan", kv_dtype=kv_dtype))
    one = model.init_cache(32, on_overflow="nan", kv_dtype=kv_dtype)
    cache = _poisoned(paged_cache(one, pages=9, page_size=4, width=8))
    cache = with_tables(cache, jnp.array([5, 2, 7, 1, 3, 8, 4, 6]))
    first, cache = PREFILL(model, ids[:13], cache)  # a chunk across pages, then steps
    steps = []
    for token in ids[13:]:
        logits, cache = STEP(model, token, cache)
        steps.append(logits)
    got = jnp.concatenate([first, jnp.stack(steps)])
    assert bool(jnp.isfinite(got).all())
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_a_batch_of_streams_shares_one_pool():
    model, _ = import_hf(DATA / "llama_gqa")
    ids = np.random.default_rng(1).integers(0, model.vocab, 16)
    caches = paged_streams(paged_cache(model.init_cache(16, on_overflow="nan"), 9, 4, 4), 2)
    caches = with_tables(caches, jnp.array([[1, 2, 3, 4], [8, 7, 6, 5]]))
    axes = stream_axes(caches)
    step = jax.jit(jax.vmap(model.step, in_axes=(0, axes), out_axes=(0, axes)))
    outputs = []
    for t in range(8):
        logits, caches = step(jnp.asarray([ids[t], ids[t + 8]]), caches)
        outputs.append(logits)
    paged = [n for n in jax.tree.leaves(caches, is_leaf=lambda n: isinstance(n, PagedKVCache))]
    pools = [n.keys.shape for n in paged if isinstance(n, PagedKVCache)]
    assert pools and all(shape[0] == 9 for shape in pools)  # one pool each, no batch axis
    for row, start in enumerate((0, 8)):
        solo, _ = PREFILL(model, jnp.asarray(ids[start : start + 8]), model.init_cache(16))
        np.testing.assert_allclose(jnp.stack(outputs)[:, row], solo, atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def requests(request):
    model, _ = import_hf(DATA / request.param)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab, n).tolist() for n in LENGTHS]
    prompts[7], prompts[8] = prompts[4][:16], prompts[4][:9]  # prefixes of request 4's prompt
    greedy = np.asarray(generate(model, prompts, max(LONG)).tokens)
    return model, prompts, greedy


@pytest.mark.parametrize("share, steps", [(False, 1), (True, 1), (True, 5)])
def test_paged_requests_get_their_solo_tokens_and_every_page_comes_back(requests, share, steps):
    """(`steps`: decoding steps per dispatch; a request ends within a dispatch's steps.)"""
    model, prompts, greedy = requests
    server = Server(
        model, 4, 32, chunk=4, pages=12, page_size=4, share_prefixes=share, decode_steps=steps
    )
    done = server.serve(zip(prompts, NEW, strict=True))
    for n, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, greedy[n, : NEW[n]], err_msg=str(n))
    book = server._store.book
    assert (book.available, book.held) == (11, 0)  # 12 pages less the null page


def test_a_shared_prefix_is_computed_once_and_a_full_prompt_copies_its_last_page(requests):
    model, prompts, greedy = requests
    server = Server(model, 4, 32, chunk=4, pages=16, page_size=4, share_prefixes=True)
    server.serve([(prompts[4], NEW[4])])  # 21 tokens: 20 prefilled, 5 full pages keyed
    store = server._store
    plans = []
    take = store.book.take
    store.book.take = lambda *a: plans.append(take(*a)) or plans[-1]
    done = server.serve([(prompts[n], NEW[n]) for n in (7, 8, 4)])
    for completion, n in zip(done, (7, 8, 4), strict=True):
        np.testing.assert_array_equal(completion.tokens, greedy[n, : NEW[n]], err_msg=str(n))
    # 16 tokens, all in 4 keyed pages: it starts at its last token, in a copy of page 4;
    # 9 tokens: 2 keyed pages (8 tokens); the 21 tokens again: 5 pages (20 tokens).
    assert [p.start for p in plans] == [15, 8, 20]
    assert [c.cached_tokens for c in done] == [15, 8, 20]
    assert plans[0].copy is not None and plans[0].copy[0] not in plans[0].pages
    assert plans[1].copy is None and plans[1].pages[:2] == plans[0].pages[:2]
    assert (store.book.available, store.book.held) == (15, 0)


def test_steps_past_a_request_s_end_never_write_into_its_pages(requests):
    """A dispatch of 8 steps runs past a request that ends after 2: the steps past its pages
    write into the null page, not into a page of its table (its first, a shared prefix's, which
    a later request reads), and not into the pool's other pages."""
    model, prompts, greedy = requests
    server = Server(model, 2, 32, chunk=4, pages=16, page_size=4, decode_steps=8)
    base = prompts[4]  # 21 tokens; requests 7 and 8 are its prefixes (16 and 9 tokens)
    (short,) = server.serve([(prompts[8], 2)])  # 2 full pages keyed; its steps reach row 16
    np.testing.assert_array_equal(short.tokens, greedy[8, :2])
    done = server.serve([(prompts[7], NEW[7]), (base, NEW[4])])  # they read those 2 pages
    np.testing.assert_array_equal(done[0].tokens, greedy[7, : NEW[7]])
    np.testing.assert_array_equal(done[1].tokens, greedy[4, : NEW[4]])
    assert done[0].cached_tokens == 8 and done[1].cached_tokens >= 8  # the short one's pages


def _stepped(server, rounds):
    """Serve the queue by `step` (at most `rounds`): the completions by number, and the most
    pages held at once."""
    done, busiest = {}, 0
    for _ in range(rounds):
        for event in server.step():
            if event.completion is not None:
                done[event.completion.number] = event.completion
        busiest = max(busiest, server._store.book.held)  # pages, each counted once
        if server.idle:
            break
    assert server.idle
    return done, busiest


@pytest.mark.parametrize("share", [False, True])
def test_a_short_pool_preempts_the_youngest_and_recomputes_it(requests, share):
    # 7 pages of 4 positions for 4 slots whose requests grow to 3-7 pages each: the pool runs
    # short while they decode; the youngest gives its pages back and is recomputed later.
    model, prompts, greedy = requests
    server = Server(model, 4, 32, chunk=4, pages=8, page_size=4, share_prefixes=share)
    for n in range(9):
        server.submit(prompts[n], LONG[n])
    done, busiest = _stepped(server, 600)  # bounded: the workload takes under 300 rounds
    assert busiest <= 7 and sum(c.preempted for c in done.values()) > 0
    for n in range(9):
        np.testing.assert_array_equal(done[n].tokens, greedy[n, : LONG[n]], err_msg=str(n))
    assert (server._store.book.available, server._store.book.held) == (7, 0)
    with pytest.raises(ValueError, match="8 pages of 4; the pool has 7"):
        server.submit(prompts[4], 11)  # 21 + 11 - 1 = 31 positions


def test_requests_wait_for_the_pages_of_their_prompts(requests):
    # 3 pages of 4: request 4 (21 tokens) would need 6 to start; it is refused at `submit`,
    # and a 9-token prompt waits at the head of the queue until the 12-token one ends.
    model, prompts, greedy = requests
    server = Server(model, 2, 32, chunk=4, pages=4, page_size=4, share_prefixes=False)
    with pytest.raises(ValueError, match="pages of 4; the pool has 3"):
        server.submit(prompts[4], 1)
    server.submit(prompts[2], 1)  # 12 tokens: 3 pages
    server.submit(prompts[8], 1)  # 9 tokens: 3 pages, after the first
    (first,) = server.step()  # the first admitted and finished, the second still waiting
    assert first.completion.number == 0 and server.pending == 1
    done, _ = _stepped(server, 20)
    np.testing.assert_array_equal(first.completion.tokens, greedy[2, :1])
    np.testing.assert_array_equal(done[1].tokens, greedy[8, :1])


def test_sampled_paged_tokens_equal_the_fixed_slot_servers(requests):
    model, prompts, _ = requests
    key = jax.random.PRNGKey(3)
    rules = dict(temperature=0.9, top_k=20)
    fixed = Server(model, 3, 32, key, chunk=4, **rules).serve(zip(prompts, LONG, strict=True))
    paged = Server(model, 4, 32, key, chunk=4, pages=8, page_size=4, **rules)  # preempts
    served = paged.serve(zip(prompts, LONG, strict=True))
    assert sum(c.preempted for c in served) > 0
    for a, b in zip(fixed, served, strict=True):
        np.testing.assert_array_equal(a.tokens, b.tokens)


def test_page_keys_chain_over_the_prefix():
    book = PageBook(8, 2)
    a, b = book.digests(np.array([1, 2, 3, 4])), book.digests(np.array([3, 4, 3, 4]))
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # page [3, 4] after different pages
    plan = book.take(np.array([1, 2, 3, 4, 5]), 6, share=True)
    book.register(np.array([1, 2, 3, 4, 5]), plan.pages, 4)
    book.release(plan.pages)
    assert (book.available, book.held) == (7, 0)
    again = book.take(np.array([1, 2, 3, 4, 9]), 5, share=True)
    assert again.pages[:2] == plan.pages[:2] and again.start == 4


def test_the_longest_request_is_bounded_by_the_context_and_the_pool():
    model, _ = import_hf(DATA / "gpt2")
    assert Server(model, 2, 32).longest_request == 32
    server = Server(model, 2, 32, pages=4, page_size=4)  # 3 pages: 12 positions written
    assert server.longest_request == 13 and server.page_counts == (3, 0)
    server.submit([1] * 5, 8)  # 13 positions, the last new token not written
    with pytest.raises(ValueError, match="4 pages of 4; the pool has 3"):
        server.submit([1] * 5, 9)


@pytest.mark.parametrize(
    "options, error",
    [
        (dict(pages=1), ValueError),
        (dict(pages="8"), TypeError),
        (dict(pages=8, page_size=0), ValueError),
        (dict(pages=8, share_prefixes="yes"), TypeError),
        (dict(share_prefixes=True), ValueError),
    ],
)
def test_bad_paging_options_are_refused(options, error):
    model, _ = import_hf(DATA / "gpt2")
    with pytest.raises(error):
        Server(model, 2, 16, **options)


def test_a_hybrid_serves_from_pages_with_its_states_beside_them():
    # Qwen3.5: Gated DeltaNet states stay per slot, the attention layers' keys and values go to
    # the pool; a prefix cannot be shared (its pages are not the whole state), and a short pool
    # preempts and recomputes, every request still its solo tokens.
    model, _ = import_hf(DATA / "qwen3_5")
    with pytest.raises(ValueError, match="share_prefixes=True` needs a model whose every state"):
        Server(model, 2, 32, pages=8, page_size=4, share_prefixes=True).serve([([1, 2], 1)])
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, model.vocab, n).tolist() for n in (9, 3, 14, 6)]
    greedy = np.asarray(generate(model, prompts, 8).tokens)
    server = Server(model, 3, 32, chunk=4, pages=8, page_size=4)
    assert not server._slots().share
    done = server.serve([(p, 8) for p in prompts])
    for n, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, greedy[n], err_msg=str(n))
    assert sum(c.preempted for c in done) > 0
    assert (server._store.book.available, server._store.book.held) == (7, 0)


def test_a_scanned_model_serves_from_pages_token_exact():
    """`scan_layers=True`: the layers' caches stacked on a depth axis, so every pool, table and
    counter carries it (the pools' pages on axis 1); prefix sharing copies a page of every
    layer's pool, preemption recomputes, and each request still gets its solo tokens."""
    from dense_armor.nn.models.stack import scanned

    model, _ = import_hf(DATA / "llama_gqa")
    stacked = eqx.tree_at(lambda m: m.blocks, model, scanned(model.blocks))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab, n).tolist() for n in (5, 1, 12, 3, 21, 8)]
    prompts.append(prompts[4][:16])  # a whole prompt in shared pages: its last page copied
    greedy = np.asarray(generate(model, prompts, 6).tokens)
    server = Server(stacked, 3, 32, chunk=4, pages=10, page_size=4, share_prefixes=True)
    done = server.serve([(p, 6) for p in prompts])
    for n, completion in enumerate(done):
        np.testing.assert_array_equal(completion.tokens, greedy[n], err_msg=str(n))
    assert done[-1].cached_tokens == 15 and sum(c.preempted for c in done) > 0
    assert (server._store.book.available, server._store.book.held) == (9, 0)


def test_nothing_compiles_after_warm_up_whatever_the_load():
    """After `warm_up`, a paged server with shared prefixes serves prompts of every length up to
    its context, prompts that share prefixes (copied pages) and more than its pool holds at once
    (preemption and recompute) without tracing anything anew (JAX's monitoring events), each
    request its solo tokens."""
    from test_serving import Traces

    model, _ = import_hf(DATA / "llama_gqa")
    server = Server(
        model, 3, 32, chunk=4, pages=10, page_size=4, share_prefixes=True, decode_steps=3
    )
    server.warm_up()
    rng = np.random.default_rng(3)
    base = rng.integers(0, model.vocab, 31).tolist()
    prompts = [rng.integers(0, model.vocab, n).tolist() for n in range(1, 31)]
    prompts += [base[:n] for n in (31, 17, 9, 24, 31)]  # prefixes of one another, repeated
    new = [
        32 - len(p) if i % 3 == 0 else min(1 + i % 4, 32 - len(p)) for i, p in enumerate(prompts)
    ]
    with Traces() as traces:
        done = server.serve(zip(prompts, new, strict=True))
    assert traces.count == 0
    assert sum(c.preempted for c in done) > 0 and sum(c.cached_tokens for c in done) > 0
    for n in (0, 12, 29, 30, 34):  # a sample of them, against `generate` alone
        alone = np.asarray(generate(model, [prompts[n]], new[n]).tokens[0])
        np.testing.assert_array_equal(done[n].tokens, alone, err_msg=str(n))
