"""Model sources: how to get a model's skeleton without weights.

A source is one of: a built-in registry name (offline), a Hugging Face id (config.json only),
a local directory or config.json, ``timm:NAME`` / ``torchvision:NAME`` (the library's own
constructor on the meta device; optional extras), or ``package.module:factory`` returning
``(model, batch)``, ``(model, batch, loss_fn)`` or ``(model, batch, step)`` (see models/build.py).
"""
from __future__ import annotations

import difflib
import importlib
import importlib.util
import json
import logging
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from urllib.parse import urlparse

from ..core import usercode
from ..core.errors import ModelSourceError, sentences
from ..core.quiet import silenced
from ..core.usercode import first_line, last_user_frame
from . import registry
from . import diffusion

TASKS = ("causal-lm", "masked-lm", "seq-classification", "seq2seq", "speech-seq2seq", "image-classification", "clip",
         "vlm", "vision-module", "diffusion", "factory")
VISION_LIBRARIES = ("timm", "torchvision")


@dataclass
class ModelSource:
    """Where a model comes from and what kind of task it trains."""

    name: str
    kind: str                      # builtin | hf | local | factory | timm | torchvision
    task: str                      # one of TASKS
    config: Any = None             # transformers PretrainedConfig (None for factories)
    factory: Callable | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "task": self.task,
                "model_type": getattr(self.config, "model_type", None)}


# The longest --model string looked at: Linux's PATH_MAX (a path is the longest form a model source takes; a
# Hugging Face id is at most 96 characters). Longer strings would reach the file system as "File name too long".
MAX_MODEL_CHARS = 4096


def _exists(path: str | Path) -> bool:
    """os.path.exists, with a name the file system refuses (a component over 255 bytes) one line, not an OSError."""
    try:
        return Path(path).exists()
    except OSError as e:
        raise ModelSourceError(f"--model {str(path)[:60]!r}...: not a usable path ({e.strerror})",
                               hint="give a built-in name, owner/name, a directory or pkg.module:factory") from None


def resolve(model: str) -> ModelSource:
    """Resolve a --model string to a ModelSource, failing with one clear line.

    >>> resolve("gpt2").task
    'causal-lm'
    """
    model = model.strip()
    if len(model) > MAX_MODEL_CHARS:
        raise ModelSourceError(f"--model is {len(model):,} characters ({model[:40]!r}...): longer than any model name, "
                               f"Hugging Face id or path (at most {MAX_MODEL_CHARS})",
                               hint="give a built-in name (memlens estimate --list-models), owner/name, a directory or pkg.module:factory")
    lib, sep, lib_name = model.partition(":")
    if sep and lib in VISION_LIBRARIES:
        return _vision_library_source(lib, lib_name.strip())
    if (found := diffusion.diffusion_config(model)) is not None:   # diffusers' UNets and transformers (models/diffusion.py)
        return ModelSource(found[0], diffusion.KIND, diffusion.TASK, config=found[1])
    doc = registry.get(model)
    if doc is not None:
        return ModelSource(doc["name"], "builtin", doc["task"], config=_config_from_dict(doc["config"], doc["name"]))
    if ":" in model and not _exists(model):
        return _factory_source(model)
    path = Path(model).expanduser()
    if _exists(path):
        cfg_path = path / "config.json" if path.is_dir() else path
        if not cfg_path.exists():
            raise ModelSourceError(f"{path} has no config.json", hint="point --model at a Hugging Face model directory or its config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelSourceError(f"{cfg_path} is not valid JSON ({e})", hint="check the file is a Hugging Face config.json") from None
        return _source_from_config_dict(cfg, str(path), "local")
    if "/" in model and model.count("/") == 1 and not model.startswith((".", "/")):
        return _source_from_config_dict(_download_config(model), model, "hf")
    close = registry.suggest(model)
    hint = f"did you mean {', '.join(repr(c) for c in close)}? " if close else ""
    raise ModelSourceError(f"unknown model {model!r}", hint=hint + "see `memlens estimate --list-models`, or give a Hugging Face id, a directory, or pkg.module:factory")


_OFFLINE_HINT = ("use a built-in name (memlens estimate --list-models), a local directory with config.json, "
                 "or set HF_HUB_OFFLINE/HF_HOME to a cache that has it")


def _download_config(repo_id: str) -> dict:
    """Fetch config.json only (never weights). HF_TOKEN is used for gated repositories.

    Without a network, one line at once: a cached copy is used when there is one (HF_HUB_OFFLINE,
    or no connection to the Hub within 2 s), else the error says there is no network, before any
    of huggingface_hub's retries."""
    try:
        from huggingface_hub import hf_hub_download  # heavy: huggingface_hub, loaded on first use
        from huggingface_hub import utils as hf_errors  # the error classes, exported there by old and new versions
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ModelSourceError("huggingface_hub is not installed", hint="pip install huggingface_hub") from None
    what = f"cannot download the config of {repo_id}"
    token = os.environ.get("HF_TOKEN") or None
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    reason = "HF_HUB_OFFLINE is set" if offline else _hub_unreachable()
    try:
        with _hub_quiet():
            p = hf_hub_download(repo_id, "config.json", token=token, local_files_only=reason is not None)
    except hf_errors.HFValidationError as e:
        raise ModelSourceError(f"{repo_id!r} is not a valid Hugging Face id ({sentences(e)})",
                               hint="write it as owner/name, or use a built-in name (`memlens estimate --list-models`)") from None
    except hf_errors.GatedRepoError:
        raise ModelSourceError(f"{what}: the repository is gated", hint="accept its licence on the Hub and set HF_TOKEN") from None
    except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError, hf_errors.EntryNotFoundError) as e:
        if isinstance(e, hf_errors.LocalEntryNotFoundError) and reason is not None:   # offline, not in the cache
            raise ModelSourceError(f"{what}: no network ({reason}) and no cached copy", hint=_OFFLINE_HINT) from None
        if isinstance(e, hf_errors.LocalEntryNotFoundError):   # the connection failed during the download
            raise ModelSourceError(f"{what}: no network ({_short(e)})", hint=_OFFLINE_HINT) from None
        raise ModelSourceError(f"{what}: not found on the Hub ({type(e).__name__})",
                               hint="check the id, or use a built-in name (`memlens estimate --list-models`)") from None
    except (hf_errors.OfflineModeIsEnabled, OSError) as e:   # connection errors of requests/httpx are OSErrors or wrapped as such
        raise ModelSourceError(f"{what}: no network ({reason or _short(e)})", hint=_OFFLINE_HINT) from None
    except Exception as e:  # noqa: BLE001 - the Hub's other answers (5xx, rate limits...): one line
        raise ModelSourceError(f"{what} ({type(e).__name__}: {_short(e)})",
                               hint="try again later, or download config.json and pass its path") from None
    return json.loads(Path(p).read_text())


def _short(e: BaseException) -> str:
    return sentences(e) or type(e).__name__


def _hub_unreachable(timeout: float = 2.0) -> str | None:
    """Why the Hub cannot be reached (DNS, refused, timeout), or None when a TCP connection opens."""
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return f"cannot reach {host}:{port}: {e.strerror or type(e).__name__}"
    return None


def _hub_quiet():
    """No log lines or warnings of huggingface_hub (retries, symlink notes) while config.json is fetched."""
    return silenced("huggingface_hub", logging.CRITICAL)


def _config_from_dict(cfg: dict, label: str):
    from transformers import AutoConfig  # heavy: transformers, loaded on first use

    cfg = dict(cfg)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ModelSourceError(f"{label}: config has no model_type", hint="a Hugging Face config.json names its model_type")
    check_size_fields(cfg, label)
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except (ValueError, KeyError) as e:
        raise ModelSourceError(f"{label}: transformers cannot build model_type {model_type!r} ({sentences(e)})",
                               hint="upgrade transformers, or use pkg.module:factory for custom models") from None
    except Exception as e:   # huggingface_hub's StrictDataclassFieldValidationError: a field of the wrong type
        if type(e).__name__.startswith("StrictDataclass"):
            raise ModelSourceError(f"{label}: {_short(e).rstrip(':')}: {' '.join(str(e).split()[-8:])}",
                                   hint="fix that field in config.json") from None
        raise


# Sizes a model is built from: each, where a config has it, is a whole number above 0
_SIZE_FIELDS = (
    "hidden_size", "n_embd", "d_model", "num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers",
    "encoder_layers", "decoder_layers", "num_attention_heads", "n_head", "num_heads", "num_key_value_heads",
    "encoder_attention_heads", "decoder_attention_heads", "intermediate_size", "d_ff", "n_inner", "head_dim", "d_kv",
    "vocab_size", "max_position_embeddings", "n_positions", "num_local_experts", "num_experts", "num_experts_per_tok",
    "image_size", "patch_size", "num_channels",
)


def check_size_fields(cfg: dict, label: str, where: str = "") -> None:
    """ModelSourceError naming the first size field (``_SIZE_FIELDS``, also in ``text_config`` /
    ``vision_config``) that is not a whole number above 0.

    >>> check_size_fields({"n_layer": -2}, "cfg.json")
    Traceback (most recent call last):
    ...
    memlens.core.errors.ModelSourceError: cfg.json: config field 'n_layer' is -2: a model size must be a whole number above 0
    """
    for key in _SIZE_FIELDS:
        v = cfg.get(key)
        if v is None or (isinstance(v, (list, tuple)) and v and all(_positive(x) for x in v)):   # image_size: [h, w]
            continue
        if not _positive(v):
            kind = "" if isinstance(v, (int, float)) and not isinstance(v, bool) else f" (a JSON {_json_kind(v)})"
            hint = (f'write it as a number, without quotes: "{key}": {int(v)}' if isinstance(v, str) and v.strip().isdigit()
                    and int(v) > 0 else f'set "{key}" to a whole number above 0 (the published config\'s value)')
            raise ModelSourceError(f"{label}: config field '{where}{key}' is {json.dumps(v)}{kind}: "
                                   "a model size must be a whole number above 0", hint=hint)
    for sub in ("text_config", "vision_config", "encoder", "decoder"):
        if isinstance(cfg.get(sub), dict):
            check_size_fields(cfg[sub], label, f"{where}{sub}.")


def _positive(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _json_kind(v) -> str:
    return {str: "string", bool: "boolean", list: "list", dict: "object", float: "number"}.get(type(v), type(v).__name__)


_ARCH_TASKS = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForPreTraining", "masked-lm"),
    ("ForSequenceClassification", "seq-classification"),
    ("ForImageClassification", "image-classification"),
    ("ForConditionalGeneration", "vlm"),
    ("ForImageTextToText", "vlm"),
)


def _source_from_config_dict(cfg: dict, name: str, kind: str) -> ModelSource:
    config = _config_from_dict(cfg, name)
    task = infer_task(config)
    return ModelSource(name, kind, task, config=config)


def infer_task(config) -> str:
    """The training task for a transformers config (from `architectures`, else the model type)."""
    from transformers.models.auto import modeling_auto as ma  # heavy: transformers, loaded on first use

    mt = config.model_type
    # encoder-decoders first: transformers also maps e.g. whisper and bart to a decoder-only ForCausalLM
    if mt in ma.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
        return "speech-seq2seq"
    if getattr(config, "is_encoder_decoder", False) and mt in ma.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        arch = (getattr(config, "architectures", None) or [""])[0]
        if not arch.endswith("ForSequenceClassification"):
            return "seq2seq"
    for arch in getattr(config, "architectures", None) or []:
        if arch in ("CLIPModel", "SiglipModel"):
            return "clip"
        for suffix, task in _ARCH_TASKS:
            if arch.endswith(suffix):
                if task == "vlm" and not hasattr(config, "vision_config"):
                    continue  # e.g. an encoder-decoder not in transformers' seq2seq mapping
                return task
    if mt in ("clip", "siglip"):
        return "clip"
    if hasattr(config, "vision_config") and hasattr(config, "text_config"):
        return "vlm"
    if mt in ma.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "image-classification"
    if mt in ("bert", "roberta", "distilbert", "deberta", "deberta-v2", "electra", "albert", "xlm-roberta", "modernbert"):
        return "masked-lm"
    if mt in ma.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return "causal-lm"
    raise ModelSourceError(f"cannot tell what task model_type {mt!r} trains", hint="add `architectures` to config.json, or use pkg.module:factory")


def _vision_library_source(lib: str, name: str) -> ModelSource:
    """``timm:NAME`` / ``torchvision:NAME``: checked against the library's own model list (the
    library is an optional extra: `pip install memlens[vision]`)."""
    if not name:
        raise ModelSourceError(f"{lib}: needs a model name", hint=f"e.g. --model {lib}:resnet50")
    if importlib.util.find_spec(lib) is None:
        raise ModelSourceError(f"--model {lib}:{name} needs {lib}, which is not installed",
                               hint=f"pip install {lib} (or memlens[vision])")
    try:
        names = _library_models(lib)
    except Exception as e:  # noqa: BLE001 - a broken install (e.g. a CUDA torchvision on a CPU torch)
        raise ModelSourceError(f"{lib} is installed but cannot be imported ({type(e).__name__}: {str(e).splitlines()[0][:120]})",
                               hint=f"install a {lib} build that matches torch {_torch_version()}") from None
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3)
        raise ModelSourceError(f"{lib} has no model {name!r}",
                               hint=(f"did you mean {', '.join(close)}? " if close else "") + f"see {lib}'s model list")
    return ModelSource(f"{lib}:{name}", lib, "vision-module")


def _library_models(lib: str) -> list[str]:
    if lib == "timm":
        import timm  # optional: timm (memlens[vision])

        return list(timm.list_models())
    import torchvision  # optional: torchvision (memlens[vision])

    return list(torchvision.models.list_models(module=torchvision.models))


def _torch_version() -> str:
    import torch  # heavy: torch, loaded on first use

    return torch.__version__


def _factory_source(target: str) -> ModelSource:
    mod_name, _, fn_name = target.partition(":")
    if os.getcwd() not in sys.path:  # like `python -m`: modules of the current directory resolve
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelSourceError(f"cannot import {mod_name!r} for factory {target!r} ({e})", hint="make the module importable (PYTHONPATH) and write it as pkg.module:function") from None
    except Exception as e:  # noqa: BLE001 - the user's module fails as it is imported: theirs, with its last frame

        where = f"{os.path.basename(e.filename)}:{e.lineno}" if isinstance(e, SyntaxError) and e.filename else last_user_frame(e)
        raise ModelSourceError(f"importing your module {mod_name!r} for factory {target!r} raised {type(e).__name__}: "
                               f"{first_line(e)}" + (f" ({where})" if where else ""),
                               hint="fix the module: `python -c 'import " + mod_name + "'` shows the same error") from e
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ModelSourceError(f"{mod_name!r} has no callable {fn_name!r}", hint="the factory is `def fn(spec) -> (model, batch)`")

    usercode.register_file(getattr(mod, "__file__", None), target)   # its failures are the user's (core/usercode.py)
    usercode.register(fn, "factory", target)
    return ModelSource(target, "factory", "factory", factory=fn)
