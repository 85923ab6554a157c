"""The compiled forward: each decoder layer through ``torch.compile`` (inductor).

One graph serves all layers (the layer's weights and KV cache are graph inputs, not constants),
so compiling costs one layer's worth, ~5-10 s here on the first start and less once inductor's
on-disk cache holds it, instead of a whole unrolled model. Inductor fuses what runs between the
GEMMs (RMSNorm, rotary embedding, SiLU x up, residual adds) into a few C++ loops; the GEMMs stay
MKL's packed ones (:func:`engine.model.linear.packed_linear`) and attention stays the backend's
(:func:`engine.attention.paged_attention`), both opaque custom ops.

Shapes are dynamic in the number of tokens; torch specialises 1 token apart from the rest, so
there are two graphs: :func:`warm_up` compiles both before the first request.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

log = logging.getLogger(__name__)


def compile_layers(model: nn.Module) -> None:
    """Replaces every decoder layer's ``forward`` of ``model`` (a LlamaForCausalLM) by its
    compiled form. Mutates the model; compilation itself happens on the first call."""
    # The layer index is an int attribute: without this, torch would compile one graph per layer.
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    model.model.fused_decode_layers = False  # the compiled layers run every pass, decode too
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True, fullgraph=True)


def warm_up(run_forward, num_tokens_list=(1, 2)) -> float:
    """Calls ``run_forward(num_tokens)`` for each size so every graph is compiled before serving;
    logs what it compiles and how long it took. Returns seconds."""
    log.info("compiling the model forward (torch.compile, inductor; first start ~10 s, cached "
             "afterwards) ...")
    started = time.perf_counter()
    for num_tokens in num_tokens_list:
        run_forward(num_tokens)
    took_s = time.perf_counter() - started
    log.info("compiled the model forward in %.1f s", took_s)
    return took_s
