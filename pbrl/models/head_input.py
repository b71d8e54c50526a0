"""The LM head's input made contiguous where PyTorch's CPU matmul would copy the head once per row.

A causal LM asked for the last position's logits only (``logits_to_keep=1``: every prefill of sampling, and the
prompt pass of :func:`pbrl.learning.logprobs.shared_prompt_logprobs`) hands its head a strided view,
``hidden_states[:, -1:, :]`` (b, 1, h). In bfloat16 and float16 on the CPU, torch 2.13's matmul then runs a batched
product that copies the broadcast head weight for every row (pytorch/pytorch#151934; a fix is proposed in
pytorch/pytorch#197851): for SmolLM2-135M's head (49,152 x 576) and 16 rows the product allocated 864 MiB and took
0.85 s against 1.5 MiB and 7 ms for the same rows contiguous (``benchmarks/head_input.py``), and this transient set
the peak memory of the demo's bfloat16 evaluation
(docs/results/benchmarks.md#the-lm-heads-strided-input-in-bfloat16). The same happens in training, where the prompt
pass of shared-prompt scoring asks for one position per distinct prompt. A contiguous copy of the (b, 1, h) input
is a few KiB. On CPUs with bfloat16 arithmetic (``avx512_bf16``, the CPUs where ``torch_dtype: auto`` picks
bfloat16) it gives the same logits bit for bit (tested); elsewhere, and in the gradient of the head's input, the two
products may round 1 ulp apart. float16 is included as torch's issue reports it too (on the CPU measured it did
not copy, and the contiguous input gave the same bits). float32 is left alone: its strided product costs no
memory, and a contiguous one rounds differently (up to 6e-5), which would change the tokens of runs sampled before.
A forward pre-hook, because the slicing happens inside transformers' ``forward`` of every causal LM.
"""

from __future__ import annotations

from typing import Any

import torch

_NARROW = (torch.bfloat16, torch.float16)  # the dtypes whose strided CPU product copies the weight per row


def _contiguous_input(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.is_contiguous() or x.dtype not in _NARROW or x.device.type != "cpu":
        return None
    return (x.contiguous(), *args[1:])


def contiguous_head_input(model: Any) -> Any:
    """Register on ``model``'s output embedding (its LM head) a pre-hook that makes a strided bfloat16/float16 CPU
    input contiguous (see the module docstring); every other input passes untouched. Returns ``model``; a model
    without an output embedding is returned as it is. Registering twice registers once. Raises nothing of its own
    (``model`` must have transformers' ``get_output_embeddings``)."""
    head = model.get_output_embeddings()
    if head is not None and not has_contiguous_head_input(model):
        head.register_forward_pre_hook(_contiguous_input)
    return model


def has_contiguous_head_input(model: Any) -> bool:
    """Whether ``model``'s output embedding has the pre-hook of :func:`contiguous_head_input` (False without one)."""
    head = model.get_output_embeddings()
    return head is not None and _contiguous_input in head._forward_pre_hooks.values()
