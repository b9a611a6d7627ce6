"""The block pool against a plain per-block reference model, and the engine's reuse of prompt
keys handed in by the caller. The pool does its bookkeeping with bulk operations for speed;
these tests pin that it makes exactly the decisions (and events, in order) of the simple
block-by-block algorithm described in services/core/kvcache.py."""

from __future__ import annotations

import random
from collections import OrderedDict

from services.common import schemas
from services.core.engine import Engine, EngineConfig, SimRequest
from services.core.keys import block_keys
from services.core.kvcache import BlockPool


class RefPool:
    """One dict entry per block, one step at a time: the reference semantics."""

    def __init__(self, n: int, bs: int) -> None:
        self.bs = bs
        self.ref = [0] * n
        self.key: list[int | None] = [None] * n
        self.empty = list(range(n - 1, -1, -1))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}
        self.events: list[tuple] = []

    def match(self, keys):
        out = []
        for k in keys:
            if k not in self.cached:
                break
            out.append(self.cached[k])
        return out

    def touch(self, ids):
        for b in ids:
            if self.ref[b] == 0:
                self.lru.pop(b, None)
            self.ref[b] += 1

    def allocate(self, n):
        out, evicted = [], []
        for _ in range(n):
            if self.empty:
                b = self.empty.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.cached[self.key[b]]
                evicted.append(self.key[b])
                self.key[b] = None
            self.ref[b] = 1
            out.append(b)
        if evicted:
            self.events.append(("removed", tuple(evicted)))
        return out

    def free(self, ids):
        for b in reversed(ids):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if self.key[b] is None:
                    self.empty.append(b)
                else:
                    self.lru[b] = None

    def register(self, ids, keys, parent, tokens):
        run, run_tok, run_parent = [], [], parent
        for i, (b, k) in enumerate(zip(ids, keys, strict=True)):
            if k in self.cached:
                if run:
                    self.events.append(("stored", tuple(run), run_parent, tuple(run_tok)))
                run, run_tok, run_parent = [], [], k
                continue
            self.key[b] = k
            self.cached[k] = b
            run.append(k)
            run_tok.extend(tokens[i * self.bs : (i + 1) * self.bs])
        if run:
            self.events.append(("stored", tuple(run), run_parent, tuple(run_tok)))


def _events(pool: BlockPool) -> list[tuple]:
    out = []
    events, meta = pool.take_events()
    for ev, m in zip(events, meta, strict=True):
        if isinstance(ev, schemas.BlockStored):
            out.append(("stored", tuple(ev.keys), ev.parent_key, tuple(m.token_ids)))
        elif isinstance(ev, schemas.BlockRemoved):
            out.append(("removed", tuple(ev.keys)))
    return out


def test_pool_matches_the_block_by_block_reference_on_random_traffic():
    rng = random.Random(7)
    bs, n = 4, 64
    pool, ref = BlockPool(n, bs), RefPool(n, bs)
    # a few shared prefixes so that hits, duplicates and evictions all happen
    prefixes = [[rng.randrange(1000) for _ in range(bs * rng.randint(1, 6))] for _ in range(5)]
    live: list[tuple[list[int], list[int], list[int]]] = []  # (blocks, keys, tokens)
    pending: list[tuple[list[int], list[int], list[int], int]] = []  # allocated, not registered

    def register(blocks, keys, tokens, start):
        # in one or two pieces, like prefill chunks
        cut = rng.randint(start, len(keys))
        for a, b in ((start, cut), (cut, len(keys))):
            if b > a:
                parent = keys[a - 1] if a else None
                pool.register(blocks[a:b], keys[a:b], parent, tokens[a * bs : b * bs], None)
                ref.register(blocks[a:b], keys[a:b], parent, tokens[a * bs : b * bs])
        live.append((blocks, keys, tokens))

    for _ in range(600):
        if pending and rng.random() < 0.5:  # computed later: others may have cached its keys
            register(*pending.pop(0))
        elif live and (rng.random() < 0.45 or pool.num_free < 12):
            blocks, keys, tokens = live.pop(rng.randrange(len(live)))
            pool.free(blocks)
            ref.free(blocks)
        else:
            if pending and rng.random() < 0.5:  # the same prompt again while one computes it
                tokens = pending[-1][2]
            else:
                tokens = rng.choice(prefixes) + [
                    rng.randrange(1000) for _ in range(rng.randint(0, 12))
                ]
            keys = block_keys(tokens, bs, 0)
            hit = pool.match_prefix(keys)
            assert hit == ref.match(keys)
            new = len(keys) - len(hit) + rng.randint(0, 2)
            if not pool.can_allocate(hit, new):
                continue
            pool.touch(hit)
            ref.touch(hit)
            blocks = hit + pool.allocate(new)
            assert blocks == hit + ref.allocate(new)
            if rng.random() < 0.3:
                pending.append((blocks, keys, tokens, len(hit)))
            else:
                register(blocks, keys, tokens, len(hit))
        assert _events(pool) == ref.events
        ref.events.clear()
        assert pool.ref == ref.ref
        assert list(pool.lru) == list(ref.lru)
        assert pool.empty == ref.empty
        assert pool.cached == ref.cached
        assert pool.num_free == len(ref.empty) + len(ref.lru)


def test_dump_after_evictions_lists_every_cached_key_parents_first():
    bs = 4
    pool = BlockPool(12, bs)
    chains = []
    for seed in range(5):  # five 3-block chains into 12 blocks: the oldest get evicted
        tokens = [seed * 100 + i for i in range(3 * bs)]
        keys = block_keys(tokens, bs, 0)
        blocks = pool.allocate(3)
        pool.register(blocks, keys, None, tokens, None)
        pool.free(blocks)
        chains.append(keys)
    dumped = pool.dump()
    seen: set[int] = set()
    for ev in dumped:
        assert ev.parent_key is None or ev.parent_key in seen
        seen.update(ev.keys)
    assert seen == set(pool.cached)
    assert set(chains[-1]) <= seen and not set(chains[0]) & seen


def _run(engine: Engine, reqs: list[SimRequest]) -> list:
    """Two requests at once (they compute their shared blocks concurrently), the rest one by
    one after the engine went idle (they hit the cache)."""
    out, t = [], 0.0
    for batch in (reqs[:2], *([r] for r in reqs[2:])):
        for r in batch:
            engine.add_request(r, t)
        while (o := engine.step(t)) is not None:
            out.append(
                (
                    o.duration_s,
                    o.tokens,
                    [(f.request_id, f.cached_tokens, f.finish_time) for f in o.finished],
                    [schemas.encode(e) for e in o.kv_events],
                )
            )
            t += o.duration_s
    return out


def test_prompt_keys_from_the_caller_are_used_only_when_they_fit_the_prompt():
    cfg = EngineConfig(block_size=4, num_gpu_blocks=40, max_model_len=256)
    shared = [1, 2, 3, 4] * 5
    prompts = [shared + [9, 9], shared + [7] * 5, shared + [8] * 3, [5] * 30]

    def reqs(keys_for):
        return [
            SimRequest(f"r{i}", p, 6, prompt_block_keys=keys_for(p)) for i, p in enumerate(prompts)
        ]

    plain = _run(Engine(cfg, "w"), reqs(lambda p: None))
    given = _run(Engine(cfg, "w"), reqs(lambda p: block_keys(p, 4, 0)))
    wrong_seed = _run(Engine(cfg, "w"), reqs(lambda p: block_keys(p, 4, 123)))
    wrong_len = _run(Engine(cfg, "w"), reqs(lambda p: block_keys(p, 4, 0)[:-1]))
    assert given == plain
    assert wrong_seed == plain  # mismatching keys are ignored, not trusted
    assert wrong_len == plain
    assert any(cached for step in plain for (_, cached, _) in step[2])  # prefix hits happened
