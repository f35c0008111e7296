"""Vision-language models' batches, as their processors and collators hand them to the model.

Four families (``family(config)``):

- ``llava`` (LLaVA-1.5 and the like): a fixed image size, ``image_seq_length`` placeholder tokens an
  image, counted inside ``--seq-len`` (the whole sequence).
- ``qwen-vl`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): dynamic resolution. The image processor resizes an
  S x S image to multiples of patch x merge pixels within [min_pixels, max_pixels] (transformers'
  ``qwen2_vl/image_processing_qwen2_vl.py`` ``smart_resize``), cuts it into patch x patch patches
  (``pixel_values``: one row of C x temporal_patch x patch x patch values a patch, an image repeated
  over the temporal patch), with ``image_grid_thw`` = (1, h/patch, w/patch); the model merges
  merge x merge patches into one token: (S/28)^2 image tokens for Qwen2.5-VL, between
  ``<|vision_start|>`` and ``<|vision_end|>``.
- ``gemma3`` (Gemma-3 multimodal): SigLIP at a fixed 896 px, pooled to ``mm_tokens_per_image`` (256)
  tokens between ``<start_of_image>`` and ``<end_of_image>``, with the processor's ``token_type_ids``
  (1 on image tokens: the bidirectional attention inside an image).
- ``mllama`` (Llama-3.2-Vision): one ``<|image|>`` token an image in the text; the image reaches the
  language model through cross-attention layers. The processor pads every image to ``max_num_tiles``
  tiles of ``image_size`` (560) px (``pixel_values`` B x images x tiles x C x 560 x 560) with
  ``aspect_ratio_ids``, ``aspect_ratio_mask`` and ``cross_attention_mask``.

For qwen-vl, gemma3 and mllama, ``--seq-len`` counts the text tokens (the markers around each image
included) and the image tokens come on top: the language model's sequence is their sum.

The index tensors of these batches (token ids, grids, masks) are what the model's Python reads to
place images and positions (``get_rope_index``, the vision tower's windows, the image-token scatter).
In a simulation they are made as fake-tensor constants (:func:`known_constants`): the fake mode keeps
their values and computes ops on constants for real, so that Python runs as it does on the GPU.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any

from ..core.errors import SpecError

# the processors' resize bounds, as the published preprocessor_config.json of each family sets them
# (Qwen2-VL / Qwen2.5-VL: min_pixels 3136, max_pixels 12845056; Qwen3-VL: shortest_edge 65536,
# longest_edge 16777216), and the text-only default image size memlens uses when none is given
_QWEN_PIXELS = {"qwen2_vl": (56 * 56, 28 * 28 * 16384), "qwen2_5_vl": (56 * 56, 28 * 28 * 16384),
                "qwen3_vl": (65536, 16777216), "qwen3_vl_moe": (65536, 16777216)}
QWEN_DEFAULT_IMAGE_SIZE = 448
# ops on fake constants are computed for real when every output has at most this many elements
# (torch._subclasses.fake_tensor.CONSTANT_NUMEL_LIMIT, 1 by default): room for the index tensors of a batch
_CONSTANT_LIMIT = 1 << 24


def family(config) -> str:
    """qwen-vl, gemma3, mllama or llava (every other VLM: a fixed image, image_seq_length tokens)."""
    mt = getattr(config, "model_type", "")
    if mt in _QWEN_PIXELS or (hasattr(getattr(config, "vision_config", None), "spatial_merge_size")
                              and hasattr(config, "vision_start_token_id")):
        return "qwen-vl"
    if mt == "gemma3":
        return "gemma3"
    if mt == "mllama":
        return "mllama"
    return "llava"


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's image processor's resize (transformers qwen2_vl/image_processing_qwen2_vl.py
    ``smart_resize``): each side rounded to a multiple of ``factor``, the area kept in [min, max] pixels.

    >>> smart_resize(448, 448, 28, 3136, 12845056)
    (448, 448)
    >>> smart_resize(500, 500, 28, 3136, 12845056)
    (504, 504)
    """
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def qwen_grid(config, size: int) -> tuple[int, int, int]:
    """(patches, image tokens, grid side in patches) of an S x S image for a Qwen-VL config."""
    v = config.vision_config
    patch, merge = v.patch_size, v.spatial_merge_size
    lo, hi = _QWEN_PIXELS.get(config.model_type, _QWEN_PIXELS["qwen2_5_vl"])
    h, w = smart_resize(size, size, patch * merge, lo, hi)
    gh, gw = h // patch, w // patch
    return gh * gw, gh * gw // (merge * merge), gh


def image_size(spec, config) -> int:
    """The image side the batch is made at (checked against what the family takes)."""
    fam, v = family(config), config.vision_config
    if fam == "qwen-vl":
        return spec.image_size or QWEN_DEFAULT_IMAGE_SIZE
    fixed = v.image_size[0] if isinstance(v.image_size, (list, tuple)) else v.image_size
    if fam == "mllama":      # any size: the processor tiles it into at most max_num_tiles tiles of image_size px
        return spec.image_size or fixed
    if spec.image_size and spec.image_size != fixed:
        more = ("; Gemma-3's pan-and-scan crops are more images: --images-per-sample" if fam == "gemma3"
                else " (multi-resolution VLMs: use a factory)")
        raise SpecError(f"{config.model_type} takes {fixed}px images", hint=f"drop --image-size{more}")
    return fixed


def image_tokens(config, size: int | None = None) -> int:
    """Tokens an image puts in the language model's sequence."""
    fam = family(config)
    if fam == "qwen-vl":
        return qwen_grid(config, size or QWEN_DEFAULT_IMAGE_SIZE)[1]
    if fam == "gemma3":
        return int(config.mm_tokens_per_image)
    if fam == "mllama":
        return 1              # the <|image|> token; the image itself is read by cross-attention
    n = getattr(config, "image_seq_length", None)
    if n:
        return int(n)
    v = config.vision_config
    return (v.image_size // v.patch_size) ** 2


def lm_length(spec, config, text_default: int) -> int:
    """The language model's sequence: --seq-len (the whole sequence for llava; the text for the others,
    the image tokens added)."""
    fam = family(config)
    n_img = spec.images_per_sample * image_tokens(config, image_size(spec, config) if fam == "qwen-vl" else None)
    if fam == "llava":
        return spec.seq_len or n_img + text_default
    return (spec.seq_len or text_default) + (n_img if fam != "mllama" else 0)


def note(spec, config, text_default: int) -> str | None:
    """What the batch holds, for the Result's notes (None for llava: its notes are as before)."""
    fam = family(config)
    if fam == "llava":
        return None
    S, N = image_size(spec, config), spec.images_per_sample
    text = spec.seq_len or text_default
    L = lm_length(spec, config, text_default)
    if fam == "qwen-vl":
        patches, tokens, side = qwen_grid(config, S)
        return (f"{N} image(s) of {S}x{S} px a sample, resized to {side * config.vision_config.patch_size}px by the Qwen-VL "
                f"processor: {patches} patches each, merged {config.vision_config.spatial_merge_size}x"
                f"{config.vision_config.spatial_merge_size} into {tokens} image tokens; the language model's sequence is "
                f"{text} text tokens (--seq-len) + {N * tokens} image tokens = {L}")
    if fam == "gemma3":
        return (f"{N} image(s) of {S}x{S} px a sample (Gemma-3's fixed size), {image_tokens(config)} tokens each; the "
                f"language model's sequence is {text} text tokens (--seq-len) + {N * image_tokens(config)} image tokens = {L}")
    tiles, used = config.vision_config.max_num_tiles, _mllama_tiles(config, S)[1]
    return (f"{N} image(s) of {S}x{S} px a sample, {used} of {tiles} tiles used (the processor pads every image to {tiles} "
            f"tiles, which the vision encoder all runs); one <|image|> token each in the {L} text tokens (--seq-len), "
            "the image read through the cross-attention layers")


def _mllama_tiles(config, size: int) -> tuple[int, int]:
    """(aspect ratio id, tiles used) of a square image: the 1x1 canvas up to image_size px, else the
    largest square canvas of supported_aspect_ratios (mllama image processor ``get_optimal_tiled_canvas``)."""
    v = config.vision_config
    ratios = [tuple(r) for r in v.supported_aspect_ratios]
    squares = sorted((r for r in ratios if r[0] == r[1]), key=lambda r: r[0])
    need = math.ceil(size / v.image_size)
    pick = next((r for r in squares if r[0] >= need), squares[-1])
    return ratios.index(pick) + 1, pick[0] * pick[1]


def make_batch(spec, source, text_default: int, dev: dict, pix_dtype) -> tuple[dict, int, int]:
    """(batch, the language model's sequence length, image side) for a VLM."""
    cfg, fam = source.config, family(source.config)
    if fam == "llava":
        return _llava_batch(spec, source, text_default, dev, pix_dtype)
    S = image_size(spec, cfg)
    text = spec.seq_len or text_default
    markers = {"qwen-vl": 2, "gemma3": 2, "mllama": 1}[fam] * spec.images_per_sample
    if text < markers + 1:
        raise SpecError(f"seq_len {text} leaves no text beside the {markers} image marker tokens",
                        hint=f"use --seq-len {markers + 64} or more")
    builder = {"qwen-vl": _qwen_batch, "gemma3": _gemma3_batch, "mllama": _mllama_batch}[fam]
    batch, L = builder(spec, cfg, S, text, dev, pix_dtype)
    return batch, L, S


def _text_ids(n: int, vocab: int) -> list[int]:
    return [1000 + i % (min(vocab, 30000) - 1000) for i in range(n)]


VALUES = "_memlens_values"   # on a meta batch tensor: the Python data it was made from (fake_constant)


def known_tensor(data: list, dev: dict):
    """``torch.tensor(data)`` (int64); on the meta device (a batch made for a simulation) it carries
    ``data``, from which :func:`fake_constant` makes the fake constant."""
    import torch  # heavy: torch, loaded on first use

    t = torch.tensor(data, dtype=torch.long, **dev)
    if t.device.type == "meta":
        setattr(t, VALUES, data)
    return t


def fake_constant(t, fake_mode):
    """The fake CPU tensor of a meta batch tensor made by :func:`known_tensor`: a constant whose values
    the fake mode keeps (None for any other tensor)."""
    import torch  # heavy: torch, loaded on first use

    data = getattr(t, VALUES, None)
    if data is None:
        return None
    with fake_mode, known_constants(force=True):
        return torch.tensor(data, dtype=t.dtype, device="cpu")


def _ids_and_labels(rows: list[list[int]], image_ids: set[int], dev: dict) -> dict:
    """input_ids and labels (the collator's copy, -100 on image tokens) as known constants."""
    return {"input_ids": known_tensor(rows, dev),
            "labels": known_tensor([[-100 if t in image_ids else t for t in r] for r in rows], dev)}


def _qwen_batch(spec, cfg, S, text, dev, pix_dtype):
    import torch  # heavy: torch, loaded on first use

    B, N, v = spec.batch_size, spec.images_per_sample, cfg.vision_config
    patches, tokens, side = qwen_grid(cfg, S)
    plain = _text_ids(text - 2 * N, cfg.text_config.vocab_size)
    row: list[int] = []
    for _ in range(N):
        row += [cfg.vision_start_token_id] + [cfg.image_token_id] * tokens + [cfg.vision_end_token_id]
    row += plain
    batch = _ids_and_labels([row] * B, {cfg.image_token_id}, dev)
    width = v.in_chans if hasattr(v, "in_chans") else getattr(v, "in_channels", 3)
    batch["pixel_values"] = torch.randn(B * N * patches, width * v.temporal_patch_size * v.patch_size ** 2, dtype=pix_dtype, **dev)
    batch["image_grid_thw"] = known_tensor([[1, side, side]] * (B * N), dev)
    if _forward_takes(cfg, "mm_token_type_ids"):   # the processor's (return_mm_token_type_ids): 1 on image tokens
        batch["mm_token_type_ids"] = known_tensor([[int(t == cfg.image_token_id) for t in row]] * B, dev)
    return batch, len(row)


def _forward_takes(cfg, name: str) -> bool:
    """Whether the forward of the class transformers builds for ``cfg`` takes argument ``name``."""
    import inspect

    from transformers import AutoModelForImageTextToText  # heavy: transformers, loaded on first use

    cls = AutoModelForImageTextToText._model_mapping.get(type(cfg), None)
    return cls is not None and name in inspect.signature(cls.forward).parameters


OPS_PER_ROW = 400     # get_rope_index's Python loop over the batch's rows and each row's images: ~360 ops a row-image
                      # (counted on tests/fixtures/configs/qwen2.5-vl.json at batch 1, 2, 4: 388, 746, 1462)
OPS_PER_WINDOW = 40   # ops a vision attention module runs for one window: split views, q/k/v transposes, SDPA, cat


def extra_forward_ops(batch, config) -> int:
    """Ops a Qwen-VL vision attention module may run beyond the simulation's per-module limit (estimator/
    simulate.py FORWARD_OPS_LIMIT, a guard against per-token Python loops): with SDPA, transformers runs one
    attention call per window (window_size px, merged patches) and per image for the full-attention blocks,
    which is what the GPU runs too. 0 for other batches."""
    grid = batch.get("image_grid_thw") if isinstance(batch, dict) else None
    known = getattr(grid, "constant", None)                  # the fake batch's grid (a constant)
    values = getattr(grid, VALUES, None) or (known.tolist() if known is not None else None)
    if not values or family(config) != "qwen-vl":
        return 0
    v = config.vision_config
    window = max(1, getattr(v, "window_size", 0) // v.spatial_merge_size // v.patch_size)
    windows = sum(t * math.ceil(h // v.spatial_merge_size / window) * math.ceil(w // v.spatial_merge_size / window)
                  for t, h, w in values)
    ids = batch.get("input_ids")
    rows = int(ids.shape[0]) if ids is not None and ids.dim() == 2 else 1
    per_row = max(1, len(values) // rows)                     # images per row
    return OPS_PER_WINDOW * (windows + len(values)) + OPS_PER_ROW * rows * per_row


def _gemma3_batch(spec, cfg, S, text, dev, pix_dtype):
    import torch  # heavy: torch, loaded on first use

    B, N = spec.batch_size, spec.images_per_sample
    image = cfg.image_token_id if hasattr(cfg, "image_token_id") else cfg.image_token_index
    boi, eoi = cfg.boi_token_index, cfg.eoi_token_index
    row: list[int] = []
    for _ in range(N):
        row += [boi] + [image] * cfg.mm_tokens_per_image + [eoi]
    row += _text_ids(text - 2 * N, cfg.text_config.vocab_size)
    batch = _ids_and_labels([row] * B, {image}, dev)
    batch["token_type_ids"] = known_tensor([[int(t == image) for t in row]] * B, dev)
    batch["pixel_values"] = torch.randn(B * N, 3, S, S, dtype=pix_dtype, **dev)
    return batch, len(row)


def _mllama_batch(spec, cfg, S, text, dev, pix_dtype):
    import torch  # heavy: torch, loaded on first use

    B, N, v = spec.batch_size, spec.images_per_sample, cfg.vision_config
    image = cfg.image_token_id if hasattr(cfg, "image_token_id") else cfg.image_token_index
    row = [image] * N + _text_ids(text - N, cfg.text_config.vocab_size)
    batch = _ids_and_labels([row] * B, {image}, dev)
    ratio_id, used = _mllama_tiles(cfg, S)
    T = v.max_num_tiles
    tiles = [1] * used + [0] * (T - used)
    batch["aspect_ratio_ids"] = known_tensor([[ratio_id] * N] * B, dev)
    batch["aspect_ratio_mask"] = known_tensor([[tiles] * N] * B, dev)
    # each text token attends to the images before it (mllama processor get_cross_attention_token_mask)
    batch["cross_attention_mask"] = known_tensor([[[[t if i >= k else 0 for t in tiles] for k in range(N)]
                                                   for i in range(len(row))]] * B, dev)
    batch["pixel_values"] = torch.randn(B, N, T, v.num_channels, v.image_size, v.image_size, dtype=pix_dtype, **dev)
    return batch, len(row)


def _llava_batch(spec, source, text_default, dev, pix_dtype):
    import torch  # heavy: torch, loaded on first use

    cfg, B = source.config, spec.batch_size
    S = image_size(spec, cfg)
    n_img = image_tokens(cfg) * spec.images_per_sample
    L = lm_length(spec, cfg, text_default)
    if L < n_img + 1:
        raise SpecError(f"seq_len {L} leaves no room for {n_img} image tokens", hint=f"use --seq-len {n_img + 256} or more")
    vocab = cfg.text_config.vocab_size
    image_token = cfg.image_token_id if hasattr(cfg, "image_token_id") else cfg.image_token_index
    text = torch.randint(0, min(vocab, image_token), (B, L - n_img), **dev)
    img = torch.full((B, n_img), image_token, dtype=torch.long, **dev)
    ids = torch.cat([img, text], dim=1)
    return {"input_ids": ids, "labels": ids,
            "pixel_values": torch.randn(B * spec.images_per_sample, 3, S, S, dtype=pix_dtype, **dev)}, L, S


_ON = [False]   # known_constants is active (read by the CUDA emulation: estimator/cuda_rules.py)


def constants_on() -> bool:
    return _ON[0]


def constant_arange(func, args, kwargs):
    """``torch.arange`` of Python integers while known constants are on: the fake output (the tracker sees
    its allocation) with its values kept (``FakeTensor.constant``), so index arithmetic on it and on the
    batch's constants runs for real (Qwen-VL's window index, rope index and vision positions start from
    aranges). Floating-point or oversized aranges stay plain fakes."""
    import torch  # heavy: torch, loaded on first use
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily  # heavy: torch internals
    from torch.utils._python_dispatch import _disable_current_modes  # heavy: torch internals

    out = func(*args, **kwargs)
    if (not isinstance(out, FakeTensor) or out.dtype.is_floating_point or out.numel() > _CONSTANT_LIMIT
            or not all(isinstance(a, int) for a in args)):
        return out
    with unset_fake_temporarily(), _disable_current_modes():
        out.constant = func(*args, **{k: v for k, v in kwargs.items() if k != "device"}, device="cpu")
    return out


def constant_tensor(func, args, kwargs):
    """``torch.tensor(data)`` whose data holds fake constants (e.g. Qwen-VL's ``get_rope_index`` makes its
    rope deltas from a list of 0-d tensors): ``torch.tensor`` reads its elements' memory, which a fake tensor
    has not, so they are replaced by their known values first; the result is a constant too."""
    from torch._subclasses.fake_tensor import FakeTensor  # heavy: torch internals
    from torch.utils._pytree import tree_map  # heavy: torch, loaded on first use

    def value(x):
        if isinstance(x, FakeTensor) and x.constant is not None:
            return x.constant.tolist()
        return x

    return func(*tree_map(value, list(args)), **kwargs)


@contextlib.contextmanager
def known_constants(batch: Any = None, force: bool = False):
    """While inside, the fake mode keeps the values of tensors made from Python data (``torch.tensor``)
    and of ops on them, up to :data:`_CONSTANT_LIMIT` elements (torch keeps one element: a scalar).

    Entered when the batch is made (``force``) and around a simulation whose ``batch`` holds such
    constants; elsewhere (a real run, a batch without constants) it changes nothing."""
    from torch._subclasses import fake_tensor  # heavy: torch, loaded on first use

    active = force or any(getattr(t, "constant", None) is not None for t in (batch.values() if isinstance(batch, dict) else ()))
    saved, was_on = fake_tensor.CONSTANT_NUMEL_LIMIT, _ON[0]
    if active:
        fake_tensor.CONSTANT_NUMEL_LIMIT = max(saved, _CONSTANT_LIMIT)
        _ON[0] = True
    try:
        yield active
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT, _ON[0] = saved, was_on
