"""A real supervised fine-tuning (SFT) batch stream, made offline and deterministically.

The data: a few thousand instruction/response pairs generated from a seed, each with a computed,
correct answer: arithmetic word problems, string manipulations (reverse, count, sort, capitalise)
and short Python tasks (what does this print, write this function). Answers run from one token to a
few dozen, so sequences have different lengths.

The template, as instruction tuning uses it::

    <|begin|>### Instruction:
    {prompt}

    ### Response:
    {response}<|end|>

Labels are the input ids on the response and its end token, and ``-100`` on the prompt, the begin
token and the padding, so the loss trains only on what the model should answer (Hugging Face shifts
labels by one inside its loss). ``attention_mask`` is 0 on padding.

Long rows (seq 2048 on a GPU) hold a *conversation*: exchange after exchange is appended while the
next one fits, then the rest of the row is padded. Every response in the row is trained on and every
prompt is masked, which is how multi-turn chat data is fine-tuned; attending to the earlier
exchanges of the row is then correct, not a leak between unrelated examples. It also keeps a real
fraction of the labels at ``-100`` (prompts, padding) and a real fraction trained, at any sequence
length, without wasting most of a 2,048-token row on padding.

Tokenizer: a real one when given (a local directory or an id already in the Hugging Face cache,
never downloaded), otherwise a byte-level BPE tokenizer trained here on the generated text with the
``tokenizers`` library (under a second, deterministic, 2,048 ids at most, the vocabulary of the
``"tiny"`` model preset).

Chapter 01 (notebooks/01_profile_baseline.ipynb) looks at these batches, token by token; chapter 16
(notebooks/16_flash_attention.ipynb) packs independent examples of them (the second half of this
file).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100
PROMPT_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"
SPECIAL_TOKENS = {"bos_token": "<|begin|>", "eos_token": "<|end|>", "pad_token": "<|pad|>"}
DEFAULT_VOCAB_SIZE = 2048
DATASET_SEED = 0  # the dataset is fixed; the seed given to make_sft_batches shuffles it
DEFAULT_EXAMPLES = 2000
# The shortest row that holds any exchange of this dataset with the workbook's tokenizer: its
# shortest prompt, the BOS and one response token (tests/training/test_data.py checks it). Command lines
# refuse shorter --seq-len before any work.
MIN_SEQ_LEN = 21

# Token roles in a packed row (make_sft_batches(..., with_roles=True) returns them).
PAD, PROMPT, RESPONSE = 0, 1, 2


@dataclass(frozen=True)
class Example:
    """One instruction/response pair; ``task`` is ``"arithmetic"``, ``"string"`` or ``"code"``."""

    task: str
    prompt: str
    response: str


# --------------------------------------------------------------------------------------------------
# The generated dataset: every answer is computed, so it is correct
# --------------------------------------------------------------------------------------------------

NAMES = [
    "Ada", "Ben", "Chen", "Dara", "Eli", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemi", "Luca", "Mira",
    "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara", "Zoe",
]
OBJECTS = [
    "apples", "pencils", "marbles", "stickers", "books", "coins", "cards", "shells", "stamps",
    "cookies", "bolts",
]
WORDS = [
    "kernel", "tensor", "gradient", "softmax", "profiler", "warp", "register", "memory",
    "bandwidth", "matrix",
    "vector", "pointer", "thread", "block", "cache", "latency", "compiler", "buffer", "token",
    "layer", "attention",
    "python", "triton", "reduce", "scatter", "gather", "launch", "stream", "device", "shape",
    "norm", "logits",
]


def _add_problem(rng: random.Random) -> Example:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(2, 500), rng.randint(2, 500)
    return Example(
        "arithmetic",
        f"{name} has {a} {obj} and gets {b} more. How many {obj} does {name} have now?",
        f"{a} + {b} = {a + b}. {name} has {a + b} {obj}.",
    )


def _subtract_problem(rng: random.Random) -> Example:
    name, other, obj = rng.choice(NAMES), rng.choice(NAMES), rng.choice(OBJECTS)
    a = rng.randint(20, 900)
    b = rng.randint(1, a - 1)
    return Example(
        "arithmetic",
        f"{name} had {a} {obj} and gave {b} of them to {other}. How many {obj} does {name} have left?",
        f"{a} - {b} = {a - b}. {name} has {a - b} {obj} left.",
    )


def _multiply_problem(rng: random.Random) -> Example:
    obj = rng.choice(OBJECTS)
    per_box, boxes = rng.randint(2, 48), rng.randint(2, 60)
    return Example(
        "arithmetic",
        f"A shop packs {per_box} {obj} in each box. How many {obj} are in {boxes} boxes?",
        f"{boxes} * {per_box} = {boxes * per_box}. There are {boxes * per_box} {obj} in {boxes} boxes.",
    )


def _divide_problem(rng: random.Random) -> Example:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    friends, total = rng.randint(2, 12), rng.randint(13, 400)
    each, left = divmod(total, friends)
    return Example(
        "arithmetic",
        f"{name} shares {total} {obj} equally among {friends} friends. How many does each friend get, "
        "and how many are left over?",
        f"{total} // {friends} = {each} remainder {left}. Each friend gets {each} {obj} and {left} are left over.",
    )


def _reverse_word(rng: random.Random) -> Example:
    word = rng.choice(WORDS)
    return Example("string", f'Reverse the letters of the word "{word}".', word[::-1])


def _capitalise(rng: random.Random) -> Example:
    phrase = " ".join(rng.sample(WORDS, rng.randint(2, 5)))
    return Example("string", f'Write "{phrase}" in capital letters.', phrase.upper())


def _count_letter(rng: random.Random) -> Example:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    n = word.count(letter)
    times = "time" if n == 1 else "times"
    return Example(
        "string",
        f'How many times does the letter "{letter}" appear in "{word}"?',
        f'The letter "{letter}" appears {n} {times} in "{word}".',
    )


def _sort_numbers(rng: random.Random) -> Example:
    numbers = [rng.randint(0, 999) for _ in range(rng.randint(3, 12))]
    return Example(
        "string",
        "Sort these numbers from smallest to largest: " + ", ".join(map(str, numbers)) + ".",
        ", ".join(map(str, sorted(numbers))),
    )


def _sort_words(rng: random.Random) -> Example:
    words = rng.sample(WORDS, rng.randint(3, 8))
    return Example(
        "string",
        "Put these words in alphabetical order: " + ", ".join(words) + ".",
        ", ".join(sorted(words)),
    )


def _python_print(rng: random.Random) -> Example:
    x, y, z = rng.randint(2, 30), rng.randint(2, 30), rng.randint(0, 50)
    return Example(
        "code",
        f"What does this Python code print?\n\nx = {x}\ny = {y}\nprint(x * y - {z})",
        str(x * y - z),
    )


def _python_list(rng: random.Random) -> Example:
    k, n = rng.randint(2, 9), rng.randint(3, 12)
    return Example(
        "code",
        f"What does this Python code print?\n\nprint([i * {k} for i in range({n})])",
        str([i * k for i in range(n)]),
    )


def _python_function(rng: random.Random) -> Example:
    k = rng.randint(2, 20)
    kind = rng.randrange(3)
    if kind == 0:
        prompt = f"Write a Python function scale_by_{k}(values) that returns a list of every value multiplied by {k}."
        response = f"def scale_by_{k}(values):\n    return [v * {k} for v in values]"
    elif kind == 1:
        prompt = f"Write a Python function count_above_{k}(values) that counts the values greater than {k}."
        response = f"def count_above_{k}(values):\n    return sum(1 for v in values if v > {k})"
    else:
        prompt = f"Write a Python function add_{k}(x) that returns x plus {k}."
        response = f"def add_{k}(x):\n    return x + {k}"
    return Example("code", prompt, response)


GENERATORS: tuple[Callable[[random.Random], Example], ...] = (
    _add_problem, _subtract_problem, _multiply_problem, _divide_problem,
    _reverse_word, _capitalise, _count_letter, _sort_numbers, _sort_words,
    _python_print, _python_list, _python_function,
)


def make_examples(n: int = DEFAULT_EXAMPLES, seed: int = DATASET_SEED) -> list[Example]:
    """``n`` instruction/response pairs drawn from ``seed``: the same arguments give the same list.

    Chapter 01 (notebooks/01_profile_baseline.ipynb) prints a few.

    Args:
        n: how many pairs.
        seed: the draw; ``DATASET_SEED`` is the workbook's dataset.

    Returns:
        The ``Example``s, each from a generator of ``GENERATORS`` chosen at random.

    Raises:
        ValueError: ``n`` is not a positive int.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    rng = random.Random(seed)
    return [rng.choice(GENERATORS)(rng) for _ in range(n)]


def format_prompt(prompt: str) -> str:
    """A prompt in the instruction template, up to where the response starts (no begin token).

    Args:
        prompt: the instruction.

    Returns:
        ``PROMPT_TEMPLATE`` filled with ``prompt``.
    """
    return PROMPT_TEMPLATE.format(prompt=prompt)


# --------------------------------------------------------------------------------------------------
# Tokenizers
# --------------------------------------------------------------------------------------------------


def train_default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:  # noqa: F821
    """Train a byte-level BPE tokenizer on the generated dataset (deterministic; well under a second).

    Byte-level means any text can be encoded (unknown characters fall back to bytes) and decoding
    gives the text back exactly. The special tokens are ``<|begin|>``, ``<|end|>`` and ``<|pad|>``.

    Args:
        vocab_size: the most ids it may have, special tokens and the 256 byte symbols included.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with the special tokens of ``SPECIAL_TOKENS``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [format_prompt(ex.prompt) + ex.response for ex in make_examples()]
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


@functools.lru_cache(maxsize=1)
def _default_tokenizer():
    return train_default_tokenizer()


def get_tokenizer(name_or_path=None) -> PreTrainedTokenizerBase:
    """A tokenizer: the workbook's own (trained once per process, then cached) or a local Hugging Face one.

    ``name_or_path`` may be a directory holding a saved tokenizer or a hub id already in the Hugging
    Face cache (e.g. the Llama 3 tokenizer, whose 128,256 ids match the full-size presets); nothing
    is downloaded. Chapter 01 (notebooks/01_profile_baseline.ipynb) loads the workbook's own.

    Args:
        name_or_path: None for the workbook's own, or a directory or hub id (str or ``Path``).

    Returns:
        The tokenizer.

    Raises:
        TypeError: ``name_or_path`` is neither None, a str nor a ``Path``.
        FileNotFoundError: no such tokenizer is found locally.
        ValueError: the tokenizer has no end-of-sequence token.
    """
    if name_or_path is None:
        return _default_tokenizer()
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"name_or_path must be None, a directory or a hub id, got {type(name_or_path).__name__}")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(name_or_path), local_files_only=True)
    except OSError as err:
        raise FileNotFoundError(
            f"No tokenizer found for {str(name_or_path)!r} locally (a directory or an id already in the Hugging "
            "Face cache; nothing is downloaded). Call get_tokenizer() without arguments for the workbook's own."
        ) from err
    if tok.eos_token_id is None:
        raise ValueError(f"the tokenizer {str(name_or_path)!r} has no eos_token: responses must end with one")
    return tok


# --------------------------------------------------------------------------------------------------
# Packing rows and batches
# --------------------------------------------------------------------------------------------------


def _encoded_examples(tokenizer, n_examples: int):
    """The dataset tokenized once per (tokenizer, size): cached where the tokenizer can be a cache key."""
    try:
        return _encoded_examples_cached(tokenizer, n_examples)
    except TypeError:  # an unhashable tokenizer: encode afresh
        return _encode_examples(tokenizer, n_examples)


def _encode_examples(tokenizer, n_examples: int) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """(prompt ids, response ids + end id) per example. Prompt and response are tokenized separately, so the
    boundary between what is masked and what is trained falls exactly between two tokens."""
    examples = make_examples(n_examples)
    prompts = tokenizer([format_prompt(ex.prompt) for ex in examples], add_special_tokens=False)["input_ids"]
    responses = tokenizer([ex.response for ex in examples], add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    return tuple((tuple(p), tuple(r) + (eos,)) for p, r in zip(prompts, responses))


_encoded_examples_cached = functools.lru_cache(maxsize=8)(_encode_examples)


def _example_order(n_examples: int, seed: int) -> Iterator[int]:
    """Example indices forever: every epoch a fresh permutation drawn from (seed, epoch)."""
    epoch = 0
    while True:
        order = list(range(n_examples))
        random.Random(f"{seed}/{epoch}").shuffle(order)
        yield from order
        epoch += 1


def _pack_rows(encoded, order: Iterator[int], seq_len: int,
               bos: int | None) -> Iterator[tuple[list[int], list[int]]]:
    """Rows of (ids, roles) of length <= seq_len: exchanges appended while the next one fits."""
    start = [bos] if bos is not None else []
    ids, roles = list(start), [PROMPT] * len(start)
    skipped_in_a_row = 0
    for index in order:
        prompt, response = encoded[index]
        if len(ids) + len(prompt) + len(response) <= seq_len:
            ids += prompt + response
            roles += [PROMPT] * len(prompt) + [RESPONSE] * len(response)
            skipped_in_a_row = 0
            continue
        if len(ids) > len(start):  # the row has exchanges: close it, the next row starts with this exchange
            yield ids, roles
            ids, roles = list(start), [PROMPT] * len(start)
            if len(ids) + len(prompt) + len(response) <= seq_len:
                ids += prompt + response
                roles += [PROMPT] * len(prompt) + [RESPONSE] * len(response)
                continue
        # One exchange longer than a whole row: keep its prompt and as much of the response as fits,
        # as SFT truncation does; an exchange whose prompt alone fills the row is skipped.
        room = seq_len - len(ids) - len(prompt)
        if room >= 1:
            yield ids + list(prompt) + list(response[:room]), roles + [PROMPT] * len(prompt) + [RESPONSE] * room
            skipped_in_a_row = 0
        else:
            skipped_in_a_row += 1
            if skipped_in_a_row > len(encoded):
                raise ValueError(f"seq_len={seq_len} is too short for any prompt of this dataset; use at least "
                                 f"{MIN_SEQ_LEN}")


def _check_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_sft_batches(
    tokenizer,
    batch_size: int,
    seq_len: int,
    n_batches: int,
    seed: int = 0,
    *,
    vocab_size: int | None = None,
    n_examples: int = DEFAULT_EXAMPLES,
    with_roles: bool = False,
) -> list[dict[str, torch.Tensor]]:
    """``n_batches`` SFT batches: dicts of ``input_ids``, ``attention_mask`` and ``labels``, each
    [batch_size, seq_len].

    ``seed`` shuffles the dataset (a new permutation every epoch), so the same seed gives the same
    batches and successive batches hold different examples. ``vocab_size``, when given (the
    model's), is checked against every token id. ``with_roles=True`` adds ``roles`` (0 padding, 1
    prompt, 2 response) for inspection; leave it off for batches that go into ``model(**batch)``.
    Chapter 01 (notebooks/01_profile_baseline.ipynb) builds and inspects them; chapter 08 trains on
    them.

    Args:
        tokenizer: a Hugging Face tokenizer with an end token (``get_tokenizer``); padding uses its
            pad token, else its end token.
        batch_size: rows per batch.
        seq_len: tokens per row.
        n_batches: how many batches.
        seed: the order of the examples.
        vocab_size: the model's vocabulary, checked against every id; None to skip the check.
        n_examples: the size of the dataset drawn from.
        with_roles: add each position's role.

    Returns:
        The batches (long tensors on the CPU); labels are the ids on responses and their end tokens,
        -100 elsewhere, and ``attention_mask`` is 0 on padding.

    Raises:
        TypeError: ``tokenizer`` is not a Hugging Face tokenizer.
        ValueError: a size is not a positive int, the tokenizer has no end token, ``seq_len`` is too
            short for any prompt of the dataset (``MIN_SEQ_LEN``), or a token id is not below
            ``vocab_size``.
    """
    sizes = (("batch_size", batch_size), ("seq_len", seq_len), ("n_batches", n_batches),
             ("n_examples", n_examples))
    for name, value in sizes:
        _check_positive_int(name, value)
    if tokenizer is None or not hasattr(tokenizer, "eos_token_id"):
        raise TypeError(
            f"tokenizer must be a Hugging Face tokenizer (see get_tokenizer), got {type(tokenizer).__name__}"
        )
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token_id: every response must end with one")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = _encoded_examples(tokenizer, n_examples)
    rows = _pack_rows(encoded, _example_order(n_examples, seed), seq_len, tokenizer.bos_token_id)

    n_rows = batch_size * n_batches
    ids = torch.full((n_rows, seq_len), pad, dtype=torch.long)
    roles = torch.full((n_rows, seq_len), PAD, dtype=torch.long)
    for i in range(n_rows):
        row_ids, row_roles = next(rows)
        ids[i, : len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        roles[i, : len(row_roles)] = torch.tensor(row_roles, dtype=torch.long)
    if vocab_size is not None:
        _check_positive_int("vocab_size", vocab_size)
        top = int(ids.max())
        if top >= vocab_size:
            raise ValueError(
                f"token id {top} is not below vocab_size={vocab_size}: build the model with a vocabulary that covers "
                f"the tokenizer, e.g. llama_config('tiny', vocab_size={len(tokenizer)})"
            )
    labels = torch.where(roles == RESPONSE, ids, torch.full_like(ids, IGNORE_INDEX))
    attention_mask = (roles != PAD).long()

    batches = []
    for b in range(n_batches):
        rows_b = slice(b * batch_size, (b + 1) * batch_size)
        batch = {"input_ids": ids[rows_b], "attention_mask": attention_mask[rows_b],
                 "labels": labels[rows_b]}
        if with_roles:
            batch["roles"] = roles[rows_b]
        batches.append(batch)
    return batches


# --------------------------------------------------------------------------------------------------
# Looking at a batch
# --------------------------------------------------------------------------------------------------


def label_stats(batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Fractions of the batch's positions that are padding, masked prompt tokens, and trained (label
    != -100). Chapter 01 (notebooks/01_profile_baseline.ipynb) prints them.

    Args:
        batch: a batch with ``attention_mask`` and ``labels``.

    Returns:
        ``tokens`` (the positions, a count), then the fractions ``padding``, ``prompt (label -100)``
        and ``trained (label = input id)``.
    """
    mask = batch["attention_mask"].bool()
    trained = batch["labels"] != IGNORE_INDEX
    total = mask.numel()
    return {
        "tokens": total,
        "padding": float((~mask).sum()) / total,
        "prompt (label -100)": float((mask & ~trained).sum()) / total,
        "trained (label = input id)": float(trained.sum()) / total,
    }


def render_row(tokenizer, batch: dict[str, torch.Tensor], row: int = 0, max_chars: int | None = 1500) -> str:
    """One row as text: masked tokens as they are, trained tokens inside «…», padding summarised at
    the end. Chapter 01 (notebooks/01_profile_baseline.ipynb) prints one.

    Args:
        tokenizer: the tokenizer that made the batch.
        batch: a batch with ``input_ids``, ``labels`` and ``attention_mask``.
        row: which row.
        max_chars: cut the text after this many characters (saying how many more); None for all.

    Returns:
        The text, with a last line counting the padding tokens.
    """
    ids = batch["input_ids"][row].tolist()
    trained = (batch["labels"][row] != IGNORE_INDEX).tolist()
    real = batch["attention_mask"][row].bool().tolist()
    pieces, start = [], 0
    n_real = sum(real)
    while start < n_real:
        end = start
        while end < n_real and trained[end] == trained[start]:
            end += 1
        text = tokenizer.decode(ids[start:end])
        pieces.append(f"«{text}»" if trained[start] else text)
        start = end
    out = "".join(pieces)
    if max_chars is not None and len(out) > max_chars:
        out = out[:max_chars] + f" … [{len(out) - max_chars:,} more characters]"
    n_pad = len(ids) - n_real
    return out + (f"\n[{n_pad} padding tokens]" if n_pad else "\n[no padding]")


def plot_label_mask(batch: dict[str, torch.Tensor], ax=None, max_rows: int = 16):
    """Each row of the batch as a strip: padding, masked prompt tokens, trained response tokens.

    Chapter 01 (notebooks/01_profile_baseline.ipynb) draws it.

    Args:
        batch: a batch with ``attention_mask`` and ``labels``.
        ax: a matplotlib axis; None makes a new figure with one.
        max_rows: draw at most this many rows, the first ones.

    Returns:
        The axis.
    """
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    mask = batch["attention_mask"][:max_rows].bool()
    trained = batch["labels"][:max_rows] != IGNORE_INDEX
    image = torch.where(trained, 2, torch.where(mask, 1, 0)).numpy()
    colors = ["#dddddd", "#9ecae1", "#e6550d"]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.35 * image.shape[0] + 1.2))
    ax.imshow(image, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors), vmin=0, vmax=2)
    ax.set_xlabel("position in the row")
    ax.set_ylabel("row")
    ax.set_yticks(range(image.shape[0]))
    labels = ["padding (label -100, attention 0)", "prompt (label -100)", "response (trained)"]
    ax.legend(handles=[Patch(color=c, label=text) for c, text in zip(colors, labels)], loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=3, frameon=False)
    ax.set_title("Which tokens the loss trains on")
    return ax


# --------------------------------------------------------------------------------------------------
# Packed SFT batches: independent examples in one row, no padding between them
# --------------------------------------------------------------------------------------------------
#
# The stream above fills a row with one conversation. Fine-tuning sets are usually independent
# examples of very different lengths; padded to the longest in a batch they waste most of the
# compute on padding, and concatenated without care they attend to each other. Packed, each batch is
# one row of ``tokens_per_batch`` tokens holding whole examples back to back, with ``position_ids``
# restarting at 0 in each example and the document offsets ``cu_seq_lens_q``/``cu_seq_lens_k`` (the
# keys ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` writes): attention that honours
# them (``patch_llama(model, attention=True)``, or transformers' own packed mask under SDPA) keeps
# every example alone.
#
# Length distribution (stated, not measured from a public set): an example's length in tokens is
# log-normal with median ``PACKED_MEDIAN`` = 256 and σ = ``PACKED_SIGMA`` = 1.0, clipped to [32,
# max_len]. About a quarter of the examples pass 500 tokens and one in twenty 1,300, a long tail
# like instruction and chat sets have. Each example is a conversation of the generated exchanges
# filled to its drawn length (prompts masked, responses trained).

PACKED_MEDIAN = 256
PACKED_SIGMA = 1.0
MIN_EXAMPLE_TOKENS = 32


def example_lengths(n: int, max_len: int, seed: int = 0, median: int = PACKED_MEDIAN,
                    sigma: float = PACKED_SIGMA) -> list[int]:
    """``n`` example lengths drawn from the stated distribution: log-normal (``median``, ``sigma``),
    clipped to [32, ``max_len``]. Chapter 16 (notebooks/16_flash_attention.ipynb) draws them.

    Args:
        n: how many lengths.
        max_len: the longest allowed, at least ``MIN_EXAMPLE_TOKENS``.
        seed: the draw.
        median: the distribution's median, in tokens.
        sigma: the standard deviation of the length's logarithm.

    Returns:
        The lengths, in tokens.

    Raises:
        ValueError: ``n``, ``max_len`` or ``median`` is not a positive int, ``sigma`` is negative or
            not finite, or ``max_len`` is below ``MIN_EXAMPLE_TOKENS``.
    """
    _check_positive_int("n", n)
    _check_positive_int("max_len", max_len)
    _check_positive_int("median", median)
    if not isinstance(sigma, (int, float)) or isinstance(sigma, bool) or not 0 <= sigma < float("inf"):
        raise ValueError(f"sigma must be a finite number ≥ 0, got {sigma!r}")
    if max_len < MIN_EXAMPLE_TOKENS:
        raise ValueError(f"max_len must be at least {MIN_EXAMPLE_TOKENS}, got {max_len}")
    rng = random.Random(f"lengths/{seed}")
    return [min(max_len,
                max(MIN_EXAMPLE_TOKENS, round(rng.lognormvariate(0.0, sigma) * median))) for _ in range(n)]


def make_sft_examples(tokenizer, n: int, max_len: int, seed: int = 0,
                      **length_kw) -> list[tuple[list[int], list[int]]]:
    """``n`` independent examples ``(input_ids, labels)`` with lengths from ``example_lengths``.

    Each one is the generated exchanges appended until its drawn length (labels -100 on prompts and
    the begin token); one whose exchanges stop short of it keeps what it holds. Chapter 16
    (notebooks/16_flash_attention.ipynb) packs them.

    Args:
        tokenizer: the tokenizer (``get_tokenizer``).
        n: how many examples.
        max_len: the longest an example may be.
        seed: the draw of lengths and the order of the exchanges.
        length_kw: ``median`` and ``sigma`` of ``example_lengths``.

    Returns:
        The examples, each a pair of int lists of one length.
    """
    lengths = example_lengths(n, max_len, seed, **length_kw)
    batch = make_sft_batches(tokenizer, n, max(lengths), 1, seed, with_roles=True)[0]
    examples = []
    for i, length in enumerate(lengths):
        ids, labels = batch["input_ids"][i, :length], batch["labels"][i, :length]
        real = int(batch["attention_mask"][i, :length].sum())  # a row shorter than drawn keeps what it holds
        examples.append((ids[:real].tolist(), labels[:real].tolist()))
    return examples


def check_examples(examples) -> list[tuple[list[int], list[int]]]:
    """``examples`` as a list of ``(input_ids, labels)`` pairs of int lists, or an error naming the
    first that is not one: ids and labels of one length (a label per token, or the two would be
    read out of step), at least one token, integers only.

    Args:
        examples: an iterable of pairs of int sequences (lists or tensors).

    Returns:
        The pairs, as lists of ints.

    Raises:
        TypeError: an example is not a pair, or holds something other than ints.
        ValueError: an example has no tokens, or not one label per token.
    """
    checked = []
    for i, example in enumerate(examples):
        try:
            ids, labels = example
        except (TypeError, ValueError):
            raise TypeError(f"example {i} must be a pair (input_ids, labels), got {type(example).__name__}") from None
        ids, labels = _int_list(f"example {i}'s input_ids", ids), _int_list(f"example {i}'s labels", labels)
        if not ids:
            raise ValueError(f"example {i} has no tokens: an example needs at least one")
        if len(ids) != len(labels):
            raise ValueError(f"example {i} has {len(ids)} input_ids but {len(labels)} labels: one label per token")
        checked.append((ids, labels))
    return checked


def _int_list(name: str, values) -> list[int]:
    values = values.tolist() if isinstance(values, torch.Tensor) else list(values)
    bad = next((v for v in values if not isinstance(v, int) or isinstance(v, bool)), None)
    if bad is not None:
        raise TypeError(f"{name} must be integers (token ids, or -100), got {bad!r}")
    return values


def pack_examples(examples, tokens_per_batch: int, pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """Batches of one row of exactly ``tokens_per_batch`` tokens: whole examples in order, a new
    batch when the next does not fit. The rest of a row is one padding document (labels -100, a
    document of its own, so no example attends to it). Keys: ``input_ids``, ``labels``,
    ``position_ids`` [1, tokens_per_batch], ``cu_seq_lens_q`` and ``cu_seq_lens_k`` (int32),
    ``max_length_q``/``max_length_k`` (ints), as ``DataCollatorWithFlattening`` gives. Chapter 16
    (notebooks/16_flash_attention.ipynb) trains on them.

    Args:
        examples: ``(input_ids, labels)`` pairs, as ``check_examples`` takes.
        tokens_per_batch: the length of every row.
        pad_id: the id that fills the rest of a row.

    Returns:
        The batches; each example's first label is -100 (the previous example's last position must
        not predict it).

    Raises:
        TypeError: an example ``check_examples`` rejects as not a pair of int sequences.
        ValueError: ``tokens_per_batch`` is not a positive int, an example is longer than it, or
            ``check_examples`` rejects one (empty, or not one label per token).
    """
    _check_positive_int("tokens_per_batch", tokens_per_batch)
    examples = check_examples(examples)
    rows: list[list] = [[]]
    used = 0
    for ids, labels in examples:
        if len(ids) > tokens_per_batch:
            raise ValueError(f"an example of {len(ids)} tokens does not fit tokens_per_batch={tokens_per_batch}")
        if used + len(ids) > tokens_per_batch:
            rows.append([])
            used = 0
        rows[-1].append((ids, labels))
        used += len(ids)
    return [_packed_row(row, tokens_per_batch, pad_id) for row in rows if row]


def _packed_row(row, tokens_per_batch: int, pad_id: int) -> dict[str, torch.Tensor]:
    ids, labels, positions, offsets = [], [], [], [0]
    for example_ids, example_labels in row:
        ids += example_ids
        # The first token of an example is never a target: the loss's shift would make the previous
        # example's last position predict it.
        labels += [IGNORE_INDEX] + list(example_labels[1:])
        positions += range(len(example_ids))
        offsets.append(len(ids))
    rest = tokens_per_batch - len(ids)
    if rest:
        ids += [pad_id] * rest
        labels += [IGNORE_INDEX] * rest
        positions += range(rest)
        offsets.append(tokens_per_batch)
    longest = max(b - a for a, b in zip(offsets, offsets[1:]))
    cu = torch.tensor(offsets, dtype=torch.int32)
    return {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
            "position_ids": torch.tensor([positions]), "cu_seq_lens_q": cu, "cu_seq_lens_k": cu.clone(),
            "max_length_q": longest, "max_length_k": longest}


def pad_examples(examples, batch_size: int, pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """The same examples as padded batches, ``batch_size`` per batch, each padded on the right to
    its longest: ``input_ids``, ``attention_mask``, ``labels`` (-100 on padding and on each
    example's first token, as packed). Chapter 16 (notebooks/16_flash_attention.ipynb) sets them
    against the packed batches.

    Args:
        examples: ``(input_ids, labels)`` pairs, as ``check_examples`` takes.
        batch_size: examples per batch (the last batch may hold fewer).
        pad_id: the id of the padding.

    Returns:
        The batches, long tensors [examples in it, its longest example].

    Raises:
        TypeError: an example ``check_examples`` rejects as not a pair of int sequences.
        ValueError: ``batch_size`` is not a positive int, or ``check_examples`` rejects an example
            (empty, or not one label per token).
    """
    _check_positive_int("batch_size", batch_size)
    examples = check_examples(examples)
    batches = []
    for start in range(0, len(examples), batch_size):
        group = examples[start:start + batch_size]
        width = max(len(ids) for ids, _ in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        labels = torch.full((len(group), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(group), width), dtype=torch.long)
        for i, (example_ids, example_labels) in enumerate(group):
            ids[i, :len(example_ids)] = torch.tensor(example_ids)
            labels[i, 1:len(example_ids)] = torch.tensor(example_labels[1:], dtype=torch.long)
            mask[i, :len(example_ids)] = 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def useful_fraction(examples, batches) -> float:
    """The examples' tokens over all tokens the batches made of them hold (padding included): 1.0
    means none. Chapter 16 (notebooks/16_flash_attention.ipynb) compares packing with padding by it.

    Args:
        examples: the ``(input_ids, labels)`` pairs the batches were made of.
        batches: the batches, packed or padded.

    Returns:
        The fraction of the batches' positions that hold an example's token.

    Raises:
        ValueError: the batches hold no tokens.
    """
    total = sum(b["input_ids"].numel() for b in batches)
    if total == 0:
        raise ValueError("the batches hold no tokens: there is no fraction to take")
    return sum(len(ids) for ids, _ in examples) / total
