"""What the checkpointing tests share: a model's loss and gradients, and a tiny Llama causal LM (4 layers)."""
from __future__ import annotations

import torch


def loss_and_grads(model, x):
    """(loss, gradients) of ``model(x).sum()`` after zeroing the gradients."""
    model.zero_grad()
    loss = model(x).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def tiny_llama():
    """A 4-layer Llama causal LM (hidden 32, GQA 4/2), in training mode, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).train()


def lm_loss_and_grads(model, ids):
    """(loss, gradients) of a causal LM's own loss on ``ids`` (labels = inputs)."""
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]
