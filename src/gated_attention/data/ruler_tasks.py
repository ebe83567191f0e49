"""RULER-style synthetic long-context tasks (Hsieh et al. 2024), generated offline, and their scoring (data layer).

Model-free on purpose: training data (train/retrieval_mix.py) and evaluation (longctx/ruler.py, greedy decoding) both
build on it, so training never depends on the long-context package.

Task families (RULER's definitions; the wording of the prompts is our own):
  - NIAH: needles "special magic <type> for <key> is: <value>" hidden in a haystack that is either noise (a few fixed
    sentences repeated), caller-supplied corpus text ("essay"), or other needles; single / multi-key / multi-value /
    multi-query variants with number (7 digits), word (adjective-noun) or UUID values;
  - variable tracking (vt): a chain "VAR A = 12345", "VAR B = VAR A", ... in noise; answer = every name in the chain;
  - common-words extraction (cwe): a numbered word list where a few words repeat more often; answer = those words;
  - frequent-words extraction (fwe): coded words drawn from a Zipf law; answer = the three most frequent;
  - passkey retrieval (Mohtashami & Jaggi 2023): one pass key in noise.
Tokenizer-agnostic: `tokenizer` is an HF tokenizer, a `tokenizers.Tokenizer`, or any callable text -> ids. A sample's
`length` is the token count of its prompt exactly as the model is fed it (HF `encode` with its default special tokens);
the haystack size is fitted by binary search so the prompt, question included, is the longest that fits the target.
Every random choice comes from `random.Random` seeded by strings, so a (task, length, seed) triple always gives the
same sample. Scoring is RULER's string match: "all" = fraction of references present, "part" = any reference present.
"""
from __future__ import annotations

import random
import string
import uuid
from collections import Counter
from dataclasses import dataclass, field


# ---------------------------------------------------------------------------------------------------------------------
# Vocabularies (written for this module). Keys/values of "word" type are adjective-noun pairs: rare in real text, so a
# corpus haystack almost never contains one by accident, and there are ~5000 of them.
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
ADJECTIVES = (
    "amber brave calm dusty eager faint gentle hollow icy jolly keen lively misty noble odd pale quiet rapid sandy "
    "tidy urban vivid wary young zesty bitter cosmic damp elder fuzzy giant humble ivory jagged kind lunar mellow "
    "narrow olive proud quirky rustic silent tender upper velvet wild woolly yellow bold crisp distant fierce golden "
    "hidden loyal modest polar royal swift tame"
).split()
NOUNS = (
    "anchor badger candle desert engine falcon garden harbor island jacket kettle lantern meadow needle orchard pebble "
    "quarry river saddle tunnel umbrella valley walnut yard zebra basket castle dragon feather glacier hammer insect "
    "jungle kitten ladder magnet nectar oyster parrot quilt rocket spider teapot violin window beacon cactus dolphin "
    "ember forest goblet helmet iceberg juniper koala lemon mirror nozzle otter piano raven"
).split()
_REAL_WORDS = ADJECTIVES + NOUNS
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70 syllables -> pseudo-words without end

# Per-task answer budgets (RULER's defaults): greedy decoding stops after this many new tokens
DEFAULT_NEW_TOKENS = {"niah": 64, "vt": 32, "cwe": 96, "fwe": 40, "passkey": 16}


@dataclass(frozen=True)
class TaskSpec:
    """One task configuration; the registry below names RULER's 13 minus QA, plus noise-haystack word/UUID NIAH."""
    family: str  # niah | vt | cwe | fwe | passkey
    haystack: str = "noise"  # noise | essay (caller's corpus) | needle (distractor needles only)
    key_type: str = "words"  # words | numbers | uuids: what identifies a needle
    value_type: str = "numbers"  # words | numbers | uuids: what must be retrieved
    num_keys: int = 1  # needles with different keys (1 target + distractors unless num_queries > 1)
    num_values: int = 1  # values per queried key (multi-value)
    num_queries: int = 1  # keys asked about (multi-query)
    extra: dict = field(default_factory=dict)  # family-specific knobs (chain hops, word frequencies, Zipf alpha)


TASKS: dict[str, TaskSpec] = {
    "niah_single_1": TaskSpec("niah", "noise", "words", "numbers"),
    "niah_single_2": TaskSpec("niah", "essay", "words", "numbers"),
    "niah_single_3": TaskSpec("niah", "essay", "words", "uuids"),
    "niah_single_word": TaskSpec("niah", "noise", "words", "words"),
    "niah_single_uuid": TaskSpec("niah", "noise", "words", "uuids"),
    "niah_multikey_1": TaskSpec("niah", "essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": TaskSpec("niah", "needle", "words", "numbers", num_keys=1),
    "niah_multikey_3": TaskSpec("niah", "needle", "uuids", "uuids", num_keys=1),
    "niah_multivalue": TaskSpec("niah", "essay", "words", "numbers", num_values=4),
    "niah_multiquery": TaskSpec("niah", "essay", "words", "numbers", num_keys=4, num_queries=4),
    "vt": TaskSpec("vt", extra={"num_chains": 1, "num_hops": 4}),
    "cwe": TaskSpec("cwe", extra={"num_cw": 10, "freq_cw": 30, "freq_ucw": 3}),
    "fwe": TaskSpec("fwe", extra={"alpha": 2.0, "vocab_size": 400, "num_answers": 3}),
    "passkey": TaskSpec("passkey"),
}
NEEDS_CORPUS = tuple(n for n, s in TASKS.items() if s.haystack == "essay")
NO_CORPUS_TASKS = tuple(n for n in TASKS if n not in NEEDS_CORPUS)


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer adapters
def encode(tokenizer, text: str) -> list[int]:
    """Token ids of `text` as the model would receive it (HF tokenizers add their default special tokens)."""
    if hasattr(tokenizer, "encode"):
        out = tokenizer.encode(text)
        return list(out.ids) if hasattr(out, "ids") else list(out)  # tokenizers.Encoding vs HF list
    out = tokenizer(text)
    if isinstance(out, dict) or hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def decode(tokenizer, ids: list[int]) -> str:
    if not hasattr(tokenizer, "decode"):
        raise ValueError("evaluation needs a tokenizer with .decode(ids); pass an HF or `tokenizers` tokenizer")
    try:
        return tokenizer.decode(ids, skip_special_tokens=True)
    except TypeError:  # tokenizers.Tokenizer spells it positionally
        return tokenizer.decode(ids, True)


def count_tokens(tokenizer, text: str) -> int:
    return len(encode(tokenizer, text))


# ---------------------------------------------------------------------------------------------------------------------
# Random atoms
def _rng(*parts) -> random.Random:
    # str seeds are hashed with SHA-512 by `random`, so this is stable across processes and Python versions
    return random.Random(":".join(str(p) for p in parts))


def _word(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _atom(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return _word(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; valid: numbers, words, uuids")


def _distinct(rng: random.Random, kind: str, n: int, avoid: set[str], forbidden_text: str = "") -> list[str]:
    """n distinct atoms not in `avoid` and not occurring in `forbidden_text` (the corpus), so each is planted once."""
    out: list[str] = []
    for _ in range(100 * n + 100):
        a = _atom(rng, kind)
        if a not in avoid and a not in out and a not in forbidden_text:
            out.append(a)
            if len(out) == n:
                return out
    raise ValueError(f"could not draw {n} distinct {kind} not present in the haystack text")


def _pseudo_words(rng: random.Random, n: int, avoid: set[str] = frozenset()) -> list[str]:
    words: list[str] = []
    seen = set(avoid)
    while len(words) < n:
        w = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3)))
        # no real word inside a pseudo-word, so substring scoring cannot credit one for the other
        if w not in seen and not any(r in w for r in _REAL_WORDS):
            seen.add(w)
            words.append(w)
    return words


# ---------------------------------------------------------------------------------------------------------------------
# Haystacks: a haystack of size n is the first n words of a word stream, with needles inserted at sentence boundaries
def _word_stream(kind: str, corpus: str | None, rng: random.Random, n: int) -> list[str]:
    if kind == "noise":
        base = NOISE.split()
        start = 0
    else:
        if not corpus or not corpus.split():
            raise ValueError("this task's haystack is corpus text: pass corpus=<a long text> (e.g. --haystack-file)")
        base = corpus.split()
        start = rng.randrange(len(base))  # a random place in the corpus, cycling if it is too short
    return [base[(start + i) % len(base)] for i in range(n)]


def _insert(words: list[str], needles: list[str], depths: list[float]) -> str:
    """Insert each needle (a sentence) at fractional depth, snapped back to the nearest sentence end."""
    ends = [0] + [i + 1 for i, w in enumerate(words) if w.endswith((".", "!", "?"))]
    spots = []
    for d in depths:
        target = round(d * len(words))
        spots.append(max(e for e in ends if e <= target))
    out, prev = [], 0
    for spot, needle in sorted(zip(spots, needles), key=lambda t: t[0]):
        out.extend(words[prev:spot])
        out.append(needle)
        prev = spot
    out.extend(words[prev:])
    return " ".join(out)


def _fit(build, tokenizer, target: int, what: str, hi: int = 64) -> tuple[int, str, int]:
    """Largest n with len(tokens(build(n))) <= target: exponential then binary search; returns (n, prompt, length).

    Token counts are monotone in n up to BPE merges at the seam, so the best fitting n seen is kept rather than trusting
    the last probe.
    """
    cache: dict[int, tuple[str, int]] = {}

    def probe(n):
        if n not in cache:
            p = build(n)
            cache[n] = (p, count_tokens(tokenizer, p))
        return cache[n][1]

    if probe(0) > target:
        raise ValueError(f"{what}: even an empty haystack needs {probe(0)} tokens > target length {target}; "
                         f"use a longer length")
    lo = 0
    while probe(hi) <= target:
        lo, hi = hi, hi * 2
        if hi > 50_000_000:
            raise ValueError(f"{what}: the prompt never reaches {target} tokens")
    while hi - lo > 1:  # invariant: probe(lo) <= target < probe(hi)
        mid = (lo + hi) // 2
        if probe(mid) <= target:
            lo = mid
        else:
            hi = mid
    best = max((n for n, (_, t) in cache.items() if t <= target), key=lambda n: (cache[n][1], n))
    return best, cache[best][0], cache[best][1]


# ---------------------------------------------------------------------------------------------------------------------
# Generators: each returns (build(n) -> prompt, answers, needles, extra fields)
_TYPE_NAME = {"numbers": "numbers", "words": "words", "uuids": "UUIDs"}


def _needle(value_type: str, key: str, value: str) -> str:
    return f"One of the special magic {_TYPE_NAME[value_type]} for {key} is: {value}."


def _gen_niah(spec: TaskSpec, rng: random.Random, corpus: str | None, seed_parts):
    forbidden = corpus or ""
    n_keys = max(spec.num_keys, spec.num_queries)
    keys = _distinct(rng, spec.key_type, n_keys, set(), forbidden)
    values = [_distinct(rng, spec.value_type, spec.num_values, set(), forbidden) for _ in keys]
    # flatten keys/values distinctly across needles: a value may only be planted once in the whole prompt
    flat = [v for vs in values for v in vs]
    if len(set(flat)) != len(flat):
        values = []
        pool = _distinct(rng, spec.value_type, len(flat), set(keys), forbidden)
        for i in range(n_keys):
            values.append(pool[i * spec.num_values:(i + 1) * spec.num_values])
    needles = [_needle(spec.value_type, k, v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = [rng.random() for _ in needles]
    queried = keys[: spec.num_queries]
    answers = [v for vs in values[: spec.num_queries] for v in vs]
    tname = _TYPE_NAME[spec.value_type]
    query = ", ".join(queried[:-1]) + f" and {queried[-1]}" if len(queried) > 1 else queried[0]
    head = (f"A few special magic {tname} are hidden in the text below. Memorize them; afterwards you will be asked "
            f"about the special magic {tname}.\n")
    tail = (f"\nWhat are all the special magic {tname} for {query} mentioned in the text above? "
            f"Answer: The special magic {tname} for {query} mentioned in the text above are:")
    if spec.haystack == "needle":
        # the haystack is made of distractor needles: every line looks like the answer except for its key
        d_rng = _rng(*seed_parts, "distractors")
        taken = set(keys) | set(answers)
        d_keys, d_vals = [], []

        def grow(n):
            while len(d_keys) < n:
                k = _distinct(d_rng, spec.key_type, 1, taken)[0]
                taken.add(k)
                v = _distinct(d_rng, spec.value_type, 1, taken)[0]
                taken.add(v)
                d_keys.append(k)
                d_vals.append(v)

        def build(n):
            grow(n)
            lines = [_needle(spec.value_type, k, v) for k, v in zip(d_keys[:n], d_vals[:n])]
            for needle, d in zip(needles, depths):
                lines.insert(round(d * len(lines)), needle)
            return head + "\n".join(lines) + tail
    else:
        stream: list[str] = []

        def build(n):
            if len(stream) < n:
                stream[:] = _word_stream(spec.haystack, corpus, _rng(*seed_parts, "stream"), max(n, 2 * len(stream)))
            return head + _insert(stream[:n], needles, depths) + tail
    return build, answers, needles, {"keys": queried}


def _gen_passkey(spec, rng, corpus, seed_parts):
    key = str(rng.randint(10_000, 99_999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    depth = rng.random()
    head = ("There is an important piece of information hidden inside a lot of irrelevant text. Find it and "
            "memorize it; you will be asked about it.\n")
    tail = "\nWhat is the pass key? The pass key is"

    def build(n):
        return head + _insert(_word_stream("noise", None, rng, n), [needle], [depth]) + tail
    return build, [key], [needle], {}


def _gen_vt(spec, rng, corpus, seed_parts):
    hops, chains = spec.extra["num_hops"], spec.extra["num_chains"]
    names = set()
    while len(names) < chains * (hops + 1):
        names.add("".join(rng.choice(string.ascii_uppercase) for _ in range(5)))
    names = sorted(names)
    rng.shuffle(names)
    values = [str(v) for v in rng.sample(range(10_000, 100_000), chains)]
    lines, answers = [], []
    for c in range(chains):
        chain = names[c * (hops + 1):(c + 1) * (hops + 1)]
        lines.append([f"VAR {chain[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(chain, chain[1:])])
        if c == 0:
            answers = chain
    # each chain's assignments keep their order (a later line refers to an earlier one)
    depth_sets = [sorted(rng.random() for _ in chain_lines) for chain_lines in lines]
    needles = [line for chain_lines in lines for line in chain_lines]
    depths = [d for ds in depth_sets for d in ds]
    head = "Memorize and track every chain of variable assignments hidden in the text below.\n"
    tail = (f"\nQuestion: Find all variables that are assigned the value {values[0]} in the text above. "
            f"Answer: Following the chains of assignments in the text above, {hops + 1} variables are assigned the "
            f"value {values[0]}, they are:")

    def build(n):
        return head + _insert(_word_stream("noise", None, rng, n), needles, depths) + tail
    return build, answers, needles, {"value": values[0]}


def _gen_cwe(spec, rng, corpus, seed_parts, num_cw=None, freq_cw=None):
    num_cw = num_cw or spec.extra["num_cw"]
    freq_cw, freq_ucw = freq_cw or spec.extra["freq_cw"], spec.extra["freq_ucw"]
    real = ADJECTIVES + NOUNS  # real words first, pseudo-words once they run out
    rng.shuffle(real)
    common = real[:num_cw]
    pool = real[num_cw:]

    def uncommon(n):
        if n > len(pool):
            pool.extend(_pseudo_words(_rng(*seed_parts, "ucw", len(pool)), n - len(pool), set(pool) | set(common)))
        return pool[:n]

    head = ("Below is a numbered list of words. Some of them appear more often than the others. Memorize the ones "
            "that appear most often.\n")
    tail = (f"\nQuestion: What are the {num_cw} most common words in the list above? "
            f"Answer: The {num_cw} words that appear most often in the list are:")

    def build(n):
        items = common * freq_cw + uncommon(n) * freq_ucw
        _rng(*seed_parts, "order", n).shuffle(items)
        return head + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items)) + tail
    return build, list(common), [], {"freq_cw": freq_cw, "freq_ucw": freq_ucw}


def _gen_fwe(spec, rng, corpus, seed_parts):
    alpha, vocab_size, k = spec.extra["alpha"], spec.extra["vocab_size"], spec.extra["num_answers"]
    vocab = _pseudo_words(rng, vocab_size)
    weights = [1.0 / (r + 1) ** alpha for r in range(vocab_size)]  # Zipf law over ranks
    draws: list[str] = []
    d_rng = _rng(*seed_parts, "draws")

    def words(n):
        while len(draws) < n:
            draws.extend(d_rng.choices(vocab, weights=weights, k=max(256, n - len(draws))))
        return draws[:n]

    head = ("Read the coded text below and keep track of how often each coded word appears. Find the "
            f"{k} most frequent coded words.\n")
    tail = (f"\nQuestion: Ignore the dots '....'. What are the {k} most frequently appearing coded words in the "
            f"text above? Answer: According to the coded text above, the {k} most frequent coded words are:")

    def build(n):
        ws = words(n)
        chunks = [" ".join(ws[i:i + 10]) for i in range(0, len(ws), 10)]  # dotted every ten words, as RULER's fwe
        return head + " .... ".join(chunks) + tail

    def answers_for(n):
        counts = Counter(words(n)).most_common(k + 1)
        if len(counts) <= k or counts[k - 1][1] == counts[k][1]:
            return None  # a tie at the k-th place makes the answer ambiguous
        return [w for w, _ in counts[:k]]
    return build, answers_for, [], {}


_GENERATORS = {"niah": _gen_niah, "passkey": _gen_passkey, "vt": _gen_vt, "cwe": _gen_cwe, "fwe": _gen_fwe}


def _spec(task: str) -> TaskSpec:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; valid: {', '.join(TASKS)}")
    return TASKS[task]


def generate_sample(task: str, tokenizer, length: int, seed: int = 0, index: int = 0, corpus: str | None = None) -> dict:
    """One sample of `task` whose prompt is the longest that fits `length` tokens.

    Returns dict(task, prompt, answers, length (tokens of prompt), target_length, needles (strings planted exactly
    once), index, seed, max_new_tokens) plus task-specific fields.
    """
    spec = _spec(task)
    seed_parts = (task, length, seed, index)
    rng = _rng(*seed_parts)
    what = f"{task} at {length} tokens"
    if spec.family == "cwe":
        # short targets cannot hold 10 words x 30 repeats: shrink the repeats, then the number of common words
        num_cw, freq_cw, freq_ucw = spec.extra["num_cw"], spec.extra["freq_cw"], spec.extra["freq_ucw"]
        while True:
            build, answers, needles, extra = _gen_cwe(spec, _rng(*seed_parts), corpus, seed_parts, num_cw, freq_cw)
            try:
                n, prompt, ntok = _fit(build, tokenizer, length, what)
                break
            except ValueError:
                if freq_cw > freq_ucw + 2:
                    freq_cw = max(freq_ucw + 2, freq_cw // 2)
                elif num_cw > 1:
                    num_cw //= 2
                else:
                    raise
        extra = {**extra, "num_cw": num_cw}
    elif spec.family == "fwe":
        build, answers_for, needles, extra = _gen_fwe(spec, rng, corpus, seed_parts)
        n, prompt, ntok = _fit(build, tokenizer, length, what)
        answers = answers_for(n)
        while answers is None and n > 0:  # step back to the nearest unambiguous prefix
            n -= 1
            answers = answers_for(n)
            prompt = build(n)
            ntok = count_tokens(tokenizer, prompt)
        if answers is None:
            raise ValueError(f"{what}: too short for an unambiguous frequent-words question")
    else:
        build, answers, needles, extra = _GENERATORS[spec.family](spec, rng, corpus, seed_parts)
        n, prompt, ntok = _fit(build, tokenizer, length, what)
    return dict(task=task, prompt=prompt, answers=list(answers), length=ntok, target_length=length,
                needles=list(needles), haystack_units=n, index=index, seed=seed,
                max_new_tokens=DEFAULT_NEW_TOKENS[spec.family], **extra)


def generate(task: str, tokenizer, length: int, n: int, seed: int = 0, corpus: str | None = None) -> list[dict]:
    return [generate_sample(task, tokenizer, length, seed, i, corpus) for i in range(n)]


# ---------------------------------------------------------------------------------------------------------------------
# Scoring (RULER: case-insensitive substring match, averaged over samples, in percent)
def score_all(prediction: str, references: list[str]) -> float:
    """Fraction of references found in the prediction (RULER's string_match_all for one sample)."""
    p = prediction.lower()
    return sum(r.lower() in p for r in references) / len(references)


def score_part(prediction: str, references: list[str]) -> float:
    """1 if any reference is found in the prediction (RULER's string_match_part for one sample)."""
    p = prediction.lower()
    return float(max(r.lower() in p for r in references))


METRICS = {"all": score_all, "part": score_part}


def score(predictions: list[str], references: list[list[str]], metric: str = "all") -> float:
    """Mean per-sample score in percent."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; valid: {', '.join(METRICS)}")
    if len(predictions) != len(references) or not predictions:
        raise ValueError(f"need equally many predictions and references (got {len(predictions)}, {len(references)})")
    return 100.0 * sum(METRICS[metric](p, r) for p, r in zip(predictions, references)) / len(predictions)


# ---------------------------------------------------------------------------------------------------------------------
# Training data: short retrieval samples in the same formats, to teach a small model the task format
def completion(sample: dict) -> str:
    """The target continuation of a sample's prompt: its answers, comma separated."""
    return " " + ", ".join(sample["answers"]) + "."


def training_samples(tokenizer, n: int, max_len: int, seed: int = 0, tasks=None, min_len: int | None = None,
                     corpus: str | None = None) -> list[dict]:
    """`n` samples whose prompt + answer fits `max_len` tokens, lengths uniform in [min_len, max_len].

    Each is a generate_sample dict plus `text` = prompt + completion and `text_length` (tokens of text). Tasks default
    to every task the corpus allows; seeds are offset from evaluation's (namespace "train") so they never coincide.
    """
    if tasks is None:
        tasks = list(TASKS) if corpus else list(NO_CORPUS_TASKS)
    min_len = min_len or max(32, max_len // 4)
    if min_len > max_len:
        raise ValueError(f"min_len {min_len} > max_len {max_len}")
    rng = _rng("train", seed)
    out = []
    for i in range(n):
        task = tasks[i % len(tasks)]
        target = rng.randint(min_len, max_len)
        for _ in range(20):
            try:
                s = generate_sample(task, tokenizer, target, f"train{seed}", i, corpus)
            except ValueError as exc:  # this task's bare prompt is longer than the drawn length: use the longest
                if target >= max_len or "empty haystack" not in str(exc):
                    raise ValueError(f"training_samples: {exc} (raise max_len or drop {task!r} from tasks)") from exc
                target = max_len
                continue
            text = s["prompt"] + completion(s)
            ntok = count_tokens(tokenizer, text)
            if ntok <= max_len:
                break
            target -= ntok - max_len  # make room for the answer and retry
        else:
            raise ValueError(f"could not fit a {task} training sample with its answer into {max_len} tokens")
        out.append({**s, "text": text, "text_length": ntok})
    return out
