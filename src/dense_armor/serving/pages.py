"""The paged cache's bookkeeping on the host: which pages are free, who holds which, and the
prefixes that full pages hold (`PageBook`).

Page 0 is the null page (`nn.state.paged`): never handed out, so a pool of `pages` pages has
`pages - 1` to give. A request takes, at admission, the pages of its prompt, then one page
more each time its tokens pass the last (`grow`); it returns them when it ends, or when it is
preempted (the engine's policy: the youngest request gives its pages back and waits to be
recomputed, see `serving.engine`).

Prefix sharing: a full page of prompt tokens is keyed by a digest of its tokens and of its
predecessors' (BLAKE2b over the chain, so equal keys mean equal prefixes, positions included).
A request whose prompt starts with pages already keyed takes them (a reference more) instead of
computing them; an unreferenced keyed page stays keyed, free to be taken by a later request
with that prefix or, least recently released first, reused for anything once the free pages
run out. A page that several requests share is never written: a request whose whole prompt is
in shared pages recomputes its last token (for its logits) into a copy of the last page.
"""

import collections
import hashlib
from typing import NamedTuple

import numpy as np

__all__ = ["PageBook", "Plan"]


class Plan(NamedTuple):
    """A request's pages in order, how many of its prompt's positions they hold already
    (`start`: the prefill begins there), and the page to copy into its last shared page's place
    (`(source, target)`, or None)."""

    pages: list[int]
    start: int
    copy: tuple[int, int] | None


class PageBook:
    """Free pages, reference counts and the keyed prefixes of a pool of `pages` pages of
    `page_size` positions (see the module)."""

    def __init__(self, pages: int, page_size: int) -> None:
        self.pages, self.page_size = int(pages), int(page_size)
        self._free = collections.deque(range(1, self.pages))
        self._refs = np.zeros(self.pages, np.int64)
        self._keyed: dict[bytes, int] = {}  # digest -> page
        self._digest: dict[int, bytes] = {}  # page -> digest
        self._idle: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # keyed, free

    @property
    def available(self) -> int:
        """Pages that a request could take: free ones, and keyed ones that nobody holds."""
        return len(self._free) + len(self._idle)

    @property
    def held(self) -> int:
        """Pages held by requests."""
        return int((self._refs > 0).sum())

    def needed(self, rows: int) -> int:
        """Pages for `rows` positions."""
        return -(-int(rows) // self.page_size)

    def digests(self, prompt: np.ndarray) -> list[bytes]:
        """The keys of the prompt's full pages, each over its tokens and its predecessors'."""
        keys, previous = [], b""
        for k in range(len(prompt) // self.page_size):
            page = np.asarray(prompt[k * self.page_size : (k + 1) * self.page_size], "<i4")
            previous = hashlib.blake2b(previous + page.tobytes(), digest_size=16).digest()
            keys.append(previous)
        return keys

    def _hits(self, prompt: np.ndarray) -> list[int]:
        hits = []
        for digest in self.digests(prompt):
            if digest not in self._keyed:
                break
            hits.append(self._keyed[digest])
        return hits

    def fits(self, prompt: np.ndarray, rows: int, share: bool) -> bool:
        """Whether a request of `prompt` needing `rows` positions can take its pages now."""
        hits = self._hits(prompt) if share else []
        idle_hits = sum(self._refs[p] == 0 for p in hits)
        copy = len(hits) * self.page_size >= len(prompt)  # its last shared page is copied
        new = self.needed(rows) - len(hits) + copy
        return new <= self.available - idle_hits

    def take(self, prompt: np.ndarray, rows: int, share: bool) -> Plan:
        """The pages of a request (`fits` first): its shared prefix's, then new ones."""
        hits = self._hits(prompt) if share else []
        for page in hits:
            self._hold(page)
        pages = hits + [self._fresh() for _ in range(self.needed(rows) - len(hits))]
        start, copy = len(hits) * self.page_size, None
        if hits and start >= len(prompt):  # the last prompt token's row is written again
            start = len(prompt) - 1
            source = pages[len(hits) - 1]
            pages[len(hits) - 1] = target = self._fresh()
            copy = (source, target)
        return Plan(pages, start, copy)

    def grow(self, pages: list[int], rows: int) -> bool:
        """Append to a request's `pages` the new ones that `rows` positions need; False (and
        nothing taken) when the pool has too few."""
        new = self.needed(rows) - len(pages)
        if new > self.available:
            return False
        pages.extend(self._fresh() for _ in range(new))
        return True

    def register(self, prompt: np.ndarray, pages: list[int], written: int) -> None:
        """Key the request's full pages of prompt tokens that hold `written` positions."""
        for k, digest in enumerate(self.digests(prompt[:written])):
            page = pages[k]
            if digest not in self._keyed and page not in self._digest:
                self._keyed[digest], self._digest[page] = page, digest

    def release(self, pages: list[int]) -> None:
        """A request's pages given back (a copy's source once copied, a request that ended)."""
        for page in pages:
            self._refs[page] -= 1
            if self._refs[page] > 0:
                continue
            digest = self._digest.get(page)
            if digest is None:
                self._free.append(page)
            else:
                self._idle[digest] = page

    def _hold(self, page: int) -> None:
        if self._refs[page] == 0:
            self._idle.pop(self._digest[page], None)
        self._refs[page] += 1

    def _fresh(self) -> int:
        """A page that nobody holds, taken from the free ones, else the keyed one released
        longest ago (its key forgotten)."""
        if self._free:
            page = self._free.popleft()
        else:
            digest, page = self._idle.popitem(last=False)
            del self._keyed[digest], self._digest[page]
        self._refs[page] = 1
        return page
