"""The tiled MLP: every output and gradient against float64 Hugging Face, at lengths that are no multiple of the tile,
under checkpointing; the tile length's rule; the module swap and its refusals."""

import copy

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP

from kernels import runtime
from kernels.hf.patch import patch_llama
from kernels.hf.tiled_mlp import (
    ALIGN,
    CPU_TILE_BYTES,
    FREE_FRACTION,
    MAX_TILE_BYTES,
    TiledSwiGLUFunction,
    TiledSwiGLUMLP,
    apply_tiled_mlp,
    recomputing,
    tile_bounds,
    tile_bytes_per_row,
    tile_rows,
    tiled_swiglu_mlp,
)
from kernels.reference import relative_error
from kernels.tolerances import RELATIVE_ERROR_TOL as TOL
from kernels.training.loop import enable_checkpointing
from kernels.training.models import build_model

HIDDEN, INTER = 48, 136  # intermediate no power of two, as Llama's 14,336 is not a multiple of the kernels' blocks


def hf_mlp(dtype, device, **config):
    cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_attention_heads=4, hidden_act="silu", **config)
    mlp = LlamaMLP(cfg).to(device, dtype)
    with torch.no_grad():  # from the test's seeded global generator (conftest)
        for p in mlp.parameters():
            p.normal_(0, 0.1)
    return mlp


def errors(mlp, tiled, x, dy):
    """Relative errors of the tiled MLP's output, dx and three weight gradients against float64 Hugging Face."""
    ref = copy.deepcopy(mlp).double()
    xt = x.detach().clone().requires_grad_()
    out = tiled(xt)
    out.backward(dy)
    x64 = x.detach().double().requires_grad_()
    out64 = ref(x64)
    out64.backward(dy.double())
    names = ("gate_proj", "up_proj", "down_proj")
    return [relative_error(out, out64), relative_error(xt.grad, x64.grad)] + [
        relative_error(getattr(tiled, n).weight.grad, getattr(ref, n).weight.grad) for n in names]


# ---------------------------------------------------------------------------------------------------------------
# The tile length
# ---------------------------------------------------------------------------------------------------------------


def test_tile_rows_scales_with_the_free_memory_and_the_sizes():
    big = 1 << 40
    base = tile_rows(big, 4096, 14336, torch.bfloat16, free_bytes=1 << 30)
    assert base % ALIGN == 0 and base >= ALIGN
    # Twice the free memory: about twice the rows (within one alignment step), until the cap.
    assert abs(tile_rows(big, 4096, 14336, torch.bfloat16, free_bytes=2 << 30) - 2 * base) <= ALIGN
    # Twice the intermediate size: about half the rows; float32 rows take twice the bytes of bf16 ones.
    assert abs(tile_rows(big, 4096, 28672, torch.bfloat16, free_bytes=1 << 30) - base / 2) <= 2 * ALIGN
    assert abs(tile_rows(big, 4096, 14336, torch.float32, free_bytes=1 << 30) - base / 2) <= ALIGN
    # The exact rule: the budget over the bytes per row, rounded down to the alignment.
    per_row = tile_bytes_per_row(4096, 14336, torch.bfloat16)
    assert base == int((1 << 30) * FREE_FRACTION) // per_row // ALIGN * ALIGN
    # Capped by MAX_TILE_BYTES however much is free; never more rows than the input (rounded up to ALIGN).
    capped = tile_rows(big, 4096, 14336, torch.bfloat16, free_bytes=1 << 50)
    assert capped == MAX_TILE_BYTES // per_row // ALIGN * ALIGN
    assert tile_rows(100, 4096, 14336, torch.bfloat16, free_bytes=1 << 40) == 128
    assert tile_rows(big, 4096, 14336, torch.bfloat16, free_bytes=0) == ALIGN  # never below one aligned block


@pytest.mark.skipif(runtime.MODE == "gpu", reason="on a GPU the budget is a share of the free memory")
def test_tile_rows_on_the_cpu_uses_the_documented_budget():
    rows = tile_rows(1 << 30, 128, 344, torch.float32)
    assert rows == CPU_TILE_BYTES // tile_bytes_per_row(128, 344, torch.float32) // ALIGN * ALIGN


@pytest.mark.parametrize("bad", [dict(n_rows=0), dict(hidden=-1), dict(free_bytes=-5), dict(intermediate=2.5)])
def test_tile_rows_rejects_bad_sizes(bad):
    args = dict(n_rows=100, hidden=64, intermediate=128, dtype=torch.float32, free_bytes=1 << 20) | bad
    with pytest.raises(ValueError, match=next(iter(bad))):
        tile_rows(**args)


def test_tile_bounds_cover_every_row_once_with_a_partial_last_tile():
    assert tile_bounds(53, 16) == [(0, 16), (16, 32), (32, 48), (48, 53)]
    assert tile_bounds(32, 16) == [(0, 16), (16, 32)]
    assert tile_bounds(5, 16) == [(0, 5)]
    assert tile_bounds(0, 16) == []


# ---------------------------------------------------------------------------------------------------------------
# Exact against Hugging Face
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3 * 8 + 5), (53,), (1, 7)], ids=["3d-3tiles+5", "2d", "one-partial-tile"])
def test_matches_hugging_face_in_float64(shape, dtype, device, gen):
    mlp = hf_mlp(dtype, device)
    tiled = TiledSwiGLUMLP.from_hf(copy.deepcopy(mlp), tile_rows=16)
    x = torch.randn(*shape, HIDDEN, generator=gen).to(device, dtype)
    dy = torch.randn(*shape, HIDDEN, generator=gen).to(device, dtype)
    errs = errors(mlp, tiled, x, dy)
    assert all(e < TOL[dtype] for e in errs), f"out, dx, d_gate, d_up, d_down: {errs}"


def test_weight_gradients_accumulated_in_the_weights_dtype(device, gen):
    mlp = hf_mlp(torch.float32, device)
    tiled = TiledSwiGLUMLP.from_hf(copy.deepcopy(mlp), tile_rows=8, grad_dtype=None)
    x = torch.randn(3, 21, HIDDEN, generator=gen).to(device)
    errs = errors(mlp, tiled, x, torch.randn(3, 21, HIDDEN, generator=gen).to(device))
    assert all(e < TOL[torch.float32] for e in errs), errs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inside_checkpoint_equals_without(dtype, device, gen):
    # A residual block as a decoder layer has it, checkpointed the way Hugging Face does (non-reentrant).
    mlp = hf_mlp(dtype, device)
    tiled = TiledSwiGLUMLP.from_hf(copy.deepcopy(mlp), tile_rows=16)
    x = torch.randn(2, 37, HIDDEN, generator=gen).to(device, dtype)
    dy = torch.randn(2, 37, HIDDEN, generator=gen).to(device, dtype)

    def run(module, checkpointed):
        xt = x.detach().clone().requires_grad_()

        def block(h):
            return h + module(h)

        out = torch.utils.checkpoint.checkpoint(block, xt, use_reentrant=False) if checkpointed else block(xt)
        out.backward(dy)
        grads = [xt.grad] + [getattr(module, n).weight.grad.clone() for n in ("gate_proj", "up_proj", "down_proj")]
        module.zero_grad(set_to_none=True)
        return [out.detach()] + grads

    plain, checkpointed = run(tiled, False), run(tiled, True)
    for a, b in zip(plain, checkpointed):
        assert torch.equal(a, b)  # the recompute cuts the same tiles: the very same bits
    x64 = x.detach().double().requires_grad_()
    ref = copy.deepcopy(mlp).double()
    out64 = x64 + ref(x64)
    out64.backward(dy.double())
    refs = [out64, x64.grad] + [getattr(ref, n).weight.grad for n in ("gate_proj", "up_proj", "down_proj")]
    errs = [relative_error(a, r) for a, r in zip(checkpointed, refs)]
    assert all(e < TOL[dtype] for e in errs), errs


def _checkpointed_run(module, x, dy, **checkpoint_options):
    """A residual block checkpointed with ``checkpoint_options``: the output, dx and the three weight gradients."""
    xt = x.detach().clone().requires_grad_()
    out = torch.utils.checkpoint.checkpoint(lambda h: h + module(h), xt, **checkpoint_options)
    out.backward(dy)
    grads = [xt.grad] + [getattr(module, n).weight.grad.clone() for n in ("gate_proj", "up_proj", "down_proj")]
    module.zero_grad(set_to_none=True)
    return [out.detach()] + grads


@pytest.mark.parametrize("options", [{"use_reentrant": False}, {"use_reentrant": True}, "no-early-stop"],
                         ids=["non-reentrant", "reentrant", "non-reentrant-no-early-stop"])
def test_the_recompute_computes_no_tile_and_the_gradients_stay_exact(options, device, gen, monkeypatch):
    import kernels.hf.tiled_mlp as tiled_mlp

    calls = []
    real = tiled_mlp.swiglu_forward
    monkeypatch.setattr(tiled_mlp, "swiglu_forward", lambda g, u: calls.append(g.shape[0]) or real(g, u))
    mlp = hf_mlp(torch.float32, device)
    x = torch.randn(2, 37, HIDDEN, generator=gen).to(device)  # 74 rows: 5 tiles of 16, the last one of 10
    dy = torch.randn(2, 37, HIDDEN, generator=gen).to(device)
    checkpoint_options = {"use_reentrant": False} if options == "no-early-stop" else options
    results = {}
    for skip in (True, False):
        tiled = TiledSwiGLUMLP.from_hf(copy.deepcopy(mlp), tile_rows=16)
        tiled.skip_recompute = skip
        calls.clear()
        if options == "no-early-stop":
            with torch.utils.checkpoint.set_checkpoint_early_stop(False):
                results[skip] = _checkpointed_run(tiled, x, dy, **checkpoint_options)
        else:
            results[skip] = _checkpointed_run(tiled, x, dy, **checkpoint_options)
        # the forward's tiles, then the backward's (y for d(W_down)); without the skip the recompute's tiles too
        assert calls == [16, 16, 16, 16, 10] * (2 if skip else 3), (skip, calls)
    for a, b in zip(results[True], results[False]):
        assert torch.equal(a, b)  # the NaN output of the skipped recompute reaches no gradient
    assert all(torch.isfinite(t).all() for t in results[True])


def test_a_forward_outside_a_backward_is_never_skipped(device, gen):
    tiled = TiledSwiGLUMLP.from_hf(hf_mlp(torch.float32, device), tile_rows=16)
    x = torch.randn(3, 20, HIDDEN, generator=gen).to(device)
    assert not recomputing()
    assert torch.isfinite(tiled(x)).all() and torch.isfinite(tiled(x.requires_grad_())).all()


def test_gradients_only_where_needed(device, gen):
    mlp = hf_mlp(torch.float32, device)
    tiled = TiledSwiGLUMLP.from_hf(mlp, tile_rows=8)
    for p in tiled.parameters():
        p.requires_grad_(False)
    x = torch.randn(19, HIDDEN, generator=gen).to(device).requires_grad_()
    tiled(x).sum().backward()
    assert x.grad is not None and all(p.grad is None for p in tiled.parameters())
    for p in tiled.parameters():
        p.requires_grad_(True)
    tiled(x.detach()).sum().backward()
    assert all(p.grad is not None for p in tiled.parameters())


def test_without_grad_nothing_is_saved(device, gen):
    tiled = TiledSwiGLUMLP.from_hf(hf_mlp(torch.float32, device), tile_rows=8)
    with torch.no_grad():
        out = tiled(torch.randn(2, 11, HIDDEN, generator=gen).to(device))
    assert out.grad_fn is None and out.shape == (2, 11, HIDDEN)


def test_the_automatic_tile_is_kept_per_row_count(device, gen):
    tiled = TiledSwiGLUMLP.from_hf(hf_mlp(torch.float32, device))
    x = torch.randn(2, 9, HIDDEN, generator=gen).to(device)
    first = tiled.rows_for(x)
    assert first == tile_rows(18, HIDDEN, INTER, torch.float32) and tiled.chosen == {18: first}
    assert tiled.rows_for(x) == first


def test_bad_inputs_are_named(device, gen):
    mlp = hf_mlp(torch.float32, device)
    w = (mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)
    x = torch.randn(4, HIDDEN, generator=gen).to(device)
    with pytest.raises(TypeError, match="w_gate has dtype"):
        TiledSwiGLUFunction.apply(x.double(), *w, 8, torch.float32)
    with pytest.raises(ValueError, match="w_down must have shape"):
        tiled_swiglu_mlp(x, w[0], w[1], w[0], rows=8)
    with pytest.raises(ValueError, match="tile_rows must be a positive int"):
        tiled_swiglu_mlp(x, *w, rows=0)
    with pytest.raises(ValueError, match="w_gate is on"):
        tiled_swiglu_mlp(x.to("meta"), *w, rows=8)


# ---------------------------------------------------------------------------------------------------------------
# The swap into a model
# ---------------------------------------------------------------------------------------------------------------


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_apply_tiled_mlp_matches_hugging_face_and_undoes(device, gen):
    model = build_model("tiny", dtype=torch.float32, device=device, seed=0)
    enable_checkpointing(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 3 * 16 + 5), generator=gen).to(device)
    originals = [layer.mlp for layer in model.model.layers]
    ref_loss, ref_grads = loss_and_grads(model, ids)
    with apply_tiled_mlp(model, tile_rows=16) as handle:
        assert len(handle.swaps) == model.config.num_hidden_layers
        layer = model.model.layers[0]
        assert isinstance(layer.mlp, TiledSwiGLUMLP) and layer.mlp.gate_proj is originals[0].gate_proj
        loss, grads = loss_and_grads(model, ids)
    assert [layer.mlp for layer in model.model.layers] == originals
    assert relative_error(loss, ref_loss) < TOL[torch.float32]
    worst = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
    assert worst < TOL[torch.float32], worst


def test_apply_tiled_mlp_takes_the_patched_swiglu_mlp(device):
    model = build_model("tiny", dtype=torch.float32, device=device, seed=0)
    patch = patch_llama(model, rms_norm=False, cross_entropy=False, swiglu=True)
    handle = apply_tiled_mlp(model, tile_rows=64)
    assert all(isinstance(layer.mlp, TiledSwiGLUMLP) for layer in model.model.layers)
    handle.undo()
    patch.undo()
    assert all(type(layer.mlp).__name__ == "LlamaMLP" for layer in model.model.layers)


class LoraLike(torch.nn.Module):
    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x)


@pytest.mark.parametrize("change, error, words", [
    ("gelu", ValueError, "activation 'gelu'"),
    ("bias", TypeError, "has a bias"),
    ("lora", TypeError, "is a LoraLike"),
    ("no_up", TypeError, "no up_proj"),
])
def test_refusals_leave_the_model_unchanged(change, error, words, device):
    model = build_model("tiny", dtype=torch.float32, device=device, seed=0)
    mlp = model.model.layers[2].mlp
    if change == "gelu":
        mlp.config = copy.copy(mlp.config)
        mlp.config.hidden_act = "gelu"
    elif change == "bias":
        mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(mlp.down_proj.out_features, device=device))
    elif change == "lora":
        mlp.up_proj = LoraLike(mlp.up_proj)
    else:
        del mlp.up_proj
    before = [layer.mlp for layer in model.model.layers]
    with pytest.raises(error, match=words):
        apply_tiled_mlp(model)
    assert [layer.mlp for layer in model.model.layers] == before


# ---------------------------------------------------------------------------------------------------------------
# GPU: the 8B MLP shape
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_8b_shape_bf16_matches_float64_and_holds_less(gen):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, hidden_act="silu")
    mlp = LlamaMLP(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0, 0.02)
    rows = 3 * 512 + 5
    tiled = TiledSwiGLUMLP.from_hf(copy.deepcopy(mlp), tile_rows=512)
    x = torch.randn(1, rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    dy = torch.randn(1, rows, 4096, generator=gen).to("cuda", torch.bfloat16)
    errs = errors(mlp, tiled, x, dy)
    assert all(e < TOL[torch.bfloat16] for e in errs), errs

    def peak(module, n):
        xt = torch.randn(1, n, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn_like(xt)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        module(xt).backward(g)
        torch.cuda.synchronize()
        module.zero_grad(set_to_none=True)
        return torch.cuda.max_memory_allocated() - before

    n = 16384
    untiled, tiled_peak = peak(mlp, n), peak(TiledSwiGLUMLP.from_hf(mlp, tile_rows=1024), n)
    one = n * 14336 * 2  # one [tokens, intermediate] bf16 tensor
    weight_grads = 3 * 4096 * 14336 * (4 + 2)  # the float32 sums and the bf16 gradients, whatever the length
    assert untiled > 3 * one and tiled_peak - weight_grads < one, (untiled / one, tiled_peak / one)


@pytest.mark.gpu
def test_gpu_float32_sums_of_bf16_tiles(gen):
    # Where the mixed-precision addmm exists the tile's product enters the float32 sum unrounded; either way the sum
    # stays within a bf16 product's rounding of the float64 one.
    import kernels.hf.tiled_mlp as tiled_mlp

    a = torch.randn(512, 300, generator=gen).to("cuda", torch.bfloat16)
    b = torch.randn(300, 384, generator=gen).to("cuda", torch.bfloat16)
    acc = torch.randn(512, 384, generator=gen).to("cuda")
    want = acc.double() + a.double() @ b.double()
    tiled_mlp._accumulate(acc, a, b)
    mixed = tiled_mlp._MIXED_ADDMM[("cuda", torch.bfloat16, torch.float32)]
    print(f"mixed-precision addmm on this GPU: {mixed}")
    err = relative_error(acc, want)
    assert err < (1e-5 if mixed else TOL[torch.bfloat16]), (mixed, err)


def test_a_compiled_checkpointed_model_with_tiled_mlps_matches_and_skips_its_recompute(device, gen, monkeypatch):
    # The tiled MLP's forward is left out of the compiled graph (it runs eagerly), so its checkpointed layer's
    # recompute still runs it inside the backward: it computes no tile there, under torch.compile as in eager.
    import kernels.hf.tiled_mlp as tiled_mlp

    calls = []
    real = tiled_mlp.swiglu_forward
    monkeypatch.setattr(tiled_mlp, "swiglu_forward", lambda g, u: calls.append(g.shape[0]) or real(g, u))
    model = build_model("tiny", dtype=torch.float32, device=device, seed=0)
    enable_checkpointing(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 3 * 16 + 5), generator=gen).to(device)
    ref_loss, ref_grads = loss_and_grads(model, ids)
    with apply_tiled_mlp(model, tile_rows=16):
        backend = "inductor" if device == "cuda" else "aot_eager"  # the CPU has no inductor compiler here
        loss, grads = loss_and_grads(torch.compile(model, backend=backend), ids)
    torch._dynamo.reset()
    grads = {n.removeprefix("_orig_mod."): g for n, g in grads.items()}  # the compiled wrapper's names
    assert relative_error(loss, ref_loss) < TOL[torch.float32]
    worst = max(relative_error(grads[n], ref_grads[n]) for n in ref_grads)
    assert worst < TOL[torch.float32], worst
    tiles = len(tile_bounds(ids.numel(), 16))
    assert len(calls) == 2 * tiles * model.config.num_hidden_layers  # forward and backward; no recompute
