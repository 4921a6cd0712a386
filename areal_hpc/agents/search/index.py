"""A BM25 index (``bm25s``) of the search agent's corpus, built in memory once per process and seed.

``search(query, k)`` -> ``[(page id, title, snippet), ...]`` (best first, the page whose title is the query
before all; pages the query shares no word with are left out, so a query of unknown words finds nothing);
``open_page(page_id)`` -> the page's title and text, at most ``max_chars`` (``KeyError`` for an id that is not
in the corpus).
Any text is a valid query: it is cut to ``MAX_QUERY_CHARS`` and tokenised by bm25s's word pattern.
"""

from __future__ import annotations

import functools
import threading

from areal_hpc.agents.search.corpus import Page, corpus

MAX_QUERY_CHARS = 512
SNIPPET_CHARS = 160
PAGE_CHARS = 1000


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a word where it can, marked with '...'."""
    if len(text) <= limit:
        return text
    cut = text[: max(0, limit - 3)]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut) + "..."


class SearchIndex:
    def __init__(self, pages: tuple[Page, ...] | list[Page]):
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.pages = tuple(pages)
        self.by_id = {page.id: page for page in self.pages}
        self.by_title = {page.title.lower(): i for i, page in enumerate(self.pages)}
        self._tokenizer = Tokenizer(stopwords="en")
        ids = self._tokenizer.tokenize(
            [f"{p.title}\n{p.text}" for p in self.pages], update_vocab=True, return_as="ids", show_progress=False
        )
        self._bm25 = bm25s.BM25()
        self._bm25.index(ids, show_progress=False)
        self._lock = threading.Lock()  # bm25s objects are not documented as thread-safe

    def search(self, query: str, k: int = 3, snippet_chars: int = SNIPPET_CHARS) -> list[tuple[str, str, str]]:
        """The (page id, title, snippet) of the best ``k`` pages for ``query``."""
        k = max(0, min(int(k), len(self.pages)))
        if k == 0 or not isinstance(query, str):
            return []
        with self._lock:
            tokens = self._tokenizer.tokenize(
                [query[:MAX_QUERY_CHARS]], update_vocab=False, return_as="ids", show_progress=False
            )
            if not any(tokens[0]):  # only words the corpus does not have (id 0: the empty token)
                return []
            docs, scores = self._bm25.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        found = [d for d, score in zip(docs[0].tolist(), scores[0].tolist()) if score > 0]
        titled = self.by_title.get(" ".join(query[:MAX_QUERY_CHARS].split()).lower())
        if titled is not None:  # a page whose title is the query comes first, as a search engine's exact match
            found = [titled, *(d for d in found if d != titled)][:k]
        return [(self.pages[d].id, self.pages[d].title, clip(self.pages[d].text, snippet_chars)) for d in found]

    def open_page(self, page_id: str, max_chars: int = PAGE_CHARS) -> str:
        """The page's title and text (at most ``max_chars``); ``KeyError`` when no page has ``page_id``."""
        page = self.by_id[normalise_id(page_id)]
        return clip(f"{page.title}\n{page.text}", max_chars)


def normalise_id(page_id: str) -> str:
    """How a written page id is looked up: surrounding space, quotes and brackets dropped, lower case."""
    return page_id.strip().strip("\"'[]()").strip().lower() if isinstance(page_id, str) else ""


@functools.lru_cache(maxsize=8)
def get_index(seed: int = 0, named: bool = True) -> SearchIndex:
    """The index of the corpus of ``seed`` (``named``: ``corpus.build_world``), built on first use (a few tens
    of milliseconds)."""
    return SearchIndex(corpus(seed, named))


def search(query: str, k: int = 3, seed: int = 0) -> list[tuple[str, str, str]]:
    return get_index(seed).search(query, k)


def open_page(page_id: str, seed: int = 0, max_chars: int = PAGE_CHARS) -> str:
    return get_index(seed).open_page(page_id, max_chars)
