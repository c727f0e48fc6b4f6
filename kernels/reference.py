"""Plain-PyTorch references that the Triton kernels are tested against.

They follow Hugging Face's code operation for operation, casts included, so that "matches the
reference" means "matches what a Hugging Face model computes today". Run them on float64 inputs to
get the ground truth that the tests measure relative errors against.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm exactly as ``transformers``' ``LlamaRMSNorm.forward`` computes it (chapters 02 to 04, 13).

    Normalise in float32, cast back to the input's dtype, *then* multiply by the weight (so a
    bfloat16 model rounds the normalised value to bfloat16 before the weight product, and a float32
    weight promotes the output to float32). A float64 input stays float64 throughout.

    Args:
        x: the activations, ``[..., hidden]``; normalised over the last dimension.
        weight: the per-feature scale, ``[hidden]``.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``weight * normalised(x)``, of ``x``'s shape, in the promoted dtype of ``weight`` and ``x``.
    """
    input_dtype = x.dtype
    hidden = x.to(torch.float32) if x.dtype != torch.float64 else x
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


def relative_error(
    actual: torch.Tensor, expected: torch.Tensor, *, on_device: bool = False,
    dtype: torch.dtype = torch.float64
) -> float:
    """‖actual − expected‖ / ‖expected‖, the error measure of the tests and chapters.

    By default both tensors are copied to the CPU first. ``on_device=True`` computes where
    ``actual`` lives and only the two norms cross to the host: for large GPU tensors (a benchmark's
    logits, 1 GB in float64; a model's gradients) that saves seconds to minutes on a slow host.
    ``dtype=torch.float32`` halves the temporaries there.

    Args:
        actual: what the kernel computed.
        expected: the reference, of the same shape.
        on_device: compute on ``actual``'s device instead of the CPU.
        dtype: the precision the difference and the norms are computed in.

    Returns:
        The relative error; ``inf`` when ``actual`` holds a NaN or an infinity, and the absolute
        error ‖actual − expected‖ when ``expected`` is all zeros.

    Raises:
        ValueError: when the shapes differ.
    """
    device = actual.device if on_device else torch.device("cpu")
    actual = actual.detach().to(dtype).to(device)
    expected = expected.detach().to(dtype).to(device)
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    if not torch.isfinite(actual).all():
        return float("inf")
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom > 0 else diff


# --------------------------------------------------------------------------------------------------
# Cross-entropy and the online softmax (chapters 05 and 06)
# --------------------------------------------------------------------------------------------------


def cross_entropy_hf(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> torch.Tensor:
    """The loss a Hugging Face causal LM computes: logits upcast to float32, then ``F.cross_entropy``.

    float64 logits stay float64 (that is the ground truth the tests use). Chapter 06 checks the
    cross-entropy kernel against it.

    Args:
        logits: ``[..., V]``.
        target: one class index per row of ``logits`` (shape ``logits.shape[:-1]``, or flat).
        ignore_index: a target value whose rows count neither in the loss nor in the mean.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``, as ``F.cross_entropy`` takes it.

    Returns:
        The loss, float32 (float64 for float64 logits): a scalar, or with ``reduction="none"`` one
        per row, of shape ``logits.shape[:-1]``.
    """
    upcast = logits.to(torch.float32) if logits.dtype != torch.float64 else logits
    rows = upcast.reshape(-1, upcast.shape[-1])
    loss = F.cross_entropy(rows, target.reshape(-1), ignore_index=ignore_index, reduction=reduction)
    return loss.view(logits.shape[:-1]) if reduction == "none" else loss


@dataclass(frozen=True)
class OnlineSoftmaxStep:
    """The state of the online softmax after one chunk of a row (all floats, in the row's precision)."""

    chunk: int  # which chunk (0, 1, ...)
    start: int  # the chunk covers row[start:stop]
    stop: int
    chunk_max: float  # max of this chunk alone
    max_before: float  # running max m before the chunk (-inf before the first)
    max_after: float  # m after: max(max_before, chunk_max)
    rescale: float  # exp(max_before - max_after): what the old running sum is multiplied by
    running_sum: float  # s after the chunk: Σ exp(x - max_after) over everything seen so far
    # max_after + log(running_sum): the logsumexp of the row so far (of the whole row at the end)
    logsumexp: float


def _compute_dtype(row: torch.Tensor) -> torch.dtype:
    return torch.float64 if row.dtype == torch.float64 else torch.float32


def online_softmax_steps(row: torch.Tensor, chunk: int) -> list[OnlineSoftmaxStep]:
    """Walk a 1-D ``row`` ``chunk`` values at a time with the online-softmax update (chapter 05).

    After each chunk:  m' = max(m, max(chunk)),  s' = s · exp(m − m') + Σ exp(chunk − m').
    At the end logsumexp(row) = m + log(s). Arithmetic is float32 (float64 for a float64 row), as
    in the kernel, on the CPU.

    Args:
        row: a non-empty 1-D tensor (any device).
        chunk: how many values each step reads (the last step may read fewer).

    Returns:
        One ``OnlineSoftmaxStep`` per chunk, in order; the last one's ``logsumexp`` is the row's.

    Raises:
        ValueError: when ``row`` is not 1-D or is empty, or ``chunk`` is below 1.
    """
    if row.dim() != 1 or row.numel() == 0:
        raise ValueError(f"row must be a non-empty 1-D tensor, got shape {tuple(row.shape)}")
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of elements, got {chunk}")
    x = row.detach().to(_compute_dtype(row)).cpu()
    m = torch.tensor(-math.inf, dtype=x.dtype)
    s = torch.tensor(0.0, dtype=x.dtype)
    steps = []
    for index, start in enumerate(range(0, x.numel(), chunk)):
        block = x[start : start + chunk]
        block_max = block.max()
        m_new = torch.maximum(m, block_max)
        rescale = torch.exp(m - m_new)  # exp(-inf) = 0 on the first chunk: the empty sum contributes nothing
        s = s * rescale + torch.exp(block - m_new).sum()
        steps.append(
            OnlineSoftmaxStep(
                chunk=index, start=start, stop=start + block.numel(), chunk_max=block_max.item(),
                max_before=m.item(), max_after=m_new.item(), rescale=rescale.item(), running_sum=s.item(),
                logsumexp=(m_new + torch.log(s)).item(),
            )
        )
        m = m_new
    return steps


def online_logsumexp(row: torch.Tensor, chunk: int) -> torch.Tensor:
    """logsumexp of a 1-D ``row`` computed chunk by chunk: one pass, running max and rescaled sum.

    Chapters 05 and 10 compare it with ``torch.logsumexp``.

    Args:
        row: a non-empty 1-D tensor.
        chunk: how many values each step reads (see ``online_softmax_steps``).

    Returns:
        A 0-d CPU tensor, float32 (float64 for a float64 row).

    Raises:
        ValueError: as ``online_softmax_steps``.
    """
    return torch.tensor(online_softmax_steps(row, chunk)[-1].logsumexp, dtype=_compute_dtype(row))


# --------------------------------------------------------------------------------------------------
# Linear cross-entropy (chapter 10)
# --------------------------------------------------------------------------------------------------


def linear_cross_entropy_reference(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
    dtype: torch.dtype = torch.float64, chunk: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mean cross-entropy of ``hidden @ weight.T`` and its two gradients (chapter 10's kernel).

    Computed in ``dtype``, on the inputs' device, a chunk of tokens at a time so that the reference
    itself fits beside a benchmark's tensors. The inputs are upcast as they are (already rounded
    values: the reference is exact for the inputs the kernel saw). Each chunk's sum is divided by
    the number of counted targets of the whole batch, so the chunks add up to the mean.

    Args:
        hidden: ``[tokens, H]``, the last hidden states.
        weight: ``[V, H]``, the output projection (``lm_head``).
        target: ``[tokens]``, one class index per token.
        ignore_index: a target value whose tokens count neither in the loss nor in the mean.
        dtype: the precision of the whole computation.
        chunk: how many tokens each step computes logits for.

    Returns:
        ``(loss, d_hidden, d_weight)`` in ``dtype``: the 0-d mean loss and the gradients of the
        loss with respect to ``hidden`` and ``weight``.
    """
    w = weight.detach().to(dtype).requires_grad_()
    n_valid = int((target != ignore_index).sum())
    loss = torch.zeros((), dtype=dtype, device=hidden.device)
    d_hidden = torch.empty(hidden.shape, dtype=dtype, device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start:start + chunk].detach().to(dtype).requires_grad_()
        part = F.cross_entropy(h @ w.T, target[start:start + chunk], ignore_index=ignore_index,
                               reduction="sum")
        part = part / n_valid
        part.backward()
        loss += part.detach()
        d_hidden[start:start + chunk] = h.grad
    return loss, d_hidden, w.grad


# --------------------------------------------------------------------------------------------------
# ---- SwiGLU and RoPE ----
# --------------------------------------------------------------------------------------------------


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Llama's MLP activation as Hugging Face computes it: ``act_fn(gate_proj(x)) * up_proj(x)``.

    Chapter 11 checks the SwiGLU kernel against it.

    Args:
        gate, up: the two projections' outputs, of one shape (or broadcastable).

    Returns:
        ``silu(gate) * up``.
    """
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's ``rotate_half``: [x1, x2] → [−x2, x1] over the halves of the last dimension.

    Chapter 11 derives the rotary kernel from it.

    Args:
        x: ``[..., head_dim]``, ``head_dim`` even.

    Returns:
        A new tensor of ``x``'s shape.
    """
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb``: ``x·cos + rotate_half(x)·sin`` for q and k (chapter 11).

    Args:
        q, k: the queries and keys, e.g. ``[batch, heads, seq, head_dim]``.
        cos, sin: ``[batch, seq, head_dim]``, as ``rotary_cos_sin`` makes them.
        unsqueeze_dim: where cos and sin get the dimension that broadcasts over the heads.

    Returns:
        ``(q_rotated, k_rotated)``, new tensors.
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_cos_sin(
    batch: int, seq: int, head_dim: int, theta: float = 500_000.0, dtype: torch.dtype = torch.float32,
    device=None, positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin as Llama's rotary embedding makes them (default rope type; chapter 11).

    Angles position · θ^(−2i/head_dim) are computed in float32, each frequency used twice
    (``cat((f, f))``), then cast to ``dtype``.

    Args:
        batch, seq, head_dim: the shape to make; ``head_dim`` even.
        theta: the rotary base θ.
        dtype: the output dtype (in a model: the activations' dtype).
        device: where to make them (default: the CPU); ``positions``, if given, must be there too.
        positions: ``[batch, seq]`` position indices; default 0 … seq − 1 for every row.

    Returns:
        ``(cos, sin)``, each ``[batch, seq, head_dim]`` in ``dtype``.

    Raises:
        ValueError: when ``head_dim`` is odd.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if positions is None:
        positions = torch.arange(seq, device=device).expand(batch, seq)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


# --------------------------------------------------------------------------------------------------
# ---- AdamW ----
# --------------------------------------------------------------------------------------------------


def adamw_reference(
    param: torch.Tensor, grads: list[torch.Tensor], lr: float, betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8, weight_decay: float = 1e-2,
) -> torch.Tensor:
    """``param`` after one AdamW step per gradient in ``grads``, in float64 with exact moments.

    Decoupled weight decay, then the moments, then the bias-corrected update
    (``torch.optim.AdamW``'s algorithm, amsgrad off), starting from zero moments. The tests of
    ``kernels.adamw`` (an operator that chapter 09 lists) check it against this.

    Args:
        param: the parameter before the first step (left unchanged).
        grads: one gradient per step, each of ``param``'s shape.
        lr: the learning rate.
        betas: the moments' decay rates (β1, β2).
        eps: added to the bias-corrected root of the second moment.
        weight_decay: the decoupled decay, applied as ``p -= lr * weight_decay * p``.

    Returns:
        The parameter after ``len(grads)`` steps, float64, on ``param``'s device.
    """
    beta1, beta2 = betas
    p = param.double().clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p - lr * weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr / (1 - beta1**t) * m / (v.sqrt() / math.sqrt(1 - beta2**t) + eps)
    return p
