"""The SFT stream: correct answers, masking exactly as SFT does, padding, determinism, ids inside the vocabulary."""

import re

import pytest
import torch

from kernels.training.data import (
    IGNORE_INDEX,
    PAD,
    PROMPT,
    RESPONSE,
    get_tokenizer,
    label_stats,
    make_examples,
    make_sft_batches,
    render_row,
    train_default_tokenizer,
)
from kernels.training.models import llama_config


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def test_generated_answers_are_correct():
    checked = 0
    for ex in make_examples(600, seed=5):
        numbers = [int(n) for n in re.findall(r"\d+", ex.prompt)]
        if ex.prompt.startswith("Sort these numbers"):
            assert ex.response == ", ".join(map(str, sorted(numbers)))
        elif ex.prompt.startswith("Reverse"):
            word = re.search(r'"(\w+)"', ex.prompt).group(1)
            assert ex.response == word[::-1]
        elif "gets" in ex.prompt and "more" in ex.prompt:
            assert ex.response.startswith(f"{numbers[0]} + {numbers[1]} = {numbers[0] + numbers[1]}.")
        elif "gave" in ex.prompt:
            assert ex.response.startswith(f"{numbers[0]} - {numbers[1]} = {numbers[0] - numbers[1]}.")
        elif "What does this Python code print?\n\nx =" in ex.prompt:
            x, y, z = numbers
            assert ex.response == str(x * y - z)
        else:
            continue
        checked += 1
    assert checked > 150
    assert len({ex.task for ex in make_examples(200)}) == 3
    assert make_examples(50, seed=1) == make_examples(50, seed=1) != make_examples(50, seed=2)


def test_default_tokenizer_is_deterministic_and_fits_the_tiny_model(tok):
    again = train_default_tokenizer()
    assert again.get_vocab() == tok.get_vocab()
    assert len(tok) <= llama_config("tiny").vocab_size
    text = "### Instruction:\nReverse «kernel» — 42 ünïcode\n"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text  # byte-level: lossless
    assert tok.eos_token_id is not None and tok.pad_token_id is not None and tok.bos_token_id is not None


def test_batch_shapes_dtypes_and_masks(tok):
    batches = make_sft_batches(tok, batch_size=3, seq_len=96, n_batches=2, with_roles=True)
    assert len(batches) == 2
    for batch in batches:
        for key in ("input_ids", "attention_mask", "labels", "roles"):
            assert batch[key].shape == (3, 96) and batch[key].dtype == torch.long, key
        ids, labels, roles, mask = batch["input_ids"], batch["labels"], batch["roles"], batch["attention_mask"]
        assert torch.equal(mask, (roles != PAD).long())
        # Every prompt and padding label is -100; every response label is the input id at that position.
        assert (labels[roles == PROMPT] == IGNORE_INDEX).all()
        assert (labels[roles == PAD] == IGNORE_INDEX).all()
        assert torch.equal(labels[roles == RESPONSE], ids[roles == RESPONSE])
        assert (roles == RESPONSE).any(dim=1).all()  # every row trains on something
        assert (ids[roles == PAD] == tok.pad_token_id).all()
        assert (ids[:, 0] == tok.bos_token_id).all()


def test_trained_spans_decode_to_whole_answers(tok):
    """Independent of the roles: each run of trained labels decodes to one dataset answer followed by <|end|>."""
    answers = {ex.response for ex in make_examples()}
    batch = make_sft_batches(tok, 4, 160, 1, seed=3)[0]
    spans = 0
    for row in range(4):
        trained = (batch["labels"][row] != IGNORE_INDEX).tolist() + [False]
        start = None
        for i, flag in enumerate(trained):
            if flag and start is None:
                start = i
            elif not flag and start is not None:
                text = tok.decode(batch["labels"][row, start:i].tolist())
                if i < 160:  # a span cut by the end of the row would be a truncated answer
                    assert text.endswith(tok.eos_token) and text[: -len(tok.eos_token)] in answers, text
                    spans += 1
                start = None
    assert spans >= 4


def test_padding_and_masking_really_occur(tok):
    stats = label_stats(make_sft_batches(tok, 8, 128, 1)[0])
    assert 0.02 < stats["padding"] < 0.6
    assert 0.2 < stats["prompt (label -100)"] < 0.8
    assert 0.1 < stats["trained (label = input id)"] < 0.6


def test_long_rows_pack_a_conversation(tok):
    batch = make_sft_batches(tok, 2, 2048, 1, with_roles=True)[0]
    roles = batch["roles"]
    # Many exchanges per row: count prompt->response transitions.
    turns = ((roles[:, 1:] == RESPONSE) & (roles[:, :-1] == PROMPT)).sum(dim=1)
    assert (turns > 20).all()
    stats = label_stats(batch)
    assert 0.1 < stats["trained (label = input id)"] < 0.9
    assert stats["prompt (label -100)"] > 0.1
    assert stats["padding"] < 0.1


def test_same_seed_same_batches_and_every_batch_differs(tok):
    a = make_sft_batches(tok, 2, 64, 4, seed=11)
    b = make_sft_batches(tok, 2, 64, 4, seed=11)
    c = make_sft_batches(tok, 2, 64, 4, seed=12)
    assert len(a) == len(b)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["labels"], y["labels"])
               for x, y in zip(a, b))
    assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])
    firsts = {tuple(batch["input_ids"][0].tolist()) for batch in a}
    assert len(firsts) == 4


def test_the_stream_goes_on_past_one_epoch(tok):
    batches = make_sft_batches(tok, 4, 64, 6, n_examples=30)  # 30 examples, far more rows than that
    assert all((b["labels"] != IGNORE_INDEX).any() for b in batches)


def test_ids_stay_inside_the_vocabulary(tok):
    vocab = llama_config("tiny").vocab_size
    batch = make_sft_batches(tok, 4, 128, 1, vocab_size=vocab)[0]
    assert int(batch["input_ids"].max()) < vocab and int(batch["input_ids"].min()) >= 0
    with pytest.raises(ValueError, match="vocab_size=500"):
        make_sft_batches(tok, 4, 128, 1, vocab_size=500)


def test_short_rows_truncate_answers_but_still_train(tok):
    batch = make_sft_batches(tok, 4, 40, 2, with_roles=True)[1]
    assert (batch["roles"] == RESPONSE).any(dim=1).all()


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size"), (dict(seq_len=-4), "seq_len"), (dict(n_batches=1.5), "n_batches"),
])
def test_bad_arguments_are_named(tok, kwargs, match):
    args = dict(batch_size=2, seq_len=64, n_batches=1) | kwargs
    with pytest.raises(ValueError, match=match):
        make_sft_batches(tok, **args)
    with pytest.raises(TypeError, match="tokenizer"):
        make_sft_batches("gpt2", 2, 64, 1)


def test_local_tokenizer_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path / "tok")
    loaded = get_tokenizer(tmp_path / "tok")
    text = "### Instruction:\nSort these numbers: 3, 1, 2.\n"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    a = make_sft_batches(loaded, 2, 64, 1)[0]
    b = make_sft_batches(tok, 2, 64, 1)[0]
    assert torch.equal(a["labels"], b["labels"])
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        get_tokenizer(tmp_path / "missing")


def test_render_row_marks_trained_text(tok):
    batch = make_sft_batches(tok, 1, 96, 1)[0]
    text = render_row(tok, batch)
    assert "«" in text and "### Instruction:" in text and "padding tokens" in text


def test_min_seq_len_is_the_shortest_row_that_holds_an_exchange():
    # The command lines refuse a shorter --seq-len before any work on this constant's word: it must be exact.
    from kernels.training.data import MIN_SEQ_LEN
    from kernels.training.loop import make_run_batches

    assert make_run_batches("tiny", 1, MIN_SEQ_LEN, 1, 1)[0]["input_ids"].shape[-1] <= MIN_SEQ_LEN
    with pytest.raises(ValueError, match=f"too short for any prompt of this dataset; use at least {MIN_SEQ_LEN}"):
        make_run_batches("tiny", 1, MIN_SEQ_LEN - 1, 1, 1)
