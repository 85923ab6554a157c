"""Tensor parallelism inside one worker: N rank processes run one model (Megatron-LM's sharding).

- :mod:`engine.parallel.layout`: which attention heads, MLP columns and vocabulary rows each rank
  owns (plain ints);
- :mod:`engine.parallel.group`: the process group (NCCL on CUDA, gloo on the CPU) and the
  control channel rank 0 sends each step on;
- :mod:`engine.parallel.layers`: shards a loaded Llama in place (column-parallel ``qkv_proj`` and
  ``gate_up_proj``, row-parallel ``o_proj`` and ``down_proj`` with an all-reduce,
  vocabulary-parallel ``lm_head``, replicated embedding);
- :mod:`engine.parallel.runner`: rank 0's ModelRunner, which sends every step to the others,
  and the other ranks' execute-only loop;
- :mod:`engine.parallel.launch`: starts the ranks and takes the worker down when one dies.

Tensor-parallel size 1 uses none of this: the engine builds the plain ModelRunner.
"""
