"""Packed SFT batches (kernels.training.data): independent examples in one row with restarting positions and
document offsets, beside the same examples padded; the two give the same per-example losses."""

import json

import pytest
import torch

from kernels import patch_llama, runtime
from kernels.training.data import (
    IGNORE_INDEX,
    MIN_EXAMPLE_TOKENS,
    example_lengths,
    get_tokenizer,
    make_sft_examples,
    pack_examples,
    pad_examples,
    useful_fraction,
)
from kernels.training.models import build_model, llama_config


def test_length_distribution_is_the_stated_one():
    lengths = example_lengths(4000, 4096, seed=1)
    median = sorted(lengths)[len(lengths) // 2]
    assert 230 <= median <= 285  # log-normal, median 256
    assert min(lengths) >= MIN_EXAMPLE_TOKENS and max(lengths) <= 4096
    assert 0.2 < sum(n > 500 for n in lengths) / len(lengths) < 0.32
    assert example_lengths(10, 300, seed=2) == example_lengths(10, 300, seed=2) != example_lengths(10, 300, seed=3)
    with pytest.raises(ValueError, match="max_len"):
        example_lengths(3, 8)


def test_packed_rows_hold_whole_examples():
    tok = get_tokenizer()
    examples = make_sft_examples(tok, 24, max_len=1024, seed=0)
    batches = pack_examples(examples, tokens_per_batch=2048)
    remaining = list(examples)
    for b in batches:
        cu = b["cu_seq_lens_q"].tolist()
        assert b["input_ids"].shape == (1, 2048) and b["cu_seq_lens_q"].dtype == torch.int32
        assert cu[0] == 0 and cu[-1] == 2048 and b["max_length_q"] == max(e - a for a, e in zip(cu, cu[1:]))
        for i, (a, e) in enumerate(zip(cu, cu[1:])):
            assert b["position_ids"][0, a:e].tolist() == list(range(e - a))
            assert b["labels"][0, a] == IGNORE_INDEX  # no example predicts the next one's first token
            ids, labels = remaining[0] if remaining else ([], [])
            if b["input_ids"][0, a:e].tolist() == ids:
                assert b["labels"][0, a + 1:e].tolist() == labels[1:]
                remaining.pop(0)
            else:  # the padding document: last in its row, nothing trained
                assert i == len(cu) - 2 and (b["labels"][0, a:e] == IGNORE_INDEX).all()
    assert not remaining  # every example, whole and in order
    assert 0.5 < useful_fraction(examples, batches) <= 1.0
    padded = pad_examples(examples, batch_size=4)
    assert useful_fraction(examples, padded) < useful_fraction(examples, batches)
    with pytest.raises(ValueError, match="does not fit"):
        pack_examples(examples, tokens_per_batch=16)


def test_packed_and_padded_give_the_same_per_example_losses(seed):
    # Summed losses over the same examples: padded (SDPA with the padding mask) against packed (our attention),
    # float32. Short examples keep the interpreter quick.
    tok = get_tokenizer()
    examples = make_sft_examples(tok, 4, max_len=40, seed=seed % 1000, median=24)
    model = build_model(llama_config("tiny", num_hidden_layers=1), dtype=torch.float32, seed=0)
    dev = runtime.device()

    def summed(batches, **patch):
        total = 0.0
        for b in batches:
            inputs = {k: (v.to(dev) if isinstance(v, torch.Tensor) else v) for k, v in b.items()}
            count = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
            if count == 0:  # examples truncated to their prompt train no label: their mean loss is 0/0
                continue
            with torch.no_grad():
                total += model(**inputs).loss.item() * count
        return total

    padded = summed(pad_examples(examples, batch_size=2))
    with patch_llama(model, kernels=(), attention=True):
        packed = summed(pack_examples(examples, tokens_per_batch=160))
    # Batches of other shapes round the float32 matmuls differently; a leak across examples moves the loss by far
    # more than this (tests/hf/test_attention_hf.py shows the same examples attended across).
    lengths = [len(ids) for ids, _ in examples]
    assert abs(packed - padded) <= 1e-4 * abs(padded), (packed, padded, lengths)



@pytest.mark.skipif(runtime.MODE == "gpu", reason="the GPU run is the 8B shape: python -m kernels.training.packed")
def test_the_end_to_end_command_runs_both_layouts_over_the_same_examples(tmp_path, capsys):
    from kernels.training import packed

    assert packed.main(["--out", str(tmp_path), "--no-progress", "--examples", "5", "--max-len", "40"]) == 0
    result = json.loads((tmp_path / "packing" / "tiny.json").read_text())
    padded, packed_row = result["rows"]["padded"], result["rows"]["packed"]
    assert "flash_attention" in packed_row["attention"] and "sdpa" in padded["attention"]
    assert padded["labels"] == packed_row["labels"] > 0  # the same examples, the same trained labels
    assert result["loss_relative_difference"] < 1e-5 and padded["summed_loss"] > 0
    assert 0 < padded["useful_fraction"] <= 1 and 0 < packed_row["useful_fraction"] <= 1
    assert result["speedup"] == pytest.approx(packed_row["useful_tokens_per_s"] / padded["useful_tokens_per_s"])
    assert "packed against padded" in capsys.readouterr().out


def test_examples_that_would_pack_wrongly_are_refused():
    # Each of these packed or padded silently out of step (labels shorter than the ids) or into a useless batch.
    for pack in (lambda e: pack_examples(e, 16), lambda e: pad_examples(e, 2)):
        with pytest.raises(ValueError, match="3 input_ids but 1 labels"):
            pack([([5, 6, 7], [5, 6, 7]), ([1, 2, 3], [IGNORE_INDEX])])
        with pytest.raises(ValueError, match="example 0 has no tokens"):
            pack([([], [])])
        with pytest.raises(TypeError, match="input_ids must be integers"):
            pack([([1.5, 2.0], [1, 2])])
        with pytest.raises(TypeError, match="must be a pair"):
            pack([[1, 2, 3]])
    tensors = [(torch.tensor([4, 5, 6]), torch.tensor([IGNORE_INDEX, 5, 6]))]  # tensors are taken as their values
    assert pack_examples(tensors, 8)[0]["labels"][0, :3].tolist() == [IGNORE_INDEX, 5, 6]
    with pytest.raises(ValueError, match="no tokens"):
        useful_fraction([], [])
    with pytest.raises(ValueError, match="median must be a positive int"):
        example_lengths(3, 64, median=0)
    with pytest.raises(ValueError, match="sigma must be"):
        example_lengths(3, 64, sigma=float("nan"))
