"""A lookup corpus: the target's own answers to training prompts, searched the way prompt lookup searches a
request's context (`"lookup_corpus"`; REST's retrieval and SuffixDecoding's frequency-scored continuations over
a fixed corpus).

Where neither the request's own context nor the cross-request cache matches, the corpus is asked: the longest
suffix of the context (`min_n` .. max_n tokens: prompt_lookup_min .. prompt_lookup_max) that occurs in it,
then the continuation most of its occurrences take, token by token (at each depth the most frequent next token
among the occurrences still on the path; the smallest id on a tie), up to γ tokens or a document's end. It depends on committed tokens only, so it is
lossless as any lookup. Acceptance per match length is measured like the other lookup sources
(`LookupFirstDrafter`), so a weak short match loses to the model drafter where that drafts better.

Index: every position q of a token sorted by the tokens read backwards from it (q, q-1, .., q-max_n+1), so the
occurrences of the context's last n tokens are one contiguous range, and each longer n a sub-range of it. The
tokens are held as codes, token + 1 (a separator 0, so it sorts first), in the narrowest unsigned type (uint16
for a vocabulary below 65,535). The first `depth` codes of a position's backward read, packed into one integer
(`bits` each), are its key, ascending with the order; every STRIDE-th key is kept (int64), so the range of a
suffix up to `depth` tokens long is a binary search over the kept keys, then one inside the STRIDE positions
between two of them (their keys computed there); each longer suffix a binary search inside the range. 6.5 bytes
a corpus token for SmolLM2's vocabulary (codes 2, order int32 4, kept keys 0.5), built at load.

File: safetensors, `tokens` int32 [N] (documents joined, each followed by -1), metadata `vocab_size`,
`documents`, `model`, `source`. `dspark build-corpus` writes one from `dspark prepare-data` output.

    corpus = LookupCorpus.load("corpus.safetensors", vocab_size=49152, max_n=5, num_draft_tokens=7)
    drafts, n = corpus.lookup(context_ids)
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

SEP = -1  # after each document in the file (code 0 in the index); sorts before every token id
SAMPLE = 1024  # occurrences a continuation is counted over (evenly spaced across a larger range)
STRIDE = 16  # positions per kept key


class LookupCorpus:
    def __init__(self, tokens: np.ndarray, *, max_n: int, num_draft_tokens: int) -> None:
        if max_n < 1 or num_draft_tokens < 1:
            raise ValueError(f"need max_n >= 1 and num_draft_tokens >= 1, got {max_n}, {num_draft_tokens}")
        self.max_n, self.num_draft_tokens = max_n, num_draft_tokens
        body = np.asarray(tokens)  # [N] token ids, SEP after each document
        self.max_code = int(body.max(initial=0)) + 1  # the largest code a token of this corpus has
        dtype = np.uint16 if self.max_code < 2**16 else np.uint32
        # max_n separators before the corpus (a backward read never leaves it), γ after (nor a forward one)
        self.codes = np.concatenate([np.zeros(max_n, dtype), (body + 1).astype(dtype),
                                     np.zeros(num_draft_tokens + 1, dtype)])  # [max_n + N + γ + 1]
        self.num_documents = int((body == SEP).sum())
        del body
        q = np.flatnonzero(self.codes).astype(np.int32)  # [num_positions] positions holding a token
        # lexsort: the last key is the primary one — token q, then q-1, ...
        self.order = q[np.lexsort([self.codes[q - j] for j in range(max_n - 1, -1, -1)])]  # [num_positions] int32
        del q
        self.bits = self.max_code.bit_length()
        self.depth = min(max_n, 62 // self.bits)  # a range end, (key + 1) << shift, stays below 2^63
        self.kept_keys = self._keys(self.order[::STRIDE])  # [ceil(num_positions / STRIDE)] int64, ascending
        # plain-int reads of single entries (views: no copy), for the searches between two kept keys
        self._code_at, self._order_at = memoryview(self.codes), memoryview(self.order)
        self.num_tokens = len(self.order)

    def _keys(self, positions: np.ndarray) -> np.ndarray:  # [P] -> [P] int64
        keys = np.zeros(len(positions), dtype=np.int64)
        for j in range(self.depth):
            keys |= self.codes[positions - j].astype(np.int64) << (self.bits * (self.depth - 1 - j))
        return keys

    def _key(self, index: int) -> int:
        """The key of order[index]."""
        q, key = self._order_at[index], 0
        for j in range(self.depth):
            key = (key << self.bits) | self._code_at[q - j]
        return key

    def _lower_bound(self, key: int) -> int:
        """The first index whose key is >= `key` (len(order) when none is)."""
        i = int(np.searchsorted(self.kept_keys, key, "left"))  # kept i - 1 < key <= kept i
        if i == 0:
            return 0
        lo, hi = (i - 1) * STRIDE + 1, min(i * STRIDE, len(self.order))  # the answer is in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if self._key(mid) < key:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @classmethod
    def load(cls, path: str | Path, *, vocab_size: int, max_n: int, num_draft_tokens: int) -> "LookupCorpus":
        from safetensors.numpy import load_file
        check_corpus(path, vocab_size=vocab_size)
        tokens = load_file(str(path))["tokens"]
        if tokens.size and int(tokens.max()) >= vocab_size:
            raise ValueError(f"lookup_corpus {path}: token id {int(tokens.max())} outside the target's "
                             f"{vocab_size}-token vocabulary")
        return cls(tokens, max_n=max_n, num_draft_tokens=num_draft_tokens)

    def lookup(self, ids: list[int], *, min_n: int = 1) -> tuple[list[int], int]:
        """(continuation, matched n) for the longest suffix of `ids` (min_n .. max_n tokens) found in the
        corpus; ([], 0) when none is."""
        lo, hi, n = self._packed_range(ids)
        while hi > lo and self.depth <= n < min(self.max_n, len(ids)):
            # the token n back is sorted within the range of the n matched ones
            code = ids[-n - 1] + 1
            if not 0 < code <= self.max_code:  # a token this corpus does not hold
                break
            col = self.codes[self.order[lo:hi] - n]
            a, b = np.searchsorted(col, code, "left"), np.searchsorted(col, code, "right")
            if b == a:
                break
            lo, hi, n = lo + int(a), lo + int(b), n + 1
        if n < max(min_n, 1):
            return [], 0
        return self._continuation(lo, hi), n

    def _packed_range(self, ids: list[int]) -> tuple[int, int, int]:
        """(lo, hi, n): the keys' range [lo, hi) of the longest suffix of `ids` up to `depth` tokens that occurs,
        and its length n ((0, 0, 0) when not even the last token does)."""
        m = 0
        while m < min(self.depth, len(ids)) and 0 <= ids[-1 - m] < self.max_code:  # larger ids occur nowhere
            m += 1
        for n in range(m, 0, -1):
            shift = self.bits * (self.depth - n)
            key = 0
            for j in range(n):
                key = (key << self.bits) | (ids[-1 - j] + 1)
            lo = self._lower_bound(key << shift)
            if lo == len(self.order) or self._key(lo) >> shift != key:  # no occurrence
                continue
            return lo, self._lower_bound((key + 1) << shift), n
        return 0, 0, 0

    def _continuation(self, lo: int, hi: int) -> list[int]:
        """The most frequent path forward from the occurrences order[lo:hi]."""
        step = max(1, (hi - lo) // SAMPLE)
        at = self.order[lo:hi:step].astype(np.int64)  # [≤ SAMPLE] positions of the matched suffix's last token
        out: list[int] = []
        for d in range(1, self.num_draft_tokens + 1):
            if at.size == 1:  # one occurrence left: its own tokens, up to the document's end
                for code in self.codes[at[0] + d:at[0] + self.num_draft_tokens + 1].tolist():
                    if code == 0:
                        break
                    out.append(code - 1)
                break
            nxt = self.codes[at + d]
            first = nxt[0]
            if (nxt == first).all():  # every occurrence goes on alike
                best = int(first)
            else:
                values, counts = np.unique(nxt, return_counts=True)
                best = int(values[counts.argmax()])  # the first of the most frequent: the smallest id
            if best == 0:
                break
            out.append(best - 1)
            at = at[nxt == best]
        return out


def check_corpus(path: str | Path, *, vocab_size: int) -> dict:
    """The corpus file's metadata, after checking it exists and was written for a `vocab_size`-token
    vocabulary (reads the header only)."""
    from dspark.models.files import open_safetensors
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"lookup_corpus {path}: no such file (write one with `dspark build-corpus`)")
    with open_safetensors(path, framework="np") as f:
        meta = f.metadata() or {}
        if "tokens" not in f.keys():
            raise ValueError(f"lookup_corpus {path}: no 'tokens' tensor (not a corpus from `dspark build-corpus`)")
    if int(meta.get("vocab_size", -1)) != vocab_size:
        raise ValueError(f"lookup_corpus {path} was written for a {meta.get('vocab_size', 'unknown')}-token "
                         f"vocabulary; the target has {vocab_size}")
    return meta


def write_corpus(path: str | Path, documents: list[list[int]], *, vocab_size: int, model: str, source: str,
                 repeats_dropped: int = 0) -> dict:
    """Join `documents` (token id lists) into a corpus file; returns its metadata (`repeats_dropped`: documents
    the caller left out as repeats, recorded)."""
    from safetensors.numpy import save_file
    flat = [t for doc in documents for t in (*doc, SEP)]
    if any(not 0 <= t < vocab_size for doc in documents for t in doc):
        raise ValueError(f"a document holds a token id outside the {vocab_size}-token vocabulary")
    meta = {"vocab_size": str(vocab_size), "documents": str(len(documents)), "tokens": str(len(flat) - len(documents)),
            "model": model, "source": source, "repeats_dropped": str(repeats_dropped)}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": np.asarray(flat, dtype=np.int32)}, str(path), metadata=meta)
    return meta


def describe(meta: dict) -> str:
    return json.dumps({k: meta[k] for k in ("documents", "tokens", "repeats_dropped", "model", "source") if k in meta})
