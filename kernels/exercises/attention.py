"""Check for the exercise of chapter 16: the inner loop of FlashAttention's forward, written in PyTorch.

The reader completes ``fn(q, k, v, causal, block_n) -> out`` for one sequence: q is [heads, seq,
head_dim], k and v [kv_heads, seq, head_dim] (grouped-query attention), and the loop walks the keys
``block_n`` at a time with the running maximum m, the running sum l and the accumulator acc of
chapter 05's online softmax. ``check_attention_loop`` runs it on a few fresh float64 inputs (GQA 4/2
and 6/3, causal and not, a length that is a multiple of the block and lengths that are not, scores
large enough that a missing rescale shows) and compares with float64.

Two things are checked. The structure: k and v reach the reader's function wrapped (``watch_keys``),
so the check sees every operation that reads more than ``block_n`` keys at once, as a dense
``softmax(q kᵀ) v`` does. The finished answers (the package's attention, PyTorch's SDPA, the
reference, this module's own loop) are out of reach while it runs
(``reach.FORBIDDEN["attention_loop"]``). Then the numbers: when the output is wrong, the check
recomputes the usual mistakes with the same loop and says which one the output reproduces (the
stub's open TODOs, acc or l not rescaled, alpha inverted, the causal mask missing, off by one or
without the block's offset, masked scores set to 0, the scale missing or 1/d, the wrong KV head, the
output not divided by l, float32 arithmetic). Every diagnosis is worded once, in ``HINTS``. The
check never raises because the reader's code is wrong or unfinished: it prints its verdict and
returns a ``Report``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_map

from kernels.attention import attention_reference
from kernels.reference import relative_error

from .reach import FinishedCodeCalled, call_learner
from .rmsnorm import Report, last_line, verdict

EXERCISE = "attention_loop"
TOLERANCE = 1e-9  # float64 throughout: a right loop is within about 1e-15
FLOAT32_ERROR = 1e-5  # above TOLERANCE and below this, the loop is right but computed in float32 somewhere

# The stub's four TODOs, as mistakes of the loop, and how each reads in a list of what is still to do.
STUB = ("gqa_zero", "no_scale", "no_causal_mask", "no_rescale")
TODO = {
    "gqa_zero": ("the KV head (kh = 0 for every query head; query head h reads KV head h // (heads "
                 "// kv_heads))"),
    "no_scale": "the scale (q @ kᵀ times 1/√d)",
    "no_causal_mask": "the causal mask (with causal, key j is hidden (−inf) from query i when j > i)",
    "no_rescale": ("the rescale (l and acc times alpha = exp(m_old − m_new) before the block's "
                   "terms are added)"),
}

HINTS = {
    "raised": "your function raised {error}",
    "shape": "your function returned {got}, expected a tensor of shape {want} (q's)",
    "dense": ("this computes the whole row at once ({op} over all {keys} keys of a row); the "
              "exercise is the online softmax over blocks of block_n keys: inside the loop over "
              "n0, read k[kh, n0:n0 + block_n] and v[kh, n0:n0 + block_n] and update m, l and acc "
              "from that block alone"),
    "wide": ("{op} read {keys} keys at once, more than block_n = {block_n}: the loop must read the "
             "keys block_n at a time, k[kh, n0:n0 + block_n] and v[kh, n0:n0 + block_n]"),
    "stub": ("attention_loop is still the stub as shipped: its four TODOs are open: "
             + "; ".join(TODO.values())),
    "stub_partly": "{n} of the stub's TODOs are still open: {todo}",
    "dtype": ("your function returned {got}, and the inputs are float64: the loop computed or "
              "stored in {got}. torch.zeros, torch.full and torch.empty without dtype=q.dtype make "
              "float32: allocate out as torch.empty_like(q), and m, l and acc with dtype=q.dtype"),
    "float32": ("the output is right to float32's precision (relative error {error:.1e}) but not "
                "to float64's (the bound is 1e-9): the inputs are float64 and the loop computed in "
                "float32 somewhere: a torch.zeros, torch.full or torch.empty without dtype=q.dtype "
                "makes float32, and so does .float()"),
    "not_finite": ("the output holds NaN or infinity (first in query head {head}, row {row}): a "
                   "0/0 where l is 0 (no key reached that row), or an exp that overflowed (above "
                   "about 709 in float64: is a difference taken the wrong way round?)"),
    "alpha_inverted": ("every value of the output is NaN, which is what alpha = exp(m_new − m_old) "
                       "gives: that exponent is ≥ 0, about +1e30 on the first block (m starts at "
                       "−1e30), so exp overflows to inf and 0 · inf = NaN. When the maximum grows "
                       "the old terms shrink: alpha = exp(m_old − m_new)"),
    "no_rescale_acc": ("acc is not rescaled when the maximum grows: before adding the block's p @ "
                       "v, multiply acc by alpha = exp(m_old − m_new) (one number per query row)"),
    "no_rescale_l": ("l is not rescaled when the maximum grows: l = l · exp(m_old − m_new) + "
                     "p.sum(-1), the same alpha as acc's"),
    "no_rescale": ("neither acc nor l is rescaled when the maximum grows: both were summed "
                   "relative to the old maximum; multiply each by alpha = exp(m_old − m_new) "
                   "before adding the block's terms"),
    "no_causal_mask": ("the output attends to later keys: with causal=True, key j must be masked "
                       "(−inf) for query i when j > i"),
    "causal_strict": ("each query is masked from its own key: the causal mask keeps j ≤ i (the "
                      "diagonal belongs to the query), so it hides j > i, not j ≥ i"),
    "causal_no_offset": ("the causal mask compares each query row with the key's place inside the "
                         "block (0 … block_n − 1), not in the sequence: the block that starts at "
                         "n0 holds keys n0, n0 + 1, …, so cols = torch.arange(n0, min(n0 + "
                         "block_n, seq))"),
    "mask_zero": ("masked scores are set to 0, and a 0 still counts in the softmax (e^(0 − m) > "
                  "0): a hidden key's score must be −inf (float('-inf')), which makes its e^(s − "
                  "m) exactly 0"),
    "no_scale": "the scores are not scaled: multiply q @ kᵀ by 1/√d (d = head_dim) before the softmax",
    "scale_d": "the scores are scaled by 1/d: the scale is 1/√d (d = head_dim), 1 / math.sqrt(d)",
    "gqa_zero": ("every query head reads KV head 0: query head h reads KV head h // (heads // "
                 "kv_heads), since heads // kv_heads consecutive query heads share one"),
    "gqa_modulo": ("query head h reads KV head h % kv_heads: in grouped-query attention "
                   "consecutive query heads share a KV head, h // (heads // kv_heads)"),
    "gqa_kv_heads": ("query head h reads KV head h // kv_heads: the divisor is the group size, "
                     "heads // kv_heads query heads per KV head, so kh = h // (heads // kv_heads) "
                     "(h // kv_heads only agrees when heads = kv_heads²)"),
    "not_normalised": "the output is acc itself: divide by l at the end, out = acc / l[:, None]",
    "unrecognised": ("the output differs from float64 (relative error {error:.2e}) on {case}, in "
                     "query heads {heads} (first wrong query row: {row}), and none of the usual "
                     "mistakes reproduces it: print your output for one head beside "
                     "attention_reference(...) to see the pattern"),
    "passed": ("your inner loop matches float64 on {n} inputs (GQA 4/2 and 6/3, causal and not, "
               "lengths that are and are not a multiple of the block, keys read block_n at a time; "
               "worst relative error {error:.1e})"),
}

# The mistakes the check recognises on their own, in the order it tries them.
MISTAKES = ("no_rescale", "no_rescale_acc", "no_rescale_l", "alpha_inverted", "no_causal_mask",
            "causal_strict",
            "causal_no_offset", "mask_zero", "no_scale", "scale_d", "gqa_zero", "gqa_modulo", "gqa_kv_heads",
            "not_normalised")


def blockwise_attention(q, k, v, causal: bool, block_n: int, *mistakes: str) -> torch.Tensor:
    """The exercise's loop in plain PyTorch, with ``mistakes`` (names of ``MISTAKES``) made on purpose.

    The check recomputes the reader's output with each mistake in turn to name the one it reproduces
    (chapter 16, notebooks/16_flash_attention.ipynb).

    Args:
        q: queries, [heads, seq, head_dim].
        k, v: keys and values, [kv_heads, seq, head_dim]; heads is a multiple of kv_heads.
        causal: hide key j from query i when j > i.
        block_n: how many keys each step of the loop reads.
        *mistakes: names from ``MISTAKES`` (and the stub's ``STUB``) to make on purpose; none gives
            the right loop.

    Returns:
        the attention output, q's shape and dtype.

    Raises:
        IndexError: when a mistaken head mapping (``gqa_modulo``, ``gqa_kv_heads``) reads past the
            last KV head.
    """
    heads, seq, d = q.shape
    kv_heads = k.shape[0]
    scale = 1.0 if "no_scale" in mistakes else 1.0 / d if "scale_d" in mistakes else 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    rows = torch.arange(seq)[:, None]
    for h in range(heads):
        kh = (0 if "gqa_zero" in mistakes else h % kv_heads if "gqa_modulo" in mistakes
              else h // kv_heads if "gqa_kv_heads" in mistakes else h // (heads // kv_heads))
        m = torch.full((seq,), -1e30, dtype=q.dtype)
        l = torch.zeros(seq, dtype=q.dtype)  # noqa: E741  (the l of the online softmax)
        acc = torch.zeros(seq, d, dtype=q.dtype)
        for n0 in range(0, seq, block_n):
            s = q[h] @ k[kh, n0:n0 + block_n].T * scale
            if causal and "no_causal_mask" not in mistakes:
                cols = torch.arange(s.shape[-1])[None, :] + (0 if "causal_no_offset" in mistakes else n0)
                hidden = cols >= rows if "causal_strict" in mistakes else cols > rows
                s = s.masked_fill(hidden, 0.0 if "mask_zero" in mistakes else float("-inf"))
            m_new = torch.maximum(m, s.max(dim=-1).values)
            alpha = torch.exp(m_new - m) if "alpha_inverted" in mistakes else torch.exp(m - m_new)
            p = torch.exp(s - m_new[:, None])
            keep_l = "no_rescale" in mistakes or "no_rescale_l" in mistakes
            keep_acc = "no_rescale" in mistakes or "no_rescale_acc" in mistakes
            l = (l if keep_l else l * alpha) + p.sum(-1)  # noqa: E741
            acc = (acc if keep_acc else acc * alpha[:, None]) + p @ v[kh, n0:n0 + block_n]
            m = m_new
        out[h] = acc if "not_normalised" in mistakes else acc / l[:, None]
    return out


# What the reader's code may do to k and v without reading their values as scores: names of the
# torch functions (and Tensor methods) whose result holds the same elements rearranged (MOVES),
# holds one element per element of the same key (POINTWISE), or holds nothing read from them (FREE).
MOVES = frozenset({
    "__getitem__", "narrow", "select", "index_select", "gather", "take_along_dim", "masked_select",
                   "T", "mT", "H",
    "mH", "t", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis", "reshape",
                   "reshape_as", "view",
    "view_as", "flatten", "unflatten", "squeeze", "unsqueeze", "split", "split_with_sizes",
                   "tensor_split", "chunk",
    "unbind", "hsplit", "vsplit", "dsplit", "expand", "expand_as", "broadcast_to", "repeat",
                   "repeat_interleave",
    "tile", "contiguous", "clone", "detach", "data", "to", "float", "double", "half", "bfloat16",
                   "type", "type_as",
    "cpu", "cuda", "flip", "roll", "cat", "concat", "concatenate", "stack", "unfold", "as_strided",
    "requires_grad_",
})
POINTWISE = frozenset({
    "__add__", "__radd__", "__iadd__", "add", "add_", "__sub__", "__rsub__", "__isub__", "sub",
                       "sub_", "__mul__",
    "__rmul__", "__imul__", "mul", "mul_", "__truediv__", "__rtruediv__", "__itruediv__", "div",
                       "div_", "__neg__",
    "neg", "__pos__", "abs", "exp", "exp2", "sqrt", "__pow__", "pow", "clamp", "nan_to_num",
})
FREE = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                  "new_empty", "new_zeros", "new_ones", "new_full", "new_tensor"})


class KeyReads:
    """The widest read of keys seen while the reader's function ran: the first operation that read
    more than ``block_n`` keys at once, and how many it read (``widest``, None while there is none).

    Args:
        block_n: the most keys one operation may read at once.
    """

    def __init__(self, block_n: int):
        self.block_n = block_n
        self.widest: tuple[str, int] | None = None

    def saw(self, op: str, keys: int) -> None:
        """Record that operation ``op`` read ``keys`` keys; only the first read wider than
        ``block_n`` is kept.

        Args:
            op: the operation's name, as the verdict quotes it.
            keys: how many different key positions its operand spans.
        """
        if keys > self.block_n and self.widest is None:
            self.widest = (op, keys)


class _Keys(torch.Tensor):
    """k or v (or a view of them) as the reader's function sees them: ``_index`` holds each
    element's key position, ``_reads`` the record of reads. Rearranging keeps the wrapper; any other
    operation records how many keys its operands span and returns a plain tensor."""

    _index: torch.Tensor
    _reads: KeyReads

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watched = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, _Keys)]
        reads = watched[0]._reads
        plain = tree_map(lambda a: a._data() if isinstance(a, _Keys) else a, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*plain[0], **plain[1])
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property (k.T, k.mT): the descriptor carries the name
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in FREE or not any(isinstance(x, torch.Tensor) for x in tree_flatten(result)[0]):
            return result  # metadata (shape, dtype, len, repr) or a new tensor like it: no key was read
        try:
            if name in MOVES:
                index = tree_map(lambda a: a._index if isinstance(a, _Keys) else a, (args, kwargs))
                with torch._C.DisableTorchFunctionSubclass():
                    return _rewrap(result, func(*index[0], **index[1]), reads)
            if name in POINTWISE and isinstance(result, torch.Tensor):
                return _wrap(result, watched[0]._index.expand(result.shape), reads)
        except (RuntimeError, TypeError, ValueError, IndexError):
            pass  # the positions do not follow this call's arguments: count it as a read
        for operand in watched:
            reads.saw(name or repr(func), operand.key_count())
        return result

    def _data(self) -> torch.Tensor:
        with torch._C.DisableTorchFunctionSubclass():
            return self.as_subclass(torch.Tensor)

    def key_count(self) -> int:
        """How many different key positions this tensor's elements come from."""
        with torch._C.DisableTorchFunctionSubclass():
            return int(torch.unique(self._index).numel())


def _wrap(data: torch.Tensor, index: torch.Tensor, reads: KeyReads) -> torch.Tensor:
    if not isinstance(index, torch.Tensor) or index.shape != data.shape:
        raise ValueError("positions do not match")
    with torch._C.DisableTorchFunctionSubclass():
        wrapped = data.as_subclass(_Keys)
    wrapped._index, wrapped._reads = index, reads
    return wrapped


def _rewrap(result, index, reads):
    if isinstance(result, torch.Tensor):
        return _wrap(result, index, reads)
    if isinstance(result, (tuple, list)) and len(result) == len(index):
        return type(result)(_rewrap(r, i, reads) for r, i in zip(result, index))
    raise ValueError("positions do not match")


def watch_keys(t: torch.Tensor, reads: KeyReads) -> torch.Tensor:
    """``t`` ([kv_heads, seq, d]) wrapped so that ``reads`` learns of every operation over more than
    ``reads.block_n`` of its keys (dimension 1).

    Args:
        t: k or v, [kv_heads, seq, d].
        reads: the record that the wrapped tensor reports its reads to.

    Returns:
        ``t``'s values as a tensor subclass: rearranging it (slices, views, transposes) keeps the
        watch, any other operation records how many keys it spans and returns a plain tensor.
    """
    index = torch.arange(t.shape[1]).view(1, -1, 1).expand(t.shape).contiguous()
    return _wrap(t, index, reads)


def _plain(t):
    return t._data() if isinstance(t, _Keys) else t


def cases(gen: torch.Generator):
    """The check's inputs, in the order it runs them: ``((heads, kv_heads, seq, d, causal, block_n),
    q, k, v)``, float64, drawn from ``gen``.

    Args:
        gen: the random generator the inputs are drawn from.

    Yields:
        ``(case, q, k, v)``: the case's sizes and flags, then q [heads, seq, d] and k, v
        [kv_heads, seq, d].
    """
    # (heads, kv_heads, seq, d, causal, block_n). The first is causal with a length that is a
    # multiple of the block, so that a mask without the block's offset is named before the partial
    # last block makes it raise; 6/3 heads tell h // (heads // kv_heads) from h // kv_heads, which
    # 4/2 cannot. q's spread makes a missing rescale show.
    for heads, kv_heads, seq, d, causal, block_n in ((4, 2, 40, 16, True, 8), (6, 3, 29, 32, False, 16),
                                                     (4, 2, 37, 16, True, 16)):
        q = torch.randn(heads, seq, d, generator=gen, dtype=torch.float64) * 3
        k = torch.randn(kv_heads, seq, d, generator=gen, dtype=torch.float64)
        v = torch.randn(kv_heads, seq, d, generator=gen, dtype=torch.float64)
        yield (heads, kv_heads, seq, d, causal, block_n), q, k, v


def _describe(case) -> str:
    heads, kv_heads, seq, d, causal, block_n = case
    return (f"{heads}/{kv_heads} heads, seq {seq}, d={d}, {'causal' if causal else 'not causal'}, "
            f"block_n={block_n}")


def _same(out: torch.Tensor, wrong: torch.Tensor) -> bool:
    """``out`` reproduces ``wrong``: NaN and infinity in the same places, the finite values within 1e-6."""
    finite = torch.isfinite(wrong)
    if not torch.equal(finite, torch.isfinite(out)):
        return False
    return not finite.any() or relative_error(out[finite], wrong[finite]) < 1e-6


def diagnose(out, q, k, v, causal, block_n) -> str | None:
    """The hint whose mistake (one of ``MISTAKES``, the stub, or the stub with some TODOs done)
    the float64 recomputation of ``out`` reproduces, or None.

    Args:
        out: the reader's output for this input.
        q, k, v, causal, block_n: the input it was computed from, as ``blockwise_attention`` takes
            them.

    Returns:
        the text of ``HINTS`` that names the mistake (for the partly done stub, with the open TODOs
        filled in), or None when no known mistake reproduces ``out``.
    """
    tries = [(STUB, "stub")] + [((mistake,), mistake) for mistake in MISTAKES]
    tries += [(open_, "stub_partly") for n in (3, 2) for open_ in itertools.combinations(STUB, n)]
    right = blockwise_attention(q, k, v, causal, block_n)
    for mistakes, key in tries:
        if not causal and any(m in ("no_causal_mask", "causal_strict", "causal_no_offset", "mask_zero")
                              for m in mistakes):
            continue
        try:
            wrong = blockwise_attention(q, k, v, causal, block_n, *mistakes)
        except IndexError:  # a head mapping that leaves the KV heads on this input
            continue
        if _same(out, wrong) and not _same(right, wrong):  # (h // kv_heads is right when heads = kv_heads²)
            if key == "stub_partly":
                return HINTS[key].format(n=len(mistakes), todo="; ".join(TODO[m] for m in mistakes))
            return HINTS[key]
    return None


def _where(out: torch.Tensor, ref: torch.Tensor) -> tuple[str, int]:
    """The query heads whose rows differ from ``ref``, and the first wrong row of the first of them."""
    wrong = ~torch.isclose(out, ref, rtol=1e-6, atol=1e-9) | ~torch.isfinite(out)
    heads = [h for h in range(out.shape[0]) if wrong[h].any()]
    if not heads:
        return "(none)", -1
    row = int(wrong[heads[0]].any(-1).nonzero()[0])
    return ", ".join(map(str, heads)), row


def check_attention_loop(fn: Callable, verbose: bool = True, seed: int = 0) -> Report:
    """Run ``fn(q, k, v, causal, block_n)`` on fresh float64 inputs, k and v watched; name the
    mistake when it reads more than ``block_n`` keys at once, calls a finished answer, or returns a
    wrong output (chapter 16, notebooks/16_flash_attention.ipynb).

    Never raises for the reader's code: an error it raises is reported in the verdict.

    Args:
        fn: the reader's inner loop, ``fn(q, k, v, causal, block_n) -> out`` for one sequence (q
            [heads, seq, d], k and v [kv_heads, seq, d], out q's shape and dtype).
        verbose: print the verdict (✓ or ✗ and what is right or wrong).
        seed: seed of the generator the inputs are drawn from.

    Returns:
        a ``Report``: ``passed``, and the verdict's message (the first mistake found, or what was
        checked and the worst relative error).
    """
    gen = torch.Generator().manual_seed(seed)
    worst, n = 0.0, 0
    for case, q, k, v in cases(gen):
        heads, kv_heads, seq, d, causal, block_n = case
        reads = KeyReads(block_n)
        try:
            out = call_learner(EXERCISE, fn, q.clone(), watch_keys(k.clone(), reads),
                               watch_keys(v.clone(), reads), causal, block_n)
        except FinishedCodeCalled as called:
            return verdict(False, str(called), verbose)
        except Exception as exc:  # noqa: BLE001  (the reader's code: report, never raise)
            if reads.widest is None:
                return verdict(False, HINTS["raised"].format(error=last_line(exc)), verbose)
        if reads.widest is not None:
            op, keys = reads.widest
            key = "dense" if keys >= seq else "wide"
            return verdict(False, HINTS[key].format(op=op, keys=keys, block_n=block_n), verbose)
        out = _plain(out)
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            return verdict(False, HINTS["shape"].format(got=got, want=tuple(q.shape)), verbose)
        if out.dtype != q.dtype:
            return verdict(False, HINTS["dtype"].format(got=str(out.dtype).removeprefix("torch.")), verbose)
        out = out.detach()
        ref = attention_reference(q[None], k[None], v[None], causal=causal)[0]
        error = relative_error(out, ref)
        if not error <= TOLERANCE:
            mistake = diagnose(out, q, k, v, causal, block_n)
            if mistake is not None:
                return verdict(False, mistake, verbose)
            if not torch.isfinite(out).all():
                head, row = (int(i) for i in (~torch.isfinite(out)).any(-1).nonzero()[0])
                return verdict(False, HINTS["not_finite"].format(head=head, row=row), verbose)
            if error < FLOAT32_ERROR:
                return verdict(False, HINTS["float32"].format(error=error), verbose)
            heads_wrong, row = _where(out, ref)
            message = HINTS["unrecognised"].format(error=error, case=_describe(case),
                                                   heads=heads_wrong, row=row)
            return verdict(False, message, verbose)
        worst, n = max(worst, error), n + 1
    return verdict(True, HINTS["passed"].format(n=n, error=worst), verbose)
