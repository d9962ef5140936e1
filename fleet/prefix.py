"""An approximate per-instance prefix index: which leading blocks of a prompt each server likely
still holds in its prefix cache, learned from what the router sent it.

As the peers do it (SGLang Model Gateway's cache-aware policy keeps a tree of what it routed to
each worker; llm-d's prefix-cache scorer a block-hash -> workers LRU), the router cannot see a
server's cache: it remembers the chained block hashes (fleet/blocks.py) of the prompts it routed
to each instance, `insert`ed after dispatch, and `match` says per instance how many leading
blocks of a new prompt it holds. Eviction approximates the server's own:

- per instance, least recently used first, within a cap in blocks (`set_capacity`: its KV
  capacity in tokens, e.g. SGLang's `max_total_num_tokens`);
- across instances, a global cap on (instance, block) entries (`max_blocks`, 100,000 by
  default), the least recently used entry of any instance going first; so a flood of unique
  prompts never grows the index past its caps.

Inserting a chain touches its blocks from the last to the first, so an ancestor block is always
more recent than its descendants and eviction takes leaves first (as SGLang's radix cache does).
Each instance's set of blocks therefore stays closed under prefixes (a block's ancestors are all
there), and `match` finds the matched depth by bisection, about log2(n) lookups per instance.

Until its request is answered, what an insert put on an instance is a claim: `settle` when the
server answered (its response's first byte: it prefilled the prompt), `withdraw` when it refused
the request or the request ended before its first byte (a block goes once every insert that
claimed it is withdrawn, and stays once any is settled).

Corrections: `forget(instance)` when a server restarted (its prefill counters going back; after
an outage only the blocks put there before it, `through`) or turned unhealthy with no counters
to tell a restart by (its cache may be gone);
`observe_hit(instance, predicted, reported)` when a server reports the cached tokens of a
request the index predicted a hit for: a per-instance trust factor (a moving mean of
reported / predicted, at most 1) scales the blocks `match` credits it, and returns towards 1
with a half-life without new reports (like the cost model's corrections), so an instance
discredited once is credited again and its reports can re-learn it.

Pure: no clock (every call that needs time takes `now`), no I/O, no Python `hash` of text.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleet.blocks import BLOCK_TOKENS, PromptBlocks

DEFAULT_MAX_BLOCKS = 100_000
DEFAULT_TRUST_HALF_LIFE_S = 60.0
DEFAULT_TRUST_WEIGHT = 0.25


@dataclass(slots=True)
class _Trust:
    value: float
    at: float


class PrefixIndex:
    """Per instance, the chained block hashes it likely holds (see the module's docstring).

    `hashes` arguments are chains from fleet/blocks.py (`block_hashes`, `chain`, `chain_ids`),
    of `block_tokens` tokens a block; instances are named by any string (URL or name)."""

    def __init__(
        self,
        *,
        block_tokens: int = BLOCK_TOKENS,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        trust_half_life_s: float = DEFAULT_TRUST_HALF_LIFE_S,
        trust_weight: float = DEFAULT_TRUST_WEIGHT,
    ):
        if block_tokens <= 0 or max_blocks <= 0:
            raise ValueError("block_tokens and max_blocks must be positive")
        if trust_half_life_s <= 0 or not 0 < trust_weight <= 1:
            raise ValueError("trust_half_life_s must be positive and trust_weight in (0, 1]")
        self.block_tokens = block_tokens
        self.max_blocks = max_blocks
        self.trust_half_life_s = trust_half_life_s
        self.trust_weight = trust_weight
        # instance -> {block hash: sequence number of the insert that last touched it}, least
        # recently touched first. One int per insert is shared by all its blocks.
        self._lru: dict[str, OrderedDict[int, int]] = {}
        # instance -> {block: the pending inserts its presence rests on}: blocks that only
        # requests not yet answered put there (a refusal of all of them takes the block back).
        # One claimant (an int) is the rule, and a block of every request in flight has one; a
        # set once a second comes (a shared system prompt's blocks in a burst: many at once).
        self._claims: dict[str, dict[int, int | set[int]]] = {}
        self._cap: dict[str, int] = {}
        self._trust: dict[str, _Trust] = {}
        self._size = 0
        self._seq = 0
        self.evicted = 0
        """Entries evicted so far (by either cap)."""

    # -- what the router tells it ---------------------------------------------------------------

    def set_capacity(self, instance: str, tokens: int | None) -> None:
        """The instance's prefix-cache capacity in tokens (None: only the global cap); entries
        past it are evicted at once, least recently used first."""
        lru = self._lru.setdefault(instance, OrderedDict())
        if tokens is None:
            self._cap.pop(instance, None)
            return
        cap = self._cap[instance] = max(tokens // self.block_tokens, 1)
        self._shrink(instance, lru, cap)

    def capacity_blocks(self, instance: str) -> int:
        """Most blocks the instance may hold in the index."""
        return min(self._cap.get(instance, self.max_blocks), self.max_blocks)

    def insert(self, instance: str, hashes: Sequence[int], now: float) -> tuple[int, tuple[int, ...]]:
        """The request with these block hashes was routed to `instance` at `now`: its blocks are
        now that instance's most recently used (at most its cap's leading ones). Returns the
        insert's sequence number and the blocks whose presence rests on it until its request is
        answered: those new to the instance, and those only other pending inserts put there
        (`settle` confirms them, `withdraw` takes them back)."""
        del now  # order is kept by a sequence number; `now` is the contract's, for later ageing
        lru = self._lru.get(instance)
        if lru is None:
            lru = self._lru[instance] = OrderedDict()
        cap = self.capacity_blocks(instance)
        if len(hashes) > cap or isinstance(hashes, PromptBlocks):
            hashes = hashes[:cap]
        self._seq += 1
        seq = self._seq
        claimed: list[int] = []
        new = 0
        claims = self._claims.get(instance)
        if claims is None:
            claims = self._claims[instance] = {}
        touch = lru.move_to_end
        # Last block first: every ancestor ends up more recent than its descendants.
        for h in reversed(hashes):
            if h in lru:
                touch(h)
                lru[h] = seq
                if claims:
                    pending = claims.get(h)
                    if pending is not None:
                        if isinstance(pending, int):
                            claims[h] = {pending, seq}
                        else:
                            pending.add(seq)
                        claimed.append(h)
            else:
                lru[h] = seq
                claims[h] = seq
                claimed.append(h)
                new += 1
        self._size += new
        if len(lru) > cap:
            self._shrink(instance, lru, cap)
        if self._size > self.max_blocks:
            self._evict_oldest(self._size - self.max_blocks)
        return seq, tuple(claimed)

    def settle(self, instance: str, seq: int, claimed: Sequence[int]) -> None:
        """Insert `seq`'s request was answered: the server holds its blocks, whatever becomes of
        the other pending inserts that claimed them."""
        claims = self._claims.get(instance)
        if claims is None:
            return
        for h in claimed:
            if _claims(claims.get(h), seq):
                del claims[h]

    def withdraw(self, instance: str, seq: int, claimed: Sequence[int]) -> None:
        """Insert `seq` never happened (its request was refused): each block it claimed goes
        again once no other pending insert claims it, unless an answered request holds it."""
        claims = self._claims.get(instance)
        lru = self._lru.get(instance)
        if claims is None or lru is None:
            return
        for h in claimed:
            pending = claims.get(h)
            if not _claims(pending, seq):
                continue  # confirmed since, or evicted and put there again by others
            if isinstance(pending, set) and len(pending) > 1:
                pending.discard(seq)
                continue
            del claims[h]
            if lru.pop(h, None) is not None:
                self._size -= 1

    @property
    def seq(self) -> int:
        """The sequence number of the latest insert (`forget`'s `through`)."""
        return self._seq

    def forget(self, instance: str, through: int | None = None) -> None:
        """Everything about `instance`'s cache: it restarted, or is down (its capacity stays).
        With `through`, only the blocks no insert after that sequence number touched: the
        server restarted before them (an insert sets its blocks' number and moves them last, so
        numbers never fall along the instance's order)."""
        lru = self._lru.get(instance)
        claims = self._claims.get(instance)
        if lru is not None and through is None:
            self._size -= len(lru)
            lru.clear()
        elif lru is not None and through is not None:
            while lru:
                oldest, seq = next(iter(lru.items()))
                if seq > through:
                    break
                lru.popitem(last=False)
                self._size -= 1
                if claims:
                    claims.pop(oldest, None)
        if through is None:
            self._claims.pop(instance, None)
        self._trust.pop(instance, None)

    def remove(self, instance: str) -> None:
        """The instance is gone from the fleet: its entries, capacity and trust."""
        self.forget(instance)
        self._lru.pop(instance, None)
        self._cap.pop(instance, None)

    def observe_hit(
        self,
        instance: str,
        predicted_tokens: float,
        reported_cached_tokens: float,
        now: float,
        *,
        estimated_prompt_tokens: float | None = None,
        reported_prompt_tokens: float | None = None,
    ) -> float:
        """A server reported `reported_cached_tokens` cached for a request the index credited
        with `predicted_tokens` (its raw claim: `match(..., raw=True)` x block_tokens). Moves
        the instance's trust towards reported / predicted (at most 1: a server holding more
        than claimed says nothing against the index). With both prompt sizes given, the
        reported figure is first put in the estimate's units (the server's tokenizer against 4
        characters a token). A claim under a block (a session's short last prompt) moves it in
        proportion: a few tokens' report is mostly the server's rounding. Returns the new
        trust; a prediction of 0 changes nothing."""
        if predicted_tokens <= 0:
            return self.trust(instance, now)
        reported = max(reported_cached_tokens, 0.0)
        if estimated_prompt_tokens and reported_prompt_tokens:
            reported *= estimated_prompt_tokens / reported_prompt_tokens
        ratio = min(reported / predicted_tokens, 1.0)
        current = self.trust(instance, now)
        weight = self.trust_weight * min(predicted_tokens / self.block_tokens, 1.0)
        value = current + weight * (ratio - current)
        self._trust[instance] = _Trust(value, now)
        return value

    # -- what a policy asks ---------------------------------------------------------------------

    def trust(self, instance: str, now: float) -> float:
        """The factor `match` applies to the instance's claimed blocks at `now` (1: none yet)."""
        known = self._trust.get(instance)
        if known is None:
            return 1.0
        age = max(now - known.at, 0.0)
        return 1.0 - (1.0 - known.value) * 0.5 ** (age / self.trust_half_life_s)

    def match(
        self, hashes: Sequence[int], now: float, *, raw: bool = False, instances: Iterable[str] | None = None
    ) -> dict[str, int]:
        """Per instance (those the index knows, or `instances`), the leading blocks of `hashes`
        it likely holds: the matched depth times its trust, rounded down (`raw`: the depth
        alone). Touches nothing (routing there is what `insert` records). `hashes` given as
        `PromptBlocks` are hashed only a little past the first block no instance holds."""
        out: dict[str, int] = {}
        lrus = self._lru
        held = [(name, lrus.get(name)) for name in (tuple(lrus) if instances is None else instances)]
        if isinstance(hashes, PromptBlocks):
            # Hash only as far as some instance holds the prompt: the rest waits for `insert`.
            limit = hashes.hash_while_held([lru for _, lru in held if lru])
            hashes = hashes.hashed()
        else:
            limit = len(hashes)
        first = hashes[0] if limit else None
        trusts = self._trust
        for name, lru in held:
            if not lru or not limit or first not in lru:
                out[name] = 0
                continue
            # Bisection on the matched depth: the instance's blocks are prefix-closed.
            lo, hi = 1, len(lru)
            if limit < hi:
                hi = limit
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if hashes[mid - 1] in lru:
                    lo = mid
                else:
                    hi = mid - 1
            out[name] = lo if raw or name not in trusts else int(lo * self.trust(name, now))
        return out

    def match_tokens(self, hashes: Sequence[int], now: float, *, raw: bool = False) -> dict[str, int]:
        """`match` in tokens (blocks x block_tokens); a caller caps it below the prompt's own
        length (a server always prefills at least the last token)."""
        return {name: blocks * self.block_tokens for name, blocks in self.match(hashes, now, raw=raw).items()}

    # -- what it holds --------------------------------------------------------------------------

    def __len__(self) -> int:
        """(instance, block) entries held."""
        return self._size

    def holds(self, instance: str, block: int) -> bool:
        """Whether the index has `block` (one hash) for `instance`."""
        lru = self._lru.get(instance)
        return lru is not None and block in lru

    def blocks(self, instance: str) -> int:
        lru = self._lru.get(instance)
        return len(lru) if lru is not None else 0

    @property
    def instances(self) -> tuple[str, ...]:
        return tuple(self._lru)

    # -- eviction -------------------------------------------------------------------------------

    def _shrink(self, instance: str, lru: OrderedDict[int, int], cap: int) -> None:
        excess = len(lru) - cap
        if excess <= 0:
            return
        pop = lru.popitem
        claims = self._claims.get(instance)
        for _ in range(excess):
            h, _ = pop(last=False)
            if claims:
                claims.pop(h, None)
        self._size -= excess
        self.evicted += excess

    def _evict_oldest(self, excess: int) -> None:
        """Evict `excess` entries, least recently touched first across all instances."""
        while excess > 0:
            victim: OrderedDict[int, int] | None = None
            victim_name = ""
            oldest = second = self._seq + 1
            for name, lru in self._lru.items():
                if lru:
                    head = next(iter(lru.values()))
                    if head < oldest:
                        victim, victim_name, second, oldest = lru, name, oldest, head
                    elif head < second:
                        second = head
            if victim is None:
                return
            pop = victim.popitem
            claims = self._claims.get(victim_name)
            # Pop from the victim while its oldest is older than every other instance's.
            while excess > 0 and victim:
                if next(iter(victim.values())) > second:
                    break
                h, _ = pop(last=False)
                if claims:
                    claims.pop(h, None)
                excess -= 1
                self._size -= 1
                self.evicted += 1


def _claims(pending: int | set[int] | None, seq: int) -> bool:
    """Whether insert `seq` is among a block's pending claimants."""
    if pending is None:
        return False
    return pending == seq if isinstance(pending, int) else seq in pending
