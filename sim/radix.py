"""SGLang's prefix cache (RadixCache) as the twin keeps it: a radix tree over pages of tokens.

A key is a sequence of hashable *pages*; each page stands for `page_size` tokens. With SGLang's
default page size of 1 a page is one token id; with a page size of p it is a tuple of p ids (only
full pages are cached, as SGLang does with `--page-size` > 1); the virtual clock can also use
opaque block ids, such as the Mooncake trace's 512-token `hash_ids`.

The tree follows `srt/mem_cache/radix_cache.py`:
- edges are compressed: a node holds a run of pages, its children are keyed by their first page;
- `match_prefix` walks the longest cached prefix, splitting a node where the match ends inside
  it, and refreshes the access time of every node on the path;
- `insert` adds what is missing below the longest match (and refreshes the path);
- `lock`/`unlock` count the running requests that hold a node and every node above it; a locked
  node is *protected*, an unlocked one *evictable*;
- `evict(n)` frees at least n tokens, least recently used leaves first, only unlocked ones; a
  parent left childless and unlocked becomes a leaf that may go next.

Sizes are counted in tokens (pages x page_size). The cache does not bound itself: its owner (the
engine) calls `evict` when the KV pool needs the room, as SGLang's allocator does.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence


class RadixNode:
    __slots__ = ("children", "parent", "key", "lock_ref", "last_access")

    def __init__(self, parent: RadixNode | None, key: tuple[Hashable, ...], last_access: int = 0):
        self.children: dict[Hashable, RadixNode] = {}
        self.parent = parent
        self.key = key
        self.lock_ref = 0
        self.last_access = last_access


class RadixCache:
    def __init__(self, page_size: int = 1):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.root = RadixNode(None, ())
        self.root.lock_ref = 1  # never evicted, never counted
        self._clock = 0
        self._evictable_pages = 0
        self._protected_pages = 0

    # ---- sizes (tokens) ------------------------------------------------------------------

    @property
    def evictable_size(self) -> int:
        return self._evictable_pages * self.page_size

    @property
    def protected_size(self) -> int:
        return self._protected_pages * self.page_size

    @property
    def total_size(self) -> int:
        return (self._evictable_pages + self._protected_pages) * self.page_size

    # ---- lookups ---------------------------------------------------------------------------

    def match_prefix(self, key: Sequence[Hashable]) -> tuple[int, RadixNode]:
        """The longest cached prefix of `key`: (pages matched, the node where it ends). Splits a
        node the match ends inside, so the returned node can be locked; refreshes the path."""
        self._clock += 1
        clock = self._clock
        node = self.root
        key = tuple(key)
        i, n = 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            j = _common(child.key, key, i)
            partial = j < len(child.key)
            if partial:
                child = self._split(child, j)
            child.last_access = clock
            node = child
            i += j
            if partial:
                break
        return i, node

    def peek(self, key: Sequence[Hashable]) -> int:
        """Pages of `key` cached now, without touching the tree (no split, no LRU refresh)."""
        node = self.root
        key = tuple(key)
        i, n = 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            j = _common(child.key, key, i)
            i += j
            if j < len(child.key):
                break
            node = child
        return i

    def insert(self, key: Sequence[Hashable]) -> tuple[int, RadixNode]:
        """Cache `key`: (pages that were cached already, the node holding its last page)."""
        self._clock += 1
        clock = self._clock
        node = self.root
        key = tuple(key)
        i, n = 0, len(key)
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                new = RadixNode(node, key[i:], clock)
                node.children[key[i]] = new
                self._evictable_pages += len(new.key)
                return i, new
            j = _common(child.key, key, i)
            if j < len(child.key):
                child = self._split(child, j)
            child.last_access = clock
            node = child
            i += j
        return i, node

    # ---- locks -----------------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        """A running request holds `node` and every node above it (SGLang's inc_lock_ref)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.key)
                self._protected_pages += len(node.key)
            node.lock_ref += 1
            node = node.parent  # type: ignore[assignment]

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("unlock of a radix node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected_pages -= len(node.key)
                self._evictable_pages += len(node.key)
            node = node.parent  # type: ignore[assignment]

    @staticmethod
    def depth(node: RadixNode) -> int:
        """Pages from the root down to the end of `node`."""
        pages = 0
        while node.parent is not None:
            pages += len(node.key)
            node = node.parent
        return pages

    # ---- eviction --------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` tokens if unlocked leaves hold them, least recently used
        first; returns the tokens freed (whole nodes, so possibly more than asked)."""
        if num_tokens <= 0 or self._evictable_pages == 0:
            return 0
        heap: list[tuple[int, int, RadixNode]] = []
        seq = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.lock_ref == 0:
                heap.append((node.last_access, seq, node))
                seq += 1
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._evictable_pages -= len(leaf.key)
            freed += len(leaf.key) * self.page_size
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, seq, parent))
                seq += 1
        return freed

    def reset(self) -> None:
        """Drop everything (SGLang's /flush_cache); only valid with nothing locked."""
        if self._protected_pages:
            raise RuntimeError("cannot reset a radix cache while requests hold it")
        self.root.children.clear()
        self._evictable_pages = 0

    def _split(self, child: RadixNode, j: int) -> RadixNode:
        """Cut `child` after its first j pages; returns the new upper node (same locks)."""
        parent = child.parent
        assert parent is not None
        upper = RadixNode(parent, child.key[:j], child.last_access)
        upper.lock_ref = child.lock_ref
        parent.children[child.key[0]] = upper
        child.key = child.key[j:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper


def _common(node_key: tuple[Hashable, ...], key: tuple[Hashable, ...], start: int) -> int:
    """How many leading pages of `node_key` equal key[start:] (at least 1: the child's own key)."""
    m = len(node_key)
    if key[start : start + m] == node_key:
        return m
    limit = min(m, len(key) - start)
    j = 1
    while j < limit and node_key[j] == key[start + j]:
        j += 1
    return j
