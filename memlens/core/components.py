"""The per-component split the Opacus profiler asks for (seeds/004): attention, MLP, embedding,
normalization and LoRA, by module-name patterns of the transformers families memlens builds.

A module's name (wrappers stripped: Opacus' ``_module``, peft's ``base_model.model``) is split on
dots and the first rule that matches a part wins, in this order:

1. ``lora``: a part starting with ``lora_`` (``lora_A``, ``lora_B``, ``lora_embedding_A`` ...);
2. ``norm``: a part containing ``norm`` (``input_layernorm``, ``LayerNorm``, ``norm``) or starting
   with ``ln_`` (GPT-2's ``ln_1``, ``ln_f``);
3. ``embedding``: a part containing ``embed`` (``embed_tokens``, ``embeddings``) or ``wte`` / ``wpe``;
4. ``head``: ``lm_head``, ``classifier``, ``score``, ``pooler``, ``cls``;
5. ``attention``: a part containing ``attn`` or ``attention`` (``self_attn``, ``attn.c_attn``),
   or named ``q_proj`` ``k_proj`` ``v_proj`` ``o_proj`` ``qkv`` ``query`` ``key`` ``value`` ``out_proj``;
6. ``mlp``: a part containing ``mlp``, ``ffn``, ``feed_forward``, ``intermediate`` or ``experts``,
   or named ``fc1`` ``fc2`` ``c_fc`` ``gate_proj`` ``up_proj`` ``down_proj`` ``w1`` ``w2`` ``w3``,
   or BERT's feed-forward ``layer.N.output``;
7. ``other``: the rest (the loss and glue code, the optimizer step, the batch).

>>> [component_of(n) for n in ("model.layers.0.self_attn.q_proj.lora_A.default", "model.layers.0.post_attention_layernorm",
...                            "model.embed_tokens", "h.3.attn.c_attn", "model.layers.2.mlp.down_proj", "lm_head",
...                            "encoder.layer.1.output.dense", "(optimizer)")]
['lora', 'norm', 'embedding', 'attention', 'mlp', 'head', 'mlp', 'other']
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any

COMPONENTS = ("attention", "mlp", "embedding", "norm", "lora", "head", "other")

_ATTN_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "qkv", "query", "key", "value", "out_proj"}
_MLP_NAMES = {"fc1", "fc2", "c_fc", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}
_HEAD_NAMES = {"lm_head", "classifier", "score", "pooler", "cls"}


def component_of(module: str) -> str:
    """The component a module (by name) belongs to (see the module docstring for the rules)."""
    parts = [p for p in module.split(".") if p]
    while parts[:1] == ["_module"] or parts[:2] == ["base_model", "model"]:
        parts = parts[1:] if parts[0] == "_module" else parts[2:]
    low = [p.lower() for p in parts]
    if any(p.startswith("lora_") for p in low):
        return "lora"
    if any("norm" in p or p.startswith("ln_") for p in low):
        return "norm"
    if any("embed" in p or p in ("wte", "wpe") for p in low):
        return "embedding"
    if any(p in _HEAD_NAMES for p in low):
        return "head"
    if any("attn" in p or "attention" in p or p in _ATTN_NAMES for p in low):
        return "attention"
    if any(any(k in p for k in ("mlp", "ffn", "feed_forward", "intermediate", "experts")) or p in _MLP_NAMES for p in low):
        return "mlp"
    for i in range(1, len(low)):
        if low[i] == "output" and low[i - 1].isdigit():   # BERT: layer.N.output (the feed-forward's second linear)
            return "mlp"
    return "other"


def by_component(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``by_module`` rows (module, bytes, by_category) summed per component, in :data:`COMPONENTS` order.

    >>> by_component([{"module": "h.0.attn.c_attn", "bytes": 10, "by_category": {"activations": 10}},
    ...               {"module": "h.0.mlp.c_fc", "bytes": 5, "by_category": {"parameters": 5}},
    ...               {"module": "h.1.attn.c_proj", "bytes": 1, "by_category": {"parameters": 1}}])[0]
    {'component': 'attention', 'bytes': 11, 'by_category': {'activations': 10, 'parameters': 1}}
    """
    acc: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for r in rows:
        c = component_of(r["module"])
        for cat, v in (r.get("by_category") or {}).items():
            acc[c][cat] += v
    return [{"component": c, "bytes": sum(acc[c].values()), "by_category": dict(acc[c])} for c in COMPONENTS if c in acc]
