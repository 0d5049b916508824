"""Near-duplicate text anchors for GiGPO's step groups (the paper's similarity-based grouping option).

The reference implementation compares each anchor with every cluster representative of its group using
`difflib.SequenceMatcher`: quadratic per group and slow per pair. Here:
- similarity = Jaccard similarity of the two texts' sets of character 3-grams (not difflib's ratio: a one-character
  edit in a text of L characters costs about 3/L), estimated by MinHash with k = 64 hash functions (Broder 1997;
  standard error sqrt(J (1 - J) / k), ~0.04 at J = 0.9), so a pair near the threshold may fall either side;
- candidates come from locality-sensitive hashing of the signatures (banding, Leskovec, Rajaraman & Ullman,
  "Mining of Massive Datasets", ch. 3): two texts are candidates when they agree on a whole band, and band keys
  include the group, so texts of different groups are never compared;
- inside each band bucket, greedy leader clustering (as the reference does per group, but only among candidates):
  every item is checked against the bucket's first item; those that fail try the next leader among themselves
  (up to LEADER_ROUNDS rounds);
- step groups are the connected components of all accepted links (single linkage, vectorized union-find).
Identical texts of one group always share a step group. Like the reference, clustering is greedy: two similar texts
each linked to a different, dissimilar leader can stay apart, and chains of links can join texts that are not
directly similar. `lsh_shape` picks the band length so that a pair AT the threshold shares no band with probability
<= 1e-6 (for thresholds >= ~0.2).

Complexity, with N rows, I distinct (group, text) items, S 3-grams over the distinct texts, k = 64 and B bands,
R leader rounds: O(N) to factorize + O(S k) MinHash + O(B R I k) candidate checks + union-find rounds of O(links).
No step is quadratic in the batch or in a group.
"""

from __future__ import annotations

import numpy as np

from algorithms.core import combine_codes, factorize, group_count, representatives

NGRAM = 3  # character 3-grams: a one-character edit changes at most 3 shingles
NUM_PERM = 64  # MinHash functions; bands x rows are chosen from the threshold by `lsh_shape`
LEADER_ROUNDS = 8  # greedy leader rounds per band bucket (see `cluster_similar_texts`)

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer: a bijective bit mixer on uint64 (multiplications wrap mod 2^64 on purpose)."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + l) for each (s, l), without a Python loop."""
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()))


def _shingles(texts: np.ndarray, ngram: int) -> tuple[np.ndarray, np.ndarray]:
    """Character n-gram hashes of each text as (text index, hash) pairs, grouped by text in text order.

    A text shorter than `ngram` is one shingle (itself), so short texts still compare. Repeated shingles are kept:
    MinHash takes a minimum, which a duplicate cannot change, so this is still Jaccard on *sets*.
    """
    try:
        joined = "".join(texts)
    except TypeError:
        raise ValueError("anchor_similarity needs string anchor_keys") from None
    lengths = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    # UTF-32 gives one uint32 per character, so n-grams are fixed-width windows over this array.
    chars = np.frombuffer(joined.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    chars = np.concatenate([chars, np.zeros(ngram, dtype=np.uint64)])  # windows near the end stay in bounds
    text_start = np.cumsum(lengths) - lengths
    n_grams = np.maximum(lengths - ngram + 1, 1)
    text_of_gram = np.repeat(np.arange(len(texts)), n_grams)
    start = _concat_ranges(text_start, n_grams)
    end = text_start[text_of_gram] + lengths[text_of_gram]
    h = np.zeros(len(start), dtype=np.uint64)
    for j in range(ngram):  # loop over the few characters of a shingle, not over rows
        # Code points are < 2^21, so for ngram <= 3 this packs the shingle exactly (injective); +1 marks "a char".
        c = np.where(start + j < end, chars[start + j] + np.uint64(1), np.uint64(0))
        h = (h << np.uint64(21)) ^ c
    return text_of_gram, _mix64(h)  # mixed, so that the linear MinHash permutations below behave


def _minhash(text_of_gram: np.ndarray, h: np.ndarray, n_texts: int, num_perm: int, seed: int) -> np.ndarray:
    """[n_texts, num_perm] MinHash signatures: min over each text's shingles of num_perm random permutations."""
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 2**63, size=num_perm, dtype=np.uint64) | np.uint64(1)  # odd => a*x+b is a bijection
    b = rng.integers(0, 2**63, size=num_perm, dtype=np.uint64)
    first_gram = np.cumsum(group_count(text_of_gram, n_texts))
    first_gram = np.concatenate([[0], first_gram[:-1]])  # every text has >= 1 shingle, so reduceat is safe
    sig = np.empty((n_texts, num_perm), dtype=np.uint64)
    for j in range(num_perm):  # num_perm vectorized passes over all shingles
        sig[:, j] = np.minimum.reduceat(h * a[j] + b[j], first_gram)
    return sig


def _estimated_jaccard(sig: np.ndarray, u: np.ndarray, v: np.ndarray, chunk: int = 1 << 16) -> np.ndarray:
    """MinHash estimate of the Jaccard similarity of texts u[e] and v[e]: the share of equal signature entries.

    Unbiased, standard error sqrt(J (1 - J) / k): about 0.04 at J = 0.9 with k = 64. Chunked to bound memory.
    """
    out = np.empty(len(u))
    for lo in range(0, len(u), chunk):  # loop over chunks of 65k pairs, to cap the [chunk, k] temporaries
        out[lo : lo + chunk] = (sig[u[lo : lo + chunk]] == sig[v[lo : lo + chunk]]).mean(axis=1)
    return out


def lsh_shape(threshold: float, num_perm: int = NUM_PERM, miss: float = 1e-6) -> tuple[int, int]:
    """(bands, rows) with bands * rows = num_perm: the longest bands (fewest false candidates) for which two texts
    of Jaccard `threshold` fail to share any band with probability (1 - J^rows)^bands <= `miss`."""
    for rows in (8, 4, 2, 1):
        if (1.0 - threshold**rows) ** (num_perm // rows) <= miss:
            return num_perm // rows, rows
    return num_perm, 1  # thresholds below ~0.2: best effort


def _connected_components(n: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Component label (its smallest member) of each node, by vectorized union-find.

    Each round hooks the larger root of every unsatisfied edge under the smaller one, then compresses paths by
    pointer jumping. labels[i] <= i always holds, so no cycle can form; every round with an unsatisfied edge removes
    at least one root, and in practice a handful of rounds suffice.
    """
    labels = np.arange(n)
    while True:
        ru, rv = labels[u], labels[v]
        if np.array_equal(ru, rv):
            return labels
        low = np.minimum(ru, rv)
        np.minimum.at(labels, ru, low)
        np.minimum.at(labels, rv, low)
        while True:
            jumped = labels[labels]
            if np.array_equal(jumped, labels):
                break
            labels = jumped


def cluster_similar_texts(
    row_group: np.ndarray, texts: np.ndarray, threshold: float, *, ngram: int = NGRAM, seed: int = 0
) -> tuple[np.ndarray, int]:
    """Step-group codes: rows of one group whose texts are linked (estimated 3-gram Jaccard >= threshold, see the
    module docstring) share a code.

    `row_group` are integer group codes, `texts` an object array of strings. Returns (codes, n_codes).
    Identical texts of one group always share a code. Deterministic for a given `seed`.
    """
    text_code, n_texts = factorize(texts, "anchor_keys")
    item_code, n_items = combine_codes(row_group, text_code)  # item = one distinct text within one group
    item_row = representatives(item_code, n_items)
    item_group, item_text = row_group[item_row], text_code[item_row]

    text_of_gram, h = _shingles(texts[representatives(text_code, n_texts)], ngram)
    bands, rows = lsh_shape(threshold)
    sig = _minhash(text_of_gram, h, n_texts, bands * rows, seed)

    def similar(u: np.ndarray, v: np.ndarray) -> np.ndarray:
        return _estimated_jaccard(sig, item_text[u], item_text[v]) >= threshold

    us, vs = [], []
    for band in range(bands):  # a fixed, small number of vectorized passes over all items
        # Bucket = (group, this band of the signature): only items of one group can ever meet.
        key = _mix64(item_group.astype(np.uint64))
        for col in range(band * rows, (band + 1) * rows):
            key = _mix64(key ^ sig[item_text, col])
        _, bucket = np.unique(key, return_inverse=True)
        # Greedy leader clustering inside each bucket (as the reference does per group, but only among candidates):
        # each item is checked against its bucket's first item; those that fail try the next leader among
        # themselves. O(items) checks per round instead of all pairs; a few rounds settle any realistic bucket.
        pending = np.arange(n_items)
        for _ in range(LEADER_ROUNDS):
            _, first, inverse = np.unique(bucket[pending], return_index=True, return_inverse=True)
            leader = pending[first][inverse]
            pending, leader = pending[leader != pending], leader[leader != pending]
            if len(pending) == 0:
                break
            ok = similar(pending, leader)
            us.append(pending[ok])
            vs.append(leader[ok])
            pending = pending[~ok]
    u = np.concatenate(us) if us else np.zeros(0, dtype=np.int64)
    v = np.concatenate(vs) if vs else np.zeros(0, dtype=np.int64)
    component = _connected_components(n_items, u, v)
    return factorize(component[item_code])
