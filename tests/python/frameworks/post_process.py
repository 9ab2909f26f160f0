"""An engine-style post-processing pass over a transformers BERT or GPT-2,
for the runtime-layout tests (run_layout.py): it changes names, shapes and
dtypes the way engines do after loading.

  - q/k/v fused: BERT's query, key and value Linear layers become one
    `attention.self.qkv` (GPT-2's c_attn holds them fused already);
  - every linear weight int8 with fp32 per-output-channel scales
    (QuantLinear: qweight, scale, bias), but GPT-2's lm_head, which is the
    tied input embedding; GPT-2's Conv1D weights keep their [in, out]
    storage, so their qweight is a transposed view with strides (1, out);
  - the position embedding transposed and made contiguous (weight_t).

post_process(model) does it in place. On a model whose parameters are on
the meta device it builds the same structure with meta parameters, for
weightd.torch.load_into to fill from the published layout.
"""
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D


def quantize(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in], fp32 [out]): symmetric per-output-channel quantization of `weight` [out, in]."""
    scale = weight.abs().amax(dim=1) / 127
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.float()


class QuantLinear(torch.nn.Module):
    """y = x (qweight * scale)^T + bias, qweight int8 [out, in], scale fp32 [out]."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], in_out_storage: bool = False) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if weight.is_meta:
            q = torch.empty((out_features, in_features), dtype=torch.int8, device="meta")
            scale = torch.empty((out_features,), dtype=torch.float32, device="meta")
        else:
            q, scale = quantize(weight.detach().float())
            if in_out_storage:  # stored [in, out] as the checkpoint's Conv1D was: a transposed view
                q = q.t().contiguous().t()
        self.qweight = torch.nn.Parameter(q, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach().clone() if not bias.is_meta else
                                                                 torch.empty_like(bias), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.qweight.float() * self.scale[:, None], self.bias)


class _Part(torch.nn.Module):
    """Output `index` of the fused q/k/v projection (no parameters of its own)."""

    def __init__(self, fused: QuantLinear, index: int, width: int) -> None:
        super().__init__()
        object.__setattr__(self, "fused", fused)  # not a submodule: the parameters live under `qkv` only
        self.index, self.width = index, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.index * self.width:(self.index + 1) * self.width]


class TransposedEmbedding(torch.nn.Module):
    """An embedding whose table is stored transposed and contiguous: weight_t [dim, num]."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        table = torch.empty((weight.shape[1], weight.shape[0]), dtype=weight.dtype, device="meta") \
            if weight.is_meta else weight.detach().t().contiguous()
        self.weight_t = torch.nn.Parameter(table, requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight_t.t())


def _fuse_bert_attention(attention: torch.nn.Module) -> None:
    parts = (attention.query, attention.key, attention.value)
    weight = torch.cat([p.weight for p in parts])
    bias = torch.cat([p.bias for p in parts])
    attention.qkv = QuantLinear(weight, bias)
    width = parts[0].weight.shape[0]
    attention.query, attention.key, attention.value = (_Part(attention.qkv, i, width) for i in range(3))


def post_process(model: torch.nn.Module) -> torch.nn.Module:
    """The pass described above, in place; returns `model`."""
    with torch.no_grad():
        for module in list(model.modules()):
            if all(hasattr(module, n) for n in ("query", "key", "value")):
                _fuse_bert_attention(module)
        for path, module in list(model.named_modules()):
            for attr, child in list(module.named_children()):
                name = f"{path}.{attr}" if path else attr
                if isinstance(child, Conv1D):  # weight [in, out]
                    setattr(module, attr, QuantLinear(child.weight.t(), child.bias, in_out_storage=True))
                elif isinstance(child, torch.nn.Linear) and name != "lm_head":
                    setattr(module, attr, QuantLinear(child.weight, child.bias))
                elif isinstance(child, torch.nn.Embedding) and attr in ("position_embeddings", "wpe"):
                    setattr(module, attr, TransposedEmbedding(child.weight))
    return model
