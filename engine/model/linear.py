"""Linear layers whose GEMM backend is chosen per weight shape and per number of tokens.

``y = x @ weight.T + bias`` exactly as ``torch.nn.Linear``. A CPU model's layers can run their
GEMM through one of several backends (:data:`BACKENDS`), each with the weight prepared once in
the layout it reads fastest:

- ``onednn``: oneDNN's inner product (``torch.ops.mkldnn._linear_pointwise``) on a weight
  reordered once into oneDNN's blocked layout (``_reorder_linear_weight``). oneDNN keeps one
  primitive per input shape in its own LRU cache, so a given M is planned once. Float32 and
  bfloat16 (AVX512-BF16 / AMX kernels where the CPU has them).
- ``mkl``: MKL's packed sgemm (``cblas_sgemm_pack``), float32 only.
- ``torch``: plain ``F.linear`` (any dtype, any device).

Which backend is fastest depends on the CPU, the weight's shape and M (the tokens in the step):
on a 2-core AMD EPYC (Zen 4) oneDNN ran the 49152 x 576 LM head 2-4x faster than MKL at every M
while on other CPUs MKL's packed GEMM can win at some M. :mod:`engine.model.linear_chooser`
measures the candidates on the model's real shapes and gives every layer a *plan*: one backend
per M bucket (:func:`m_bucket`). An unplanned layer behaves exactly like ``nn.Linear``.

Under ``torch.compile`` a planned layer is the opaque custom op ``tandem::planned_linear`` (the
dispatch by M happens inside it at run time, so one graph serves every M).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import LINEAR_BACKEND_CHOICES

BACKENDS = LINEAR_BACKEND_CHOICES[1:]  # ("onednn", "mkl", "torch"): planned_linear's argument order
# The M (tokens) MKL tunes its packed layout for; any M is correct with it.
_MKL_BATCH_HINT = 16


def m_bucket(num_tokens: int) -> int:
    """Index of the M bucket of ``num_tokens`` (>= 1): bucket b holds M in (2^(b-1), 2^b], so
    bucket 0 is M = 1, bucket 1 is M = 2, bucket 2 is M = 3..4, bucket 4 is M = 9..16, ..."""
    return (num_tokens - 1).bit_length()


def bucket_m(bucket: int) -> int:
    """The largest M of ``bucket`` (the M the chooser times it at)."""
    return 1 << bucket


def backend_supports(backend: str, weight: torch.Tensor) -> bool:
    """Whether ``backend`` can run GEMMs with ``weight`` [out, in] (its device and dtype)."""
    if backend == "torch":
        return True
    if weight.device.type != "cpu":
        return False
    if backend == "mkl":
        return weight.dtype == torch.float32 and torch.backends.mkl.is_available()
    if backend == "onednn":
        return weight.dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
    raise ValueError(f"linear backend must be one of {BACKENDS}, got {backend!r}")


def prepare_weight(backend: str, weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [out, in] in ``backend``'s layout (None: the backend reads it as it is)."""
    weight = weight.detach()
    if backend == "mkl":
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, _MKL_BATCH_HINT)
    if backend == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return None


def run_backend(backend: str, x: torch.Tensor, prepared: torch.Tensor | None, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` [M, in] through ``backend`` with its prepared weight -> [M, out], x's dtype."""
    if backend == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, prepared, bias, "none", [], "")
    if backend == "mkl":
        return torch.ops.mkl._mkl_linear(x, prepared, weight, bias, _MKL_BATCH_HINT)
    return F.linear(x, weight, bias)


class Linear(nn.Module):
    """``nn.Linear``'s parameters (``weight`` [out, in], ``bias`` [out] or None) and result.

    ``forward(x [num_tokens, in]) -> [num_tokens, out]``, x's dtype. After :meth:`set_plan`, a
    2-D input of the weight's dtype runs through the backend its M bucket names.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None
        # plan[b]: index into BACKENDS of M bucket b's backend; M past the last bucket uses it.
        self.plan: tuple[int, ...] | None = None
        # prepared[i]: BACKENDS[i]'s copy of the weight (plain tensors, not parameters).
        self.prepared: list[torch.Tensor | None] = [None] * len(BACKENDS)

    def set_plan(self, plan: tuple[str, ...], weight: torch.Tensor | None = None) -> None:
        """Runs M bucket ``b`` through backend ``plan[b]``, preparing ``weight`` (default: this
        layer's; the tied LM head passes the embedding's) once for every backend named. Mutates
        this layer.

        Raises:
            ValueError: an unknown backend, or one that cannot run this weight's dtype/device.
        """
        weight = (self.weight if weight is None else weight).detach()
        prepared: list[torch.Tensor | None] = [None] * len(BACKENDS)
        for name in set(plan):
            if name not in BACKENDS or not backend_supports(name, weight):
                raise ValueError(f"linear backend {name!r} cannot run a {weight.dtype} weight on {weight.device}")
            prepared[BACKENDS.index(name)] = prepare_weight(name, weight)
        self._source = weight  # the weight the plan was prepared from (MKL reads its shape)
        self.prepared = prepared
        self.plan = tuple(BACKENDS.index(name) for name in plan)

    def clear_plan(self) -> None:
        """Back to plain ``F.linear``; frees the prepared copies. Mutates this layer."""
        self.plan, self.prepared = None, [None] * len(BACKENDS)

    def backend_for(self, num_tokens: int) -> str:
        """The backend an input of ``num_tokens`` rows runs through."""
        if self.plan is None:
            return "torch"
        return BACKENDS[self.plan[min(m_bucket(num_tokens), len(self.plan) - 1)]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan is None or x.dim() != 2 or x.dtype != self._source.dtype:
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return planned_linear(x, self._source, self.bias, self.prepared[0], self.prepared[1], list(self.plan))
        code = self.plan[min(m_bucket(x.shape[0]), len(self.plan) - 1)]
        return run_backend(BACKENDS[code], x, self.prepared[code], self._source, self.bias)

    def extra_repr(self) -> str:
        plan = "none" if self.plan is None else ",".join(BACKENDS[c] for c in self.plan)
        return f"in={self.in_features}, out={self.out_features}, bias={self.bias is not None}, plan={plan}"


@torch.library.custom_op("tandem::planned_linear", mutates_args=())
def planned_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   onednn_weight: torch.Tensor | None, mkl_weight: torch.Tensor | None,
                   plan: list[int]) -> torch.Tensor:
    """A planned :class:`Linear` as one opaque op for ``torch.compile``: x [M, in] -> [M, out]."""
    code = plan[min(m_bucket(x.shape[0]), len(plan) - 1)]
    prepared = (onednn_weight, mkl_weight, None)[code]
    return run_backend(BACKENDS[code], x, prepared, weight, bias)


@planned_linear.register_fake
def _(x, weight, bias, onednn_weight, mkl_weight, plan):
    return x.new_empty(x.shape[0], weight.shape[0])


def planned_layers(model: nn.Module) -> list[Linear]:
    """Every :class:`Linear` of ``model``, in module order."""
    return [module for module in model.modules() if isinstance(module, Linear)]
