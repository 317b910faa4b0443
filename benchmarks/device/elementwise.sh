#!/usr/bin/env bash
# The elementwise kernels of one long sequence (issue 37's 3,000-token line), in one call on the
# GPU machine (bounds add to 540 s): the GPU tests of the attention's gate kernel
# (`kernels.gated`), of the vision tower's split and rotation (`kernels.split_rotate`) and the
# tower against Hugging Face's, of the bucket graphs (every bucket captures: none compiles a
# kernel variant inside a capture) and of no compile on a request after load; where a 3,000-token
# request's device time goes (`long_row_profile`: the gate's one kernel where a sigmoid and a
# product were); then the convolution's, SwiGLU's and the gate's launch settings at 1,500 and 3,000
# tokens (`elementwise_sweep`), each beside the runtime's. Results in $OUT:
#   bash benchmarks/device/elementwise.sh
set -u
cd "$(dirname "$0")/../.."
. benchmarks/device/setup.sh
gpu_tests 300 "packed_projection or split_rotate or no_request_compiles or vision or bucket" -m gpu \
  tests/ops/test_kernels.py tests/runtime/test_engine.py tests/model/test_vision.py tests/runtime/test_vision_graphs.py \
  tests/runtime/test_cuda_graphs.py
run 120 long-row long_row_profile --lengths 3000 --top 22 --firsts 4
run 120 sweep elementwise_sweep --lengths 1500 3000
stamp "done"
