"""Re-keying one engine's KV events into kvgate's canonical events. Pure, no I/O.

Engines name blocks by their own hashes; kvgate names them by canonical keys derived from the
token ids (services.core.keys). A :class:`Rekeyer` serves one engine (one worker): for
each stored block it computes the canonical keys, chained from the parent's key, and keeps
``(group, engine hash) -> keys`` so that removals (which carry engine hashes only) resolve.

What makes two requests share a key is what makes the engine reuse the cache between them:
- the chain starts at ``block_seed(cluster seed, LoRA name, cache salt)`` (salt: SGLang
  ``cache_salt``; vLLM the salt string in the first block's ``extra_keys``), so salted and
  unsalted prompts, or two adapters, never share a key (the router keys a request's
  ``cache_salt`` and adapter the same way);
- any other per-block extra key (vLLM multimodal ``(mm_hash, offset)`` pairs, prompt-embeds
  digests) is folded into that block's chain seed: an image prompt never matches text blocks;
- an engine block of ``m * B`` tokens (B = the worker's block size) is ``m`` canonical blocks;
  an event whose block size is not a multiple of B cannot be keyed and is dropped, counted;
- vLLM hybrid models publish one stream per KV cache ``group_idx``: a canonical key is held
  while at least one group holds it (a sliding-window group's eviction leaves the
  full-attention group's blocks alone); groups of a non-prefix kind (sliding window, mamba,
  ...) are ignored once a prefix-kind group is known, since reuse is decided by the latter;
- blocks that are not on this engine (vLLM ``locality`` REMOTE, SGLang ``EXTERNAL``) are not
  its cache: skipped, counted;
- blocks whose reuse depends on tokens after the block (vLLM ``lookahead_token_ids``, SGLang
  EAGLE bigram pages, whose token_ids are (token, next token) pairs) cannot be keyed as a
  prefix of whole blocks: dropped, counted (``lookahead_hash``, ``bigram_page``).

Invariants:
- ``refs`` counts, per (canonical key, tier), the (group, engine hash) entries holding it; a
  canonical BlockStored is emitted when a count leaves 0, a BlockRemoved when it returns to 0,
  so :meth:`dump` (the keys with a count) is the worker's cache in canonical form;
- a stored block whose parent hash is unknown cannot be keyed (its key depends on the whole
  prefix): the event is dropped and counted as ``unknown_parent``, never guessed;
- bad input is counted per reason in ``counts`` and never raises; one bad event never costs
  the other events of its batch;
- ``unkeyed_blocks`` (engine blocks dropped for an unknown parent), ``unknown_hashes``
  (removed or moved hashes never stored) and ``engine_clears`` (the engine's AllBlocksCleared)
  only grow: the bridge's history ledger reads them as evidence of lost engine history.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import xxhash

from services.common.schemas import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from services.core.keys import block_keys, block_seed
from services.kv_indexer.bridges.engine_formats import (
    CLEARED_TYPES,
    REMOVED_TYPES,
    STORED_TYPES,
    TCreated,
    TEvent,
    TRemoved,
    TStored,
    TUpdated,
    medium_tier,
)

TIER_BIT = {"gpu": 1, "cpu": 2, "disk": 4}
_GPU_ONLY = (("gpu", 1),)
TIER_OF_LEVEL = {0: "gpu", 1: "cpu"}  # TensorRT-LLM cache levels: 0 primary, 1 secondary
# vLLM KVCacheSpecKind values whose blocks do not decide prefix reuse on their own
NON_PREFIX_KINDS = frozenset(
    {"sliding_window", "sliding_window_mla", "chunked_local_attention", "mamba"}
)
_xxh3 = xxhash.xxh3_64_intdigest


def _noop(reason: str, detail: str) -> None:
    return None


class Rekeyer:
    def __init__(
        self,
        hash_seed: int = 0,
        block_size: int | None = None,
        on_bad: Callable[[str, str], None] = _noop,
        on_skip: Callable[[str, str], None] = _noop,
    ) -> None:
        self.hash_seed = hash_seed
        self.block_size = block_size  # the worker's (canonical) block size; None = first seen
        self.on_bad = on_bad
        self.on_skip = on_skip
        # (group, engine hash) -> [canonical keys of the block, tier bits]; written as plain
        # ``hash`` for group 0 (engine hashes are ints or bytes, never tuples), and the entry
        # as the bare key when it is one key on the GPU tier (the common case)
        self.held: dict[object, Any] = {}
        # engine hash -> [last key, entries holding] for hashes of groups other than 0 (a
        # group-0 hash's last key is in ``held``): a parent is named by its hash alone
        self.ends: dict[object, list[int]] = {}
        # (key, tier bit) -> entries holding; written as plain ``key`` for the GPU tier (the
        # common case: no tuple to build per block)
        self.refs: dict[object, int] = {}
        self.group_kind: dict[int, str] = {}
        self.counts: collections.Counter[str] = collections.Counter()
        self.skipped: collections.Counter[str] = collections.Counter()
        self._seeds: dict[tuple[str | None, str | None], int] = {}
        self.num_gpu_blocks: int | None = None  # TensorRT-LLM "created" event
        self.unkeyed_blocks = 0  # engine blocks whose parent was never stored
        self.unknown_hashes = 0  # engine hashes removed or moved that were never stored
        self.engine_clears = 0  # the engine's own AllBlocksCleared events
        self._first_window: int | None = None  # TensorRT-LLM: its window is group 0

    def bad(self, reason: str, detail: str) -> None:
        self.counts[reason] += 1
        self.on_bad(reason, detail)

    def skip(self, reason: str, detail: str) -> None:
        self.skipped[reason] += 1
        self.on_skip(reason, detail)

    def _seed(self, lora: str | None, salt: str | None = None) -> int:
        s = self._seeds.get((lora, salt))
        if s is None:
            if len(self._seeds) > 4096:
                self._seeds.clear()
            s = self._seeds[(lora, salt)] = block_seed(self.hash_seed, lora=lora, salt=salt)
        return s

    def reset(self) -> None:
        self.held.clear()
        self.ends.clear()
        self.refs.clear()

    def blocks(self) -> int:
        """Canonical (key, tier) entries held."""
        return len(self.refs)

    # ------------------------------------------------------------------ primitives
    @staticmethod
    def _split_extra(
        extra: object, lora: str | None, root: bool
    ) -> tuple[str | None, list[Any] | None]:
        """One block's vLLM ``extra_keys`` entry -> (cache salt, what else its hash covers).

        The entry lists, in order, the LoRA name (when the request has one), multimodal
        ``(mm_identifier, offset)`` pairs, the cache salt (first block only) and prompt-embeds
        digests (bytes)."""
        if not extra:
            return None, None
        items = list(extra) if isinstance(extra, (list, tuple)) else [extra]
        if lora is not None and items and items[0] == lora:
            items = items[1:]
        salt = None
        mix: list[Any] = []
        for x in items:
            if root and salt is None and isinstance(x, str):
                salt = x
            else:
                mix.append(x)
        return salt, mix or None

    def stored(
        self,
        hashes: Sequence[object],
        parent_hash: object | None,
        token_ids: Sequence[int],
        block_size: int,
        tier: str = "gpu",
        lora: str | None = None,
        *,
        group: int = 0,
        salt: str | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> BlockStored | None:
        n = len(hashes)
        if n == 0:
            return None
        if block_size <= 0:
            self.bad("invalid_schema", f"block_size {block_size}")
            return None
        bs = self.block_size
        if bs is None:
            bs = self.block_size = block_size
        if block_size % bs:
            self.bad(
                "block_size_mismatch",
                f"event block_size {block_size} is not a multiple of the worker's {bs}",
            )
            return None
        per = block_size // bs  # canonical blocks per engine block
        if len(token_ids) < n * block_size:
            self.bad("token_count_mismatch", f"{len(token_ids)} tokens for {n} blocks")
            return None
        if extra_keys is not None and len(extra_keys) != n:
            self.bad("invalid_schema", f"{len(extra_keys)} extra_keys for {n} blocks")
            return None
        parent_key = None
        if parent_hash is not None:
            parent_key = self._last_key(parent_hash)
            if parent_key is None:
                self.unkeyed_blocks += n
                self.bad("unknown_parent", f"parent hash {parent_hash!r} never stored")
                return None
        try:
            if not extra_keys or not any(extra_keys):
                seed = self._seed(lora, salt) if parent_key is None else parent_key
                keys = block_keys(token_ids, bs, seed, None, n * per)
            else:
                keys = []
                prev = parent_key
                for i in range(n):
                    root = i == 0 and parent_key is None
                    s, mix = self._split_extra(extra_keys[i], lora, root)
                    seed = self._seed(lora, salt or s) if prev is None else prev
                    if mix:
                        seed = _xxh3(msgspec.msgpack.encode(mix), seed=seed)
                    chunk = token_ids[i * block_size : (i + 1) * block_size]
                    ks = block_keys(chunk, bs, seed, None, per)
                    keys += ks
                    prev = ks[-1]
        except (OverflowError, TypeError, msgspec.EncodeError) as exc:
            self.bad("invalid_schema", f"cannot key block: {exc}")
            return None
        bit = TIER_BIT[tier]
        held, refs = self.held, self.refs
        new_keys: list[int] = []
        if not group and per == 1 and bit == 1:
            # the common case (one group, GPU, engine block = canonical block): an entry is
            # the key itself
            get, rget = held.get, refs.get
            for h, k in zip(hashes, keys, strict=True):
                entry = get(h)
                if entry is None:
                    held[h] = k
                    c = rget(k)
                    if c is None:
                        refs[k] = 1
                        new_keys.append(k)
                    else:
                        refs[k] = c + 1
                elif entry != k:
                    new_keys += self._add(0, h, [k], bit)
        else:
            for i, h in enumerate(hashes):
                new_keys += self._add(group, h, keys[i * per : (i + 1) * per], bit)
        if not new_keys:
            return None
        whole = len(new_keys) == len(keys)
        return BlockStored(
            keys=new_keys, parent_key=parent_key if whole else None, block_size=bs, tier=tier
        )

    def _last_key(self, h: object) -> int | None:
        """The canonical key at the end of engine block ``h`` (any group), None if unknown."""
        e = self.held.get(h)
        if e is None:
            end = self.ends.get(h)
            return None if end is None else end[0]
        return e if type(e) is int else e[0][-1]

    def _entry(self, hk: object) -> list[Any] | None:
        """``held[hk]`` as ``[keys, tier bits]`` (a compact entry is expanded in place)."""
        e = self.held.get(hk)
        if e is None or type(e) is not int:
            return e
        e = self.held[hk] = [[e], 1]
        return e

    def _add(self, group: int, h: object, ks: list[int], bit: int) -> list[int]:
        """Hold ``(group, h)`` with keys ``ks`` on tier ``bit``; the keys that became held."""
        hk = h if not group else (group, h)
        entry = self._entry(hk)
        if entry is not None and entry[0] != ks:  # the engine reused the hash: replace
            self._drop(group, h, 7, {})
            entry = None
        if entry is None:
            self.held[hk] = [ks, bit]
            if group:
                e = self.ends.get(h)
                if e is None:
                    self.ends[h] = [ks[-1], 1]
                else:
                    e[1] += 1
        elif entry[1] & bit:
            return []  # already held on this tier (a duplicate store)
        else:
            entry[1] |= bit
        refs = self.refs
        out: list[int] = []
        for k in ks:
            rk = k if bit == 1 else (k, bit)
            c = refs.get(rk, 0)
            refs[rk] = c + 1
            if not c:
                out.append(k)
        return out

    def _drop(self, group: int, h: object, drop: int, by_tier: dict[str, list[int]]) -> bool:
        """Take tiers ``drop`` (bits) of ``(group, h)``; keys whose count falls to 0 go to
        ``by_tier``. False when the entry is unknown."""
        hk = h if not group else (group, h)
        entry = self._entry(hk)
        if entry is None:
            return False
        ks, bits = entry
        gone = bits & drop
        refs = self.refs
        for t, bit in TIER_BIT.items() if gone != 1 else _GPU_ONLY:
            if gone & bit:
                for k in ks:
                    rk = k if bit == 1 else (k, bit)
                    c = refs[rk] - 1
                    if c:
                        refs[rk] = c
                    else:
                        del refs[rk]
                        by_tier.setdefault(t, []).append(k)
        bits &= ~drop
        if bits:
            entry[1] = bits
        else:
            del self.held[hk]
            if group:
                e = self.ends[h]
                e[1] -= 1
                if not e[1]:
                    del self.ends[h]
        return True

    def removed(
        self, hashes: Sequence[object], tier: str | None, group: int = 0
    ) -> list[BlockRemoved]:
        """Canonical removals; ``tier`` None = every tier the block is on (one event per
        tier, since a canonical BlockRemoved names its tier)."""
        by_tier: dict[str, list[int]] = {}
        drop = 7 if tier is None else TIER_BIT[tier]
        unknown = 0
        held, refs = self.held, self.refs
        gpu: list[int] = []
        for h in hashes:
            e = held.get(h) if not group and drop & 1 else None
            if type(e) is int:  # compact entry: one key, GPU only
                del held[h]
                c = refs[e] - 1
                if c:
                    refs[e] = c
                else:
                    del refs[e]
                    gpu.append(e)
            elif not self._drop(group, h, drop, by_tier):
                unknown += 1
        if gpu:
            by_tier.setdefault("gpu", [])[:0] = gpu
        if unknown:
            self.unknown_hashes += unknown
            self.bad("unknown_block", f"{unknown} removed hashes never stored")
        return [BlockRemoved(keys=keys, tier=t) for t, keys in by_tier.items()]  # type: ignore[arg-type]

    def cleared(self) -> AllBlocksCleared:
        """The engine emptied its cache (its own event, not a bridge reset)."""
        self.reset()
        self.engine_clears += 1
        return AllBlocksCleared()

    # ------------------------------------------------------------------ engine batches
    def _ignored_group(self, group: int) -> bool:
        kinds = self.group_kind
        return kinds.get(group) in NON_PREFIX_KINDS and any(
            k not in NON_PREFIX_KINDS for k in kinds.values()
        )

    def vllm_events(self, events: Sequence[object]) -> list[KvEvent]:
        """Canonical events of one decoded vLLM / SGLang batch (see engine_formats). Each
        event stands alone: one that cannot be applied is counted and the rest go on."""
        out: list[KvEvent] = []
        for ev in events:
            try:
                if isinstance(ev, STORED_TYPES):
                    tier = medium_tier(ev.medium, ev.locality)
                    group = ev.group_idx or 0
                    if ev.kv_cache_spec_kind:
                        self.group_kind[group] = ev.kv_cache_spec_kind
                    if tier is None:
                        self.skip("remote_medium", f"{ev.medium}/{ev.locality}")
                        continue
                    if self._ignored_group(group):
                        self.skip("non_prefix_group", f"group {group}")
                        continue
                    if ev.lookahead_token_ids:
                        # the engine reuses such a block only when the tokens after it match
                        # too; a canonical key (a prefix of whole blocks) cannot say that
                        self.bad("lookahead_hash", "blocks hashed with lookahead tokens")
                        continue
                    lora = ev.lora_name or (f"lora-{ev.lora_id}" if ev.lora_id else None)
                    c = self.stored(
                        ev.block_hashes,
                        ev.parent_block_hash,
                        ev.token_ids,
                        ev.block_size,
                        tier,
                        lora,
                        group=group,
                        salt=ev.cache_salt,
                        extra_keys=ev.extra_keys,
                    )
                    if c is not None:
                        out.append(c)
                elif isinstance(ev, REMOVED_TYPES):
                    group = ev.group_idx or 0
                    if ev.medium or ev.locality:
                        tier = medium_tier(ev.medium, ev.locality)
                        if tier is None:
                            self.skip("remote_medium", f"{ev.medium}/{ev.locality}")
                            continue
                    else:
                        tier = None
                    if self._ignored_group(group):
                        self.skip("non_prefix_group", f"group {group}")
                        continue
                    out += self.removed(ev.block_hashes, tier, group)
                elif isinstance(ev, CLEARED_TYPES):
                    out.append(self.cleared())
            except Exception as exc:  # one event's surprise never takes the batch down
                self.bad("invalid_schema", f"{type(ev).__name__}: {exc!r}"[:300])
        return out

    def trtllm_events(self, events: Sequence[TEvent]) -> list[KvEvent]:
        """Canonical events of TensorRT-LLM ``/kv_cache_events`` entries. With variable
        sliding-window attention each window size has its own cache (its own events): it is
        a group, like vLLM's ``group_idx``."""
        out: list[KvEvent] = []
        for ev in events:
            d = ev.data
            ws = ev.window_size
            if ws is not None and self._first_window is None:
                self._first_window = ws
            group = 0 if ws is None or ws == self._first_window else ws
            if isinstance(d, TStored):
                # blocks may change cache level or token count inside one event: cut runs
                run: list = []
                parent = d.parent_hash
                for b in d.blocks + [None]:  # type: ignore[list-item]
                    if run and (
                        b is None
                        or b.cache_level != run[0].cache_level
                        or len(b.tokens) != len(run[0].tokens)
                    ):
                        # token_extra_id (multimodal placeholders) is part of what the
                        # engine reuses: folded into the block's key like vLLM's mm hashes
                        extra = [
                            [t.token_extra_id for t in x.tokens]
                            if any(t.token_extra_id for t in x.tokens)
                            else None
                            for x in run
                        ]
                        c = self.stored(
                            [x.block_hash for x in run],
                            parent,
                            [t.token_id for x in run for t in x.tokens],
                            len(run[0].tokens),
                            TIER_OF_LEVEL.get(run[0].cache_level, "disk"),
                            None,
                            group=group,
                            extra_keys=extra if any(extra) else None,
                        )
                        if c is not None:
                            out.append(c)
                        parent = run[-1].block_hash
                        run = []
                    if b is not None:
                        run.append(b)
            elif isinstance(d, TRemoved):
                out += self.removed(d.block_hashes, None, group)
            elif isinstance(d, TUpdated):
                lvl = d.cache_level
                if lvl is None or lvl.new_value is None or lvl.new_value == lvl.old_value:
                    continue
                entry = self._entry(d.block_hash if not group else (group, d.block_hash))
                if entry is None:
                    self.unknown_hashes += 1
                    self.bad("unknown_block", f"updated hash {d.block_hash} never stored")
                    continue
                new = TIER_OF_LEVEL.get(lvl.new_value, "disk")
                old = TIER_OF_LEVEL.get(lvl.old_value or 0, "disk")
                bit = TIER_BIT[new]
                added: list[int] = []
                if not entry[1] & bit:
                    entry[1] |= bit
                    for k in entry[0]:
                        rk = k if bit == 1 else (k, bit)
                        c = self.refs.get(rk, 0)
                        self.refs[rk] = c + 1
                        if not c:
                            added.append(k)
                if added:
                    out.append(
                        BlockStored(
                            keys=added, parent_key=None, block_size=self.block_size or 1, tier=new
                        )
                    )
                out += self.removed([d.block_hash], old, group)
            elif isinstance(d, TCreated):
                if d.num_blocks_per_cache_level:
                    self.num_gpu_blocks = d.num_blocks_per_cache_level[0]
        return out

    # ------------------------------------------------------------------ dump
    def dump(self) -> list[KvEvent]:
        """The whole cache as canonical events: AllBlocksCleared, then stored keys per tier
        (in the order they were stored; ``parent_key`` None: keys are self-describing)."""
        events: list[KvEvent] = [AllBlocksCleared()]
        bs = self.block_size or 1
        by_bit: dict[int, list[int]] = {1: [], 2: [], 4: []}
        for r in self.refs:
            if isinstance(r, tuple):
                by_bit[r[1]].append(r[0])
            else:
                by_bit[1].append(r)
        for t, bit in TIER_BIT.items():
            if by_bit[bit]:
                events.append(BlockStored(keys=by_bit[bit], parent_key=None, block_size=bs, tier=t))  # type: ignore[arg-type]
        return events
