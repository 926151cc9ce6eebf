"""What the tests share, by subject (tests/ is on sys.path: ``from support.checkpoints import ...``):

checkpoints.py  tiny random Qwen3 checkpoints, dense and MoE, and the test data's paths
scripted.py     checkpoints whose greedy output is written in advance, and the chains the server tests use
quantized.py    quantized checkpoints in their on-disk layouts (block FP8, AutoAWQ)
hybrid.py       the hybrid generation's checkpoints (Qwen3.5, Qwen3.5 MoE, Qwen3-Next) and their HF references
vision.py       image-capable checkpoints (Qwen3-VL, Qwen3.5 with its tower), the test images, the image processor
parity.py       greedy outputs and logprobs against transformers' models
server.py       a real `mili serve` process, its metrics, streams against it
engine_state.py what an engine holds once its requests end (``LLMEngine.stats()``, ``check_integrity()``), and the one
                way in to the engine's internals (``engine_core``, ``model_runner``, ``runner_parts``, raw logits)
graphs.py       CUDA graphs whose capture is an eager forward (``EagerGraphs``): the graph path without a GPU
fla_interpreter.py  flash-linear-attention's kernels under the Triton interpreter
devices.py      where the Triton kernel tests run (a GPU with MILI_TEST_GPU=1, else the interpreter)

tests/conftest.py builds each kind of checkpoint once per session (the ``*_checkpoint`` fixtures).

Tests go through the public surfaces: ``LLM``, ``LLMEngine`` (``stats()``, ``info``, ``plan``, ``apply_model``,
``check_integrity()``), the HTTP APIs, a kernel's Python wrapper. They reach into the engine only through
engine_state.py (``engine_core``, ``model_runner``), for what nothing public shows: page reference counts, the
encoder cache's occupancy, raw logits, the recurrent-state tensors, the tensor-parallel ranks' processes, and faults
injected into the sampler, drafter or scheduler. tests/unit/test_reach_ins.py holds the suite to at most 10 reach-ins
into private names or the engine's internals, each with its ``# reach-in: why``."""
