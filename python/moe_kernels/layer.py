"""FusedMoE: an nn.Module that holds prepared expert weights and runs the fused forward."""
from __future__ import annotations

import torch

from . import api, quant4
from .modes import Activation
from .prepare import prepare_weights
from .problem import check_alignment, parse_quant, require_built


class FusedMoE(torch.nn.Module):
    """A mixture-of-experts layer (the experts only; routing is the caller's).

    With expert parallelism, each rank builds FusedMoE(..., ep_rank=r, ep_size=n) and holds
    num_experts // ep_size experts; the caller sums the ranks' outputs. With tensor
    parallelism, pass weights already sliced along the intermediate dimension.
    routed_scaling_factor multiplies the output (DeepSeek-V3); apply_router_weight_on_input
    weights the input row instead of the output (Llama 4, top_k 1).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *,
                 quant="bf16", activation="swiglu", ep_rank: int = 0, ep_size: int = 1,
                 swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0, routed_scaling_factor=None,
                 apply_router_weight_on_input: bool = False, device=None):
        super().__init__()
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size),
                        ("intermediate_size", intermediate_size), ("ep_size", ep_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: got {v!r}, expected a positive int")
        if num_experts % ep_size:
            raise ValueError(f"num_experts: got {num_experts}, expected a multiple of ep_size={ep_size}")
        if not isinstance(ep_rank, int) or not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank: got {ep_rank!r}, expected 0 <= ep_rank < ep_size={ep_size}")
        self.num_experts = num_experts
        self.local_experts = num_experts // ep_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.quant = parse_quant(quant)
        require_built(self.quant)  # as fused_moe does: a mode without kernels fails here, not at first use
        check_alignment(self.quant.spec, hidden_size, intermediate_size, "hidden_size/intermediate_size")
        self.activation = Activation.parse(activation)
        self.ep_rank, self.ep_size = ep_rank, ep_size
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        self.routed_scaling_factor = routed_scaling_factor
        self.apply_router_weight_on_input = apply_router_weight_on_input
        self.device = torch.device(device) if device is not None else None
        self.weights = None

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.local_experts}, ep {self.ep_rank}/{self.ep_size}), "
                f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"quant={self.quant.value}, activation={self.activation.value}")

    def load_weights(self, w13, w2, w13_bias=None, w2_bias=None, w13_scale=None,
                     w2_scale=None, a13_scale=None, a2_scale=None, w13_zero=None, w2_zero=None) -> None:
        """Prepare and keep the expert weights: this rank's [E_local, ...] slice, or all
        [num_experts, ...] experts, from which this rank's slice is taken. FP8 modes also
        take the checkpoint's weight scales, and `fp8` static activation scales (one, or one
        per expert: the max over this rank's experts is used); 4-bit modes take their weights
        in the checkpoint packing [E, N, K/2] (repacked here, once) or already prepared; see
        moe_kernels.prepare.prepare_weights. Without device= the weights stay where they are
        (CPU weights are validated without a GPU); device='cuda' needs torch with CUDA."""
        if self.device is not None and self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"FusedMoE.load_weights: device={str(self.device)!r} needs a CUDA GPU and torch "
                               "sees none (torch.cuda.is_available() is False); build the layer without "
                               "device= (or with device='cpu') to validate the weights where they are")
        if isinstance(w13, torch.Tensor) and w13.dim() in (3, 4) and self.ep_size > 1 and \
                w13.shape[0] == self.num_experts:
            lo, hi = self.ep_rank * self.local_experts, (self.ep_rank + 1) * self.local_experts
            w13, w2, w13_bias, w2_bias, w13_scale, w2_scale, w13_zero, w2_zero = (
                None if t is None else t[lo:hi]
                for t in (w13, w2, w13_bias, w2_bias, w13_scale, w2_scale, w13_zero, w2_zero))
            a13_scale, a2_scale = (t[lo:hi] if isinstance(t, torch.Tensor) and t.numel() == self.num_experts
                                   else t for t in (a13_scale, a2_scale))
        n1 = self.intermediate_size * (2 if self.activation.gated else 1)
        fmt = self.quant.spec.weight_format
        if fmt.fragment_layout and quant4.is_prepared(w13):  # prepared already (4-D)
            expect = quant4.prepared_shape(self.local_experts, n1, self.hidden_size)
        else:
            expect = (self.local_experts, n1, self.hidden_size // fmt.per_byte)
        if not isinstance(w13, torch.Tensor) or tuple(w13.shape) != expect:
            raise ValueError(f"w13: got shape {tuple(getattr(w13, 'shape', ()))}, expected {expect} "
                             f"(or {(self.num_experts,) + expect[1:]} for all experts)")
        self.weights = prepare_weights(w13, w2, quant=self.quant, activation=self.activation,
                                       w13_bias=w13_bias, w2_bias=w2_bias, w13_scale=w13_scale,
                                       w2_scale=w2_scale, a13_scale=a13_scale,
                                       a2_scale=a2_scale, w13_zero=w13_zero, w2_zero=w2_zero,
                                       device=self.device)

    def workspace_size(self, max_num_tokens: int, top_k: int) -> int:
        """Bytes of `workspace=` that serve every forward of up to max_num_tokens tokens."""
        self._require_weights()
        device = self.weights["w13"].device
        if device.type != "cuda":
            raise RuntimeError(f"FusedMoE.workspace_size: the weights are on {device}, and a workspace is sized "
                               "for the GPU that runs the layer: load CUDA weights, or build the layer with "
                               "device='cuda'")
        return api.workspace_size(max_num_tokens, top_k, self.local_experts, self.hidden_size,
                                  self.intermediate_size, quant=self.quant,
                                  activation=self.activation, device=device)

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, *, workspace=None, out=None, tactic=None) -> torch.Tensor:
        self._require_weights()
        w = self.weights
        return api.fused_moe(hidden_states, w["w13"], w["w2"], topk_weights, topk_ids,
                             quant=self.quant, activation=self.activation, w13_bias=w["w13_bias"],
                             w2_bias=w["w2_bias"], ep_rank=self.ep_rank, ep_size=self.ep_size,
                             num_experts=self.num_experts, swiglu_alpha=self.swiglu_alpha,
                             swiglu_limit=self.swiglu_limit, w13_scale=w.get("w13_scale"),
                             w2_scale=w.get("w2_scale"), a13_scale=w.get("a13_scale"),
                             a2_scale=w.get("a2_scale"), w13_zero=w.get("w13_zero"),
                             w2_zero=w.get("w2_zero"), routed_scaling_factor=self.routed_scaling_factor,
                             apply_router_weight_on_input=self.apply_router_weight_on_input,
                             workspace=workspace, out=out, tactic=tactic)

    def _require_weights(self):
        if self.weights is None:
            raise RuntimeError("FusedMoE: call load_weights(w13, w2, ...) before using the layer")
