"""Hypothesis strategies for the generated-case suites (suites/test_op_generated.py, suites/test_layer_generated.py),
over what an op or a backend declares, and the cases they draw with their one-line form.

A case is a frozen dataclass (:class:`OpDraw`, :class:`LayerDraw`) whose ``str()`` is one line that
:func:`parse_case` reads back exactly: ``--mla-case '<that line>'`` replays it. Its first word is the
*property* that drew it (a test function ``test_generated_<property>``), e.g.::

    heads B=1 lens=17 s_q=1 h=126 page=64 float32 latent seed=0
    pages B=2 lens=49,0 s_q=2 causal h=3 page=48 bfloat16 latent noncontig-q seed=7
    sparse B=1 lens=80 s_q=1 h=1 page=16 float32 latent top=65 invalid=minus-one topk-length sink seed=0
    layer config=tiny float32 prefill=1,2 chunk=1 decode=1 seed=0

(``lens=0*32,1``: 32 rows of 0 keys, then one of 1.)

Each property is a list of *strata*: classes of one dimension where kernels break (a head count in a tail tile
of 64, a page size that is not a power of two, causal s_q not a power of two, rows past 2048 keys, batches past
32 rows, top-k with a tail past a multiple of 64), each a strategy over that class and every other dimension.
Every stratum runs its own examples, so each class is tried in every run; hypothesis's first example of a
stratum is its simplest (the first value of each ``sampled_from``, which is where the values kernels are known
to break on -- FlashMLA's 126 heads, 2049 keys, s_q 3 -- are put), and a failure shrinks towards it. The
values and their sources: tiles of 64 heads and 64-key blocks (FlashMLA, FlashInfer), 126 and 63 heads
(FlashMLA tests/), a block-table walk of 32 pages (2048 keys at page 64), grids of 32 rows, aiter's page sizes
> 1 and its q_len 6.

``sizes="thorough"`` (``--mla-thorough``) widens the shapes: rows up to 32k keys, batches to 1024 rows,
top-k to 2048.
"""

from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

DTYPES = ("float32", "bfloat16", "float16", "float64")
KV_FORMATS = ("latent", "fp8-e4m3-flashmla")
INVALID_KINDS = ("minus-one", "past-end", "int-max")

#: op properties (test_generated_<name> in suites/test_op_generated.py) and the layer's
OP_PROPERTIES = ("heads", "pages", "mtp", "long_rows", "batch", "sparse", "mixed")
LAYER_PROPERTIES = ("layer",)

#: layer configs: name -> (preset, overrides of its fields). ``tiny-glm-dims`` has GLM-4.7-Flash's shape at tiny
#: size (v_head_dim larger than qk_nope_head_dim -- 256 vs 192 there, 64 vs 48 here -- and an odd head count,
#: 20 heads there, 5 here); ``tiny-1-head`` (one head, as TP leaves MQA-like shards) carries the default run's row
#: past 2048 tokens at a quarter of tiny's cost; the DSA configs keep every row within index_topk, where DeepSeek Sparse Attention
#: selects every key and equals dense MLA (the float64 dense reference is then the oracle).
LAYER_CONFIGS: dict[str, tuple[str, dict]] = {
    "tiny": ("tiny", {}),
    "tiny-glm-dims": ("tiny", {"hidden_size": 160, "num_attention_heads": 5, "qk_nope_head_dim": 48, "v_head_dim": 64}),
    "tiny-1-head": ("tiny", {"num_attention_heads": 1}),
    "tiny-dsa": ("tiny-dsa", {}),
    "glm-dsa-mini": ("glm-dsa-mini", {}),
}


# --------------------------------------------------------------------------- cases and their one-line form


def _rle(values) -> str:
    """1,0,0,0,5 -> '1,0*3,5' (runs of 3 or more)."""
    out, i = [], 0
    values = list(values)
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        n = j - i
        out.append(f"{values[i]}*{n}" if n >= 3 else ",".join([str(values[i])] * n))
        i = j
    return ",".join(out)


def _unrle(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for part in text.split(","):
        value, star, count = part.partition("*")
        out.extend([int(value)] * (int(count) if star else 1))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class OpDraw:
    """One generated op case: per-row key counts ``lens``, then what the op contract's decode is asked."""

    prop: str
    lens: tuple[int, ...]
    s_q: int = 1
    causal: bool = False
    h_q: int = 1
    page: int = 64
    dtype: str = "float32"
    kv_format: str = "latent"
    topk: int | None = None
    invalid: str | None = None
    all_invalid: tuple[int, ...] = ()
    topk_length: bool = False
    sink: bool = False
    noncontig: bool = False
    seed: int = 0

    @property
    def batch(self) -> int:
        return len(self.lens)

    def __str__(self) -> str:
        words = [self.prop, f"B={self.batch}", f"lens={_rle(self.lens)}", f"s_q={self.s_q}"]
        if self.causal:
            words.append("causal")
        words += [f"h={self.h_q}", f"page={self.page}", self.dtype, self.kv_format]
        if self.topk is not None:
            words.append(f"top={self.topk}")
        if self.invalid:
            words.append(f"invalid={self.invalid}")
        if self.all_invalid:
            words.append(f"all-invalid={','.join(map(str, self.all_invalid))}")
        if self.topk_length:
            words.append("topk-length")
        if self.sink:
            words.append("sink")
        if self.noncontig:
            words.append("noncontig-q")
        words.append(f"seed={self.seed}")
        return " ".join(words)


@dataclasses.dataclass(frozen=True)
class LayerDraw:
    """One generated layer case: a config of :data:`LAYER_CONFIGS`, per-row prefill lengths, prefill chunk
    (None: one call), then ``decode`` one-token steps for every row."""

    config: str
    dtype: str
    prefill: tuple[int, ...]
    chunk: int | None = None
    decode: int = 0
    seed: int = 0
    prop: str = "layer"

    @property
    def batch(self) -> int:
        return len(self.prefill)

    def __str__(self) -> str:
        chunk = "none" if self.chunk is None else str(self.chunk)
        return (f"{self.prop} config={self.config} {self.dtype} prefill={_rle(self.prefill)} chunk={chunk} "
                f"decode={self.decode} seed={self.seed}")


_OP_KEYS = {"B", "lens", "s_q", "h", "page", "top", "invalid", "all-invalid", "seed"}
_OP_FLAGS = {"causal": "causal", "topk-length": "topk_length", "sink": "sink", "noncontig-q": "noncontig"}


def parse_case(text: str) -> OpDraw | LayerDraw:
    """The case of a line :class:`OpDraw` / :class:`LayerDraw` wrote; ValueError with one sentence naming the
    word it cannot read."""
    words = text.split()
    if not words:
        raise ValueError("the case is empty (expected e.g. 'heads B=1 lens=17 s_q=1 h=126 page=64 float32 latent "
                         "seed=0', as a failure prints it)")
    prop, rest = words[0], words[1:]
    if prop in LAYER_PROPERTIES:
        return _parse_layer(prop, rest)
    if prop not in OP_PROPERTIES:
        raise ValueError(f"{prop!r} is not a generated property (the first word is one of "
                         f"{', '.join(OP_PROPERTIES + LAYER_PROPERTIES)})")
    kw: dict = {"prop": prop}
    batch = None
    for word in rest:
        key, eq, value = word.partition("=")
        try:
            if not eq:
                if word in _OP_FLAGS:
                    kw[_OP_FLAGS[word]] = True
                elif word in DTYPES:
                    kw["dtype"] = word
                elif word in KV_FORMATS:
                    kw["kv_format"] = word
                else:
                    raise ValueError
            elif key == "B":
                batch = int(value)
            elif key == "lens":
                kw["lens"] = _unrle(value)
            elif key in ("s_q", "seed", "page", "h", "top"):
                kw[{"h": "h_q", "top": "topk"}.get(key, key)] = int(value)
            elif key == "invalid" and value in INVALID_KINDS:
                kw["invalid"] = value
            elif key == "all-invalid":
                kw["all_invalid"] = tuple(int(v) for v in value.split(","))
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"cannot read {word!r} (words: {', '.join(sorted(_OP_KEYS))} as key=value, flags "
                             f"{', '.join(_OP_FLAGS)}, a dtype {'/'.join(DTYPES)} and a kv format "
                             f"{'/'.join(KV_FORMATS)})") from None
    if "lens" not in kw:
        raise ValueError("the case gives no lens=... (the keys of each row)")
    case = OpDraw(**kw)
    if batch is not None and batch != case.batch:
        raise ValueError(f"B={batch} but lens= lists {case.batch} rows")
    if min(case.lens) < 0 or case.s_q < 1 or case.h_q < 1 or case.page < 1 or (case.topk is not None and case.topk < 1):
        raise ValueError("lens must be >= 0 and s_q, h, page and top >= 1")
    if any(not 0 <= b < case.batch for b in case.all_invalid):
        raise ValueError(f"all-invalid= names rows outside 0..{case.batch - 1}")
    return case


def _parse_layer(prop: str, words) -> LayerDraw:
    kw: dict = {"prop": prop}
    for word in words:
        key, _, value = word.partition("=")
        try:
            if word in DTYPES:
                kw["dtype"] = word
            elif key == "config" and value in LAYER_CONFIGS:
                kw["config"] = value
            elif key == "prefill":
                kw["prefill"] = _unrle(value)
            elif key == "chunk":
                kw["chunk"] = None if value == "none" else int(value)
            elif key in ("decode", "seed"):
                kw[key] = int(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"cannot read {word!r} (a layer case has config= (one of {', '.join(LAYER_CONFIGS)}), "
                             f"a dtype, prefill=, chunk=, decode=, seed=)") from None
    missing = [k for k in ("config", "dtype", "prefill") if k not in kw]
    if missing:
        raise ValueError(f"the layer case gives no {', '.join(missing)}")
    case = LayerDraw(**kw)
    if min(case.prefill) < 1 or case.decode < 0 or (case.chunk is not None and case.chunk < 1):
        raise ValueError("prefill lengths and chunk must be >= 1, decode >= 0")
    return case


# --------------------------------------------------------------------------- what an op takes


@dataclasses.dataclass(frozen=True)
class OpSupport:
    """What the op declares and accepts, probed once (mla_conformance.checks.generated.op_support): the strategies
    draw only from it. ``formats``: (kv_format, dtype) pairs it takes for dense decode, preferred first;
    ``sparse_formats`` the same for sparse decode (empty: not declared); ``invalid``: the invalid index kinds it
    is handed; ``empty_rows``: it accepts queries without keys."""

    pages: tuple[int, ...]
    formats: tuple[tuple[str, str], ...]
    sparse_formats: tuple[tuple[str, str], ...] = ()
    invalid: tuple[str, ...] = ("minus-one",)
    sink: bool = False
    empty_rows: bool = True
    sizes: str = "default"

    @property
    def thorough(self) -> bool:
        return self.sizes == "thorough"


@dataclasses.dataclass(frozen=True)
class Stratum:
    """One class of one property: its name (what it is about), its strategy, and its share of the profile's
    examples (a costly stratum runs fewer: at least one)."""

    name: str
    strategy: st.SearchStrategy
    share: float = 1.0


def _row(s: OpSupport, hi: int, floor: int = 1):
    """A row's key count: floor..hi (the floor first), or 0 where the op takes rows without keys."""
    keys = st.integers(max(1, floor), max(max(1, floor), hi))
    return st.one_of(keys, st.just(0)) if s.empty_rows else keys


def _not_pow2(n: int) -> bool:
    return n & (n - 1) != 0


@st.composite
def _extras(draw, s: OpSupport, *, formats=None):
    """dtype and format, attn_sink (where declared), a non-contiguous q, the input seed: simplest first."""
    fmt, dtype = draw(st.sampled_from(formats or s.formats))
    return dict(kv_format=fmt, dtype=dtype, sink=draw(st.booleans()) if s.sink else False,
                noncontig=draw(st.booleans()), seed=draw(st.integers(0, 255)))


@st.composite
def _dense(draw, s: OpSupport, prop: str, *, heads, pages=None, s_q=st.integers(1, 2), causal=st.booleans(),
           rows=st.integers(1, 3), lens=None):
    """A dense decode case. ``lens(s_q, causal, page)``: the strategy of its row lengths (default: ``rows`` rows
    of up to 130 keys); causal rows shorter than s_q (queries without keys) only where the op takes them."""
    h = draw(heads)
    page = draw(pages if pages is not None else st.sampled_from(s.pages))
    n_q = draw(s_q)
    is_causal = draw(causal)
    if lens is None:
        floor = n_q if is_causal and not s.empty_rows else 1
        n = draw(rows)
        got = draw(st.lists(_row(s, 130, floor), min_size=n, max_size=n))
    else:
        got = draw(lens(n_q, is_causal, page))
    return OpDraw(prop, tuple(got), s_q=n_q, causal=is_causal, h_q=h, page=page, **draw(_extras(s)))


def _heads(s: OpSupport) -> list[Stratum]:
    small = st.integers(1, 8)
    odd = st.one_of(st.sampled_from([9, 63]), st.integers(4, 31).map(lambda k: 2 * k + 1))
    tail = st.one_of(st.sampled_from([126, 65, 127]), st.integers(65, 127).filter(lambda h: h % 64))
    whole = st.sampled_from([128, 64])
    return [Stratum("h_q 1..8", _dense(s, "heads", heads=small)),
            Stratum("odd h_q above 8 (9, 63)", _dense(s, "heads", heads=odd)),
            Stratum("a tail head tile: h_q > 64, h_q % 64 != 0 (126 after TP)", _dense(s, "heads", heads=tail)),
            Stratum("whole tiles of 64 heads", _dense(s, "heads", heads=whole))]


def _page_rows(s: OpSupport, page: int):
    """Row lengths at page boundaries +-1 first, then anywhere up to 3 pages + 1."""
    near = [n for n in dict.fromkeys([page + 1, page, page - 1, 2 * page + 1, 2 * page, 2 * page - 1, 1,
                                      3 * page + 1]) if n >= 1]
    row = st.one_of(st.sampled_from(near), st.integers(1, 3 * page + 1))
    row = st.one_of(row, st.just(0)) if s.empty_rows else row
    return lambda n_q, causal, _page: st.lists(row, min_size=1, max_size=4) if not causal or s.empty_rows else \
        st.lists(row.map(lambda L: max(L, n_q)), min_size=1, max_size=4)


def _pages(s: OpSupport) -> list[Stratum]:
    return [Stratum(f"page_block_size {p}{'' if not _not_pow2(p) else ' (not a power of two)'}",
                    _dense(s, "pages", heads=st.integers(1, 4), pages=st.just(p), lens=_page_rows(s, p)))
            for p in s.pages]


def _mtp_rows(s: OpSupport):
    def lens(n_q, causal, _page):
        if causal and s.empty_rows and n_q > 1:  # rows shorter than s_q: their first queries see no key
            row = st.one_of(st.integers(n_q, n_q + 48), st.integers(0, n_q - 1))
        else:
            row = _row(s, 48 + n_q, n_q if causal else 1)
        return st.lists(row, min_size=1, max_size=3)
    return lens


def _mtp(s: OpSupport) -> list[Stratum]:
    odd = st.one_of(st.sampled_from([3, 5, 6, 7, 9]), st.integers(3, 31).filter(_not_pow2))
    pow2 = st.sampled_from([2, 4, 8, 16, 32])
    every = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32])
    mk = lambda n_q, causal: _dense(s, "mtp", heads=st.integers(1, 4), s_q=n_q, causal=st.just(causal),
                                    lens=_mtp_rows(s))
    return [Stratum("causal, s_q not a power of two (3, 5, 6: MTP draft tokens)", mk(odd, True)),
            Stratum("causal, s_q a power of two", mk(pow2, True)),
            Stratum("non-causal, s_q 1..9, 16, 32", mk(every, False))]


def _long_rows(s: OpSupport) -> list[Stratum]:
    top = 32769 if s.thorough else 2600
    long_row = st.one_of(st.sampled_from([2049, 2113]), st.integers(2049, top))

    def lens(n_q, causal, _page):
        return st.tuples(long_row, st.lists(_row(s, 64, n_q if causal else 1), max_size=1)).map(
            lambda t: [t[0], *t[1]])
    return [Stratum("a row past 2048 keys (a block-table walk of 32 pages of 64)",
                    _dense(s, "long_rows", heads=st.integers(1, 2), lens=lens), share=0.5)]


@st.composite
def _many_rows(draw, s: OpSupport, n: int):
    """n row lengths from a few draws (a shortest length, a stride and a span, then up to 3 rows set apart, 0 where
    the op takes rows without keys): ragged batches of any size that a failure shrinks in a few steps."""
    low, step, span = draw(st.integers(1, 24)), draw(st.integers(0, 23)), draw(st.integers(1, 24))
    lens = [low + (i * step) % span for i in range(n)]
    for b, length in draw(st.lists(st.tuples(st.integers(0, n - 1), _row(s, 24)), max_size=3)):
        lens[b] = length
    return lens


def _batch(s: OpSupport) -> list[Stratum]:
    large = 1024 if s.thorough else 128

    def mk(batch, share=1.0, name=""):
        return Stratum(name, st.integers(*batch).flatmap(lambda n: _dense(
            s, "batch", heads=st.integers(1, 2), s_q=st.just(1), causal=st.just(False),
            lens=lambda n_q, causal, page: _many_rows(s, n))), share)
    return [mk((2, 32), name="2..32 rows"), mk((33, 64), name="33..64 rows (past a grid of 32)"),
            mk((large, large), share=0.25, name=f"{large} rows (FlashInfer tests up to 1,024)")]


@st.composite
def _sparse_case(draw, s: OpSupport, topk):
    k = draw(topk)
    fmt_dtype = draw(st.sampled_from(s.sparse_formats))
    page = draw(st.sampled_from(s.pages))
    others = draw(st.lists(st.integers(1, 40), max_size=2))
    lens = (k + draw(st.integers(0, 40)), *others)   # the cache holds at least top-k keys
    invalid = draw(st.sampled_from((None, *s.invalid))) if k >= 2 else None
    # a row other than the first (which holds the top-k keys) with every index invalid, where the op takes it
    all_invalid = tuple(draw(st.lists(st.integers(1, len(lens) - 1), max_size=1))) \
        if s.empty_rows and len(lens) > 1 else ()
    extras = draw(_extras(s, formats=s.sparse_formats))
    extras.update(kv_format=fmt_dtype[0], dtype=fmt_dtype[1])
    return OpDraw("sparse", lens, s_q=draw(st.integers(1, 2)), h_q=draw(st.integers(1, 8)), page=page, topk=k,
                  invalid=invalid, all_invalid=all_invalid, topk_length=draw(st.booleans()), **extras)


def _sparse(s: OpSupport) -> list[Stratum]:
    if not s.sparse_formats:
        return []
    top = 2047 if s.thorough else 255
    tail = st.one_of(st.sampled_from([65, 100, 127]), st.integers(65, top).filter(lambda k: k % 64))
    return [Stratum("top-k 1..64", _sparse_case(s, st.integers(1, 64))),
            Stratum("top-k a multiple of 64", _sparse_case(s, st.sampled_from([128, 64, 192, 256]))),
            Stratum("top-k above 64 with a tail past a multiple of 64", _sparse_case(s, tail))]


def _mixed(s: OpSupport) -> list[Stratum]:
    heads = st.one_of(st.integers(1, 16), st.integers(1, 128))
    every = st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 32])
    return [Stratum("every dimension at once", _dense(s, "mixed", heads=heads, s_q=every, rows=st.integers(1, 5)))]


_OP_STRATA = {"heads": _heads, "pages": _pages, "mtp": _mtp, "long_rows": _long_rows, "batch": _batch,
              "sparse": _sparse, "mixed": _mixed}


def op_strata(prop: str, support: OpSupport) -> list[Stratum]:
    """The strata of an op property (empty: nothing the op declares, e.g. sparse without sparse_decode)."""
    return _OP_STRATA[prop](support)


# --------------------------------------------------------------------------- what a backend takes


@st.composite
def _layer_case(draw, configs: tuple[tuple[str, int | None], ...], *, ragged: bool, long: bool, sizes: str):
    """configs: (name, the longest row it is checked on: index_topk for DSA configs, else None)."""
    name, cap = draw(st.sampled_from(configs))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    if long:
        top = 4097 if sizes == "thorough" else 2100
        prefill = (draw(st.integers(2049, top)),)
        return LayerDraw(name, dtype, prefill, chunk=draw(st.sampled_from([1024, None, 700])), decode=1,
                         seed=draw(st.integers(0, 255)))
    decode = draw(st.integers(1, 4) if ragged else st.integers(0, 4))
    limit = (cap - decode) if cap else 40
    if ragged:  # distinct lengths, ascending from the shortest: some row always ends its prefill first
        first = draw(st.integers(1, max(1, limit - 3)))
        steps = draw(st.lists(st.integers(1, 12), min_size=1, max_size=3))
        prefill = [first]
        for step in steps:
            if prefill[-1] + step <= limit:
                prefill.append(prefill[-1] + step)
        prefill = draw(st.permutations(prefill))
        chunk = draw(st.integers(1, 8))
    else:
        prefill = [draw(st.integers(1, limit))]
        chunk = draw(st.one_of(st.none(), st.integers(1, 32)))
    return LayerDraw(name, dtype, tuple(prefill), chunk=chunk, decode=decode, seed=draw(st.integers(0, 255)))


def layer_strata(configs: tuple[tuple[str, int | None], ...], sizes: str = "default") -> list[Stratum]:
    """The strata of the layer property over the configs a backend accepts."""
    dense = tuple(c for c in configs if c[1] is None)
    # the long row on one head: its float64 expanded reference over 2049 tokens grows with the heads, and one head
    # crosses the 2048-position boundary as well as four
    dense = tuple(c for c in dense if c[0] == "tiny-1-head") or dense
    strata = [Stratum("one row, prefill in chunks or one call, then decode steps",
                      _layer_case(configs, ragged=False, long=False, sizes=sizes)),
              Stratum("ragged rows, chunked prefill (rows with no new tokens in a call), then decode steps",
                      _layer_case(configs, ragged=True, long=False, sizes=sizes))]
    if dense:
        strata.append(Stratum("a row past 2048 tokens", _layer_case(dense, ragged=False, long=True, sizes=sizes),
                              share=0.1))
    return strata


__all__ = ["OpDraw", "LayerDraw", "OpSupport", "Stratum", "parse_case", "op_strata", "layer_strata",
           "LAYER_CONFIGS", "OP_PROPERTIES", "LAYER_PROPERTIES"]
