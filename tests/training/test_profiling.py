"""The profiler breakdown: names -> families, region and autograd attribution, a real profiled step, Amdahl, plots."""

import json
from collections import namedtuple
from types import SimpleNamespace

import matplotlib
import pytest
import torch
from torch.autograd import DeviceType

from kernels import runtime
from kernels.training.data import get_tokenizer, make_sft_batches
from kernels.training.models import build_model, full_finetune_memory, llama_config
from kernels.training.profiling import (
    FAMILIES,
    amdahl,
    attribute_events,
    classify,
    plot_family_times,
    plot_memory,
    profile_training_step,
    short_name,
)

matplotlib.use("Agg")

# Real names: CPU aten operators, autograd nodes, and CUDA kernels as the profiler reports them (demangled).
NAMES = {
    "matmul": [
        "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul",
        "autograd::engine::evaluate_function: MmBackward0",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_64x3_tn",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1_execute_segment_k_off_kernel__5x_cublas",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_TNT",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8>(cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_32x32_128x1_tn_align8::Params)",
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(cublasSplitKParams<float>, float const*)",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 2, 2, false, false>(float)",
    ],
    "attention": [
        "aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_efficient_attention", "aten::_efficient_attention_backward",
        "aten::_flash_attention_forward",
        "autograd::engine::evaluate_function: ScaledDotProductEfficientAttentionBackward0",
        "fmha_cutlassF_bf16_aligned_64x128_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t, cutlass::arch::Sm80, true, 64, 128, 128, true, true>::Params)",
        "fmha_cutlassB_bf16_aligned_64x64_k128_sm80(PyTorchMemEffAttention::AttentionBackwardKernel<cutlass::arch::Sm80, cutlass::bfloat16_t, true, false, true, 64, 64, 128, false>::Params)",
        "void pytorch_flash::flash_fwd_kernel<pytorch_flash::Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>, false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<pytorch_flash::Flash_bwd_kernel_traits<128, 64, 128, 8>, true, false, false, false, false, false>(pytorch_flash::Flash_bwd_params)",
        "flash_fwd_kernel",
        "cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0",
    ],
    "rmsnorm": [
        "aten::pow", "aten::mean", "aten::rsqrt", "region::rmsnorm",
        "autograd::engine::evaluate_function: PowBackward0", "autograd::engine::evaluate_function: RsqrtBackward0",
        "autograd::engine::evaluate_function: MeanBackward1",
        "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >(int, std::array<char*, 2ul>)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::pow_tensor_scalar_kernel_impl<float, float>(at::TensorIteratorBase&, float)::{lambda(float)#2}, std::array<char*, 2ul> >(int, std::array<char*, 2ul>)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, float>, unsigned int, float, 4, 4>)",
        "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "RMSNormFunctionBackward", "_rms_norm_forward_kernel",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
    ],
    "cross_entropy": [
        "aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax", "aten::nll_loss_forward",
        "aten::_log_softmax_backward_data", "aten::nll_loss_backward", "region::loss",
        "autograd::engine::evaluate_function: NllLossBackward0", "autograd::engine::evaluate_function: LogSoftmaxBackward0",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<8, float, float, float, at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxBackward<8, float, float, float, at::native::(anonymous namespace)::LogSoftMaxBackwardEpilogue>(float*, float const*, float const*, long)",
        "cunn_SoftMaxForward",
        "void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(float*, float*, float const*, long const*, float const*, bool, long, long, long, long)",
        "void at::native::(anonymous namespace)::nll_loss_backward_reduce_cuda_kernel_2d<float, long>(float*, float const*, long const*, float const*, float const*, bool, int, int, long, long)",
        "liger_cross_entropy_kernel",
    ],
    "elementwise": [
        "aten::mul", "aten::add", "aten::silu", "aten::cat", "aten::neg", "aten::copy_", "aten::_to_copy", "aten::sum",
        "autograd::engine::evaluate_function: SiluBackward0", "autograd::engine::evaluate_function: MulBackward0",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul> >(int, at::native::CUDAFunctor_add<c10::BFloat16>, std::array<char*, 3ul>)",
        "void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel(at::TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int, std::array<char*, 2ul>)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)",
        "void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::BinaryFunctor<float, float, float, at::native::binary_internal::MulFunctor<float> > >(at::TensorIteratorBase&)::{lambda(int)#1}>(int)",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float, at::native::sum_functor<c10::BFloat16, float, float>::operator()(at::TensorIterator&)::{lambda(float, float)#1}>, unsigned int, float, 4, 4> >(int)",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>, unsigned int, 4, 64, 64>(int)",
        "Memcpy DtoD (Device -> Device)", "Memset (Device)",
    ],
    "optimizer": [
        "Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad", "aten::_foreach_lerp_",
        "aten::_foreach_addcdiv_", "aten::_foreach_sqrt", "aten::_fused_adamw_", "region::optimizer",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<2>, at::native::(anonymous namespace)::BinaryOpListAlphaFunctor<c10::BFloat16, 2, 2, 0>, std::plus<float>, float>(at::native::(anonymous namespace)::TensorListMetadata<2>)",
        "at::native::(anonymous namespace)::multi_tensor_apply_kernel",
        "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<c10::BFloat16, 4, (at::native::ADAM_MODE)1, false>, double*, double, double>(int)",
    ],
    "other": [
        "aten::embedding", "aten::embedding_dense_backward", "aten::view", "aten::empty", "aten::t", "aten::transpose",
        "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad",
        "autograd::engine::evaluate_function: EmbeddingBackward0",
        "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(int)",
        "void at::native::(anonymous namespace)::embedding_backward_feature_kernel<c10::BFloat16, float, long>(long const*)",
    ],
}


@pytest.mark.parametrize("family", sorted(NAMES))
def test_classify_real_names(family):
    wrong = {name: classify(name) for name in NAMES[family] if classify(name) != family}
    assert not wrong, f"expected {family}: {wrong}"


def test_classify_rejects_non_strings_and_short_name_drops_arguments():
    with pytest.raises(TypeError, match="name must be a str"):
        classify(None)
    long = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, std::array<char*, 3ul>)"
    assert short_name(long, 200) == "at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >"
    assert len(short_name(long, 30)) == 30


# ---------------------------------------------------------------------------------------------------------------
# Attribution on a hand-built GPU-style event tree: regions, autograd sequence numbers, unlinked device work
# ---------------------------------------------------------------------------------------------------------------

Kernel = namedtuple("Kernel", "name device duration")


def cpu_event(name, children=(), kernels=(), seq=-1, thread=1, fwd_thread=0):
    event = SimpleNamespace(
        name=name, device_type=DeviceType.CPU, is_async=False, cpu_parent=None, cpu_children=list(children),
        kernels=[Kernel(k, 0, us) for k, us in kernels], sequence_nr=seq, thread=thread, fwd_thread=fwd_thread,
        self_cpu_time_total=1.0,
    )
    for child in event.cpu_children:
        child.cpu_parent = event
    return event


def flatten(events):
    for e in events:
        yield e
        yield from flatten(e.cpu_children)


def device_events(cpu_events, extra):
    kernels = [k for e in cpu_events for k in e.kernels] + [Kernel("some_unlinked_kernel", 0, us) for us in extra]
    return [
        SimpleNamespace(name=k.name, device_type=DeviceType.CUDA, is_async=False, time_range=SimpleNamespace(start=0, end=k.duration))
        for k in kernels
    ]


MUL = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, MulFunctor<float> > >(int)"
POW = "void at::native::vectorized_elementwise_kernel<4, at::native::pow_tensor_scalar_kernel_impl<float, float> >(int)"


def test_attribution_follows_regions_and_autograd_sequence_numbers():
    roots = [
        cpu_event("region::rmsnorm", [
            cpu_event("aten::pow", kernels=[(POW, 10)], seq=5),
            cpu_event("aten::mul", kernels=[(MUL, 7)], seq=6),
        ]),
        cpu_event("aten::mul", kernels=[(MUL, 3)], seq=7),  # a mul outside RMSNorm (SwiGLU, say)
        cpu_event("aten::linear", [cpu_event("aten::mm", kernels=[("nvjet_tst_128x256_64x4_2x1_v_bz_TNN", 50)])], seq=8),
        cpu_event("region::loss", [cpu_event("aten::_log_softmax", kernels=[("cunn_SoftMaxForward<LogSoftMaxForwardEpilogue>", 20)], seq=9)]),
        # The backward pass, on the autograd engine's thread (2), names the forward thread (1) and sequence number.
        cpu_event("autograd::engine::evaluate_function: MulBackward0", [
            cpu_event("MulBackward0", [cpu_event("aten::mul", kernels=[(MUL, 8)], thread=2)], thread=2),
        ], seq=6, thread=2, fwd_thread=1),
        cpu_event("autograd::engine::evaluate_function: MulBackward0", [
            cpu_event("aten::mul", kernels=[(MUL, 4)], thread=2),
        ], seq=7, thread=2, fwd_thread=1),
        cpu_event("autograd::engine::evaluate_function: MulBackward0", [  # same number, other forward thread
            cpu_event("aten::mul", kernels=[(MUL, 2)], thread=2),
        ], seq=6, thread=2, fwd_thread=3),
        cpu_event("autograd::engine::evaluate_function: LogSoftmaxBackward0", [
            cpu_event("aten::_log_softmax_backward_data", kernels=[("cunn_SoftMaxBackward<LogSoftMaxBackwardEpilogue>", 15)], thread=2),
        ], seq=9, thread=2, fwd_thread=1),
        cpu_event("region::optimizer", [cpu_event("Optimizer.step#AdamW.step", [
            cpu_event("aten::_foreach_lerp_", kernels=[("multi_tensor_apply_kernel<TensorListMetadata<2>>", 30)]),
        ])]),
    ]
    events = list(flatten(roots))
    events += device_events(events, extra=[5])
    # What a GPU profile also holds (seen on an H200): a CUPTI "Command Buffer Full" record that carries other
    # operators' kernels, and the device-side span of a range, which covers kernels already counted.
    events.append(cpu_event("Command Buffer Full", kernels=[("multi_tensor_apply_kernel<TensorListMetadata<2>>", 900)]))
    events.append(SimpleNamespace(name="Optimizer.step#AdamW.step", device_type=DeviceType.CUDA, is_async=False,
                                  time_range=SimpleNamespace(start=0, end=400)))
    families, ops, kernels, phases, total = attribute_events(events, use_device=True)
    times = {f: t.us for f, t in families.items()}
    assert times == {"rmsnorm": 25, "elementwise": 9, "matmul": 50, "cross_entropy": 35, "optimizer": 30, "other": 5}
    assert total == 154
    assert phases == {"forward": 90, "backward": 29, "optimizer": 30}
    assert families["rmsnorm"].calls == 3 and families["elementwise"].calls == 3  # kernel launches
    assert kernels[(MUL, "rmsnorm")].us == 15 and kernels[(MUL, "elementwise")].us == 9


# ---------------------------------------------------------------------------------------------------------------
# A real profiled step of the tiny model
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_setup():
    model = build_model(llama_config("tiny", num_hidden_layers=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_sft_batches(get_tokenizer(), 2, 64, 1, vocab_size=model.config.vocab_size)[0]
    return model, optimizer, batch


@pytest.fixture(scope="module")
def tiny_profile(tiny_setup, tmp_path_factory):
    model, optimizer, batch = tiny_setup
    path = tmp_path_factory.mktemp("traces") / "step.json"
    return profile_training_step(model, batch, optimizer, warmup=1, timed_steps=1, trace_path=path, top=None)


def test_profiled_step_has_every_family_and_a_trace(tiny_profile):
    p = tiny_profile
    for family in ("matmul", "attention", "rmsnorm", "cross_entropy", "elementwise", "optimizer"):
        assert p.families[family].time_ms > 0 and p.families[family].calls > 0, family
    assert set(p.families) <= set(FAMILIES)
    assert abs(sum(r.share for r in p.families.values()) - 1) < 1e-9
    assert p.phases["backward"] > 0 and p.phases["forward"] > 0 and p.phases["optimizer"] > 0
    assert p.step_ms > 0 and p.tokens == 128 and p.tokens_per_s > 0
    trace = json.loads(p.trace_path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"region::rmsnorm", "region::loss", "aten::mm"} <= names
    assert "ui.perfetto.dev" in p.trace_note
    assert "RMSNorm" in p.family_table() and f"total ({p.time_kind})" in p.family_table()
    assert p.time_kind == ("GPU kernel time" if runtime.MODE == "gpu" else "CPU self time")
    assert len(p.top_table(10).splitlines()) == 11
    assert "tokens/s" in p.summary()


def test_backward_of_rmsnorm_and_loss_is_attributed_to_them(tiny_setup, tiny_profile):
    model, _, _ = tiny_setup
    rows = {(r.name, r.family): r for r in tiny_profile.top_ops}
    # Forward: 2 multiplies per RMSNorm call, 2 norms per layer and the final one. More means its backward counted.
    n_norms = 2 * model.config.num_hidden_layers + 1
    assert rows[("aten::mul", "rmsnorm")].calls > 2 * n_norms
    assert ("aten::mul", "elementwise") in rows  # SwiGLU's and RoPE's multiplies stay elementwise
    assert ("aten::copy_", "cross_entropy") in rows  # the fp32 upcast of the logits
    assert ("aten::_log_softmax_backward_data", "cross_entropy") in rows
    if runtime.MODE != "gpu":  # on the CPU the autograd nodes' own time shows up too
        assert ("autograd::engine::evaluate_function: ToCopyBackward0", "rmsnorm") in rows
        assert ("autograd::engine::evaluate_function: NllLossBackward0", "cross_entropy") in rows


def test_labels_are_removed_after_profiling(tiny_setup, tiny_profile):
    model, _, _ = tiny_setup
    assert "_loss_function" not in model.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_without_labels_names_still_find_rmsnorm_pieces(tiny_setup):
    model, optimizer, batch = tiny_setup
    p = profile_training_step(model, batch, optimizer, warmup=1, timed_steps=1, trace_path=None, label_regions=False)
    assert p.families["rmsnorm"].time_ms > 0 and p.trace_path is None
    assert p.families["cross_entropy"].time_ms > 0


def test_a_peft_model_is_profiled_with_its_loss_labelled(tmp_path):
    """The profiler takes a PEFT LoRA model as it takes the Llama inside: the loss region goes to the Hugging Face
    model that calls it (an attribute set on the wrapper would never be read), and nothing is left behind."""
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements.txt)")
    model = peft.get_peft_model(build_model(llama_config("tiny", num_hidden_layers=1)),
                                peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    batch = make_sft_batches(get_tokenizer(), 2, 32, 1, vocab_size=model.config.vocab_size)[0]
    p = profile_training_step(model, batch, optimizer, warmup=1, timed_steps=1, trace_path=tmp_path / "peft.json")
    names = {e.get("name") for e in json.loads(p.trace_path.read_text())["traceEvents"]}
    assert {"region::rmsnorm", "region::loss"} <= names
    assert p.families["cross_entropy"].time_ms > 0 and p.families["rmsnorm"].time_ms > 0
    assert not any(k in m.__dict__ for m in model.modules() for k in ("_loss_function", "loss_function", "forward"))


def test_cpu_memory_is_the_computed_estimate(tiny_setup, tiny_profile):
    if runtime.MODE == "gpu":
        pytest.skip("on a GPU the memory is measured (see the gpu test)")
    model, _, batch = tiny_setup
    assert not tiny_profile.memory.measured
    assert tiny_profile.memory.peak == full_finetune_memory(model.config, 2, 64).peak
    assert "nothing here is measured" in tiny_profile.memory.notes["activations"]


def test_amdahl_bound(tiny_profile):
    est = amdahl(tiny_profile)
    share = tiny_profile.families["rmsnorm"].share + tiny_profile.families["cross_entropy"].share
    assert est.share == pytest.approx(share)
    assert est.max_speedup == pytest.approx(1 / (1 - share))
    assert est.best_step_ms == pytest.approx(tiny_profile.step_ms * (1 - share))
    assert est.loss_bytes == 128 * 2048 * 12
    assert "Amdahl" in est.summary()
    with pytest.raises(ValueError, match="targets"):
        amdahl(tiny_profile, targets=("softmax",))


def test_plots_draw(tiny_profile):
    ax = plot_family_times(tiny_profile)
    assert len(ax.patches) == len(tiny_profile.families)
    ax = plot_memory(tiny_profile.memory)
    assert len(ax.patches) == 15  # 6 parts at the loss's forward, 5 at its backward, 4 at the optimizer step


def test_bad_arguments(tiny_setup):
    model, optimizer, batch = tiny_setup
    with pytest.raises(ValueError, match="warmup"):
        profile_training_step(model, batch, optimizer, warmup=0)
    with pytest.raises(TypeError, match="optimizer"):
        profile_training_step(model, batch, "adamw")
    with pytest.raises(ValueError, match="labels"):
        profile_training_step(model, {"input_ids": batch["input_ids"]}, optimizer)


@pytest.mark.gpu
def test_gpu_profile_measures_memory_and_links_kernels():
    config = llama_config("tiny", vocab_size=32768)
    model = build_model(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = make_sft_batches(get_tokenizer(), 2, 512, 1)[0]
    p = profile_training_step(model, batch, optimizer, trace_path=None, top=None)
    for family in ("matmul", "attention", "rmsnorm", "cross_entropy", "elementwise", "optimizer"):
        assert p.families[family].time_ms > 0, family
    # Nearly every kernel is linked to the operator that launched it.
    assert p.families.get("other") is None or p.families["other"].share < 0.15
    # RMSNorm's elementwise kernels are recognised through the region, not only pow/mean/rsqrt by name.
    assert any(r.family == "rmsnorm" and "elementwise" in r.name for r in p.top_kernels)
    m, est = p.memory, full_finetune_memory(config, 2, 512)
    n = sum(q.numel() for q in model.parameters())
    assert m.measured and m.weights == 2 * n and m.gradients == 2 * n
    # Two bf16 moments per parameter, plus AdamW's step counter: one float32 scalar per parameter tensor.
    n_tensors = sum(1 for _ in model.parameters())
    assert m.optimizer_states == 4 * n + 4 * n_tensors, (m.optimizer_states, 4 * n, n_tensors)
    assert 0.7 < m.activations / est.activations < 1.3, (m.activations, est.activations)
    assert 0.8 < m.measured_peak / est.peak < 1.3, (m.measured_peak, est.peak)
