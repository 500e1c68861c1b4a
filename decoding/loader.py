"""From a model name in the configuration to a resident ``LoadedModel``.

A name is, in order: an alias of a pinned model (pulled into the store when missing), a tiny random
model (built on first use), a local Hugging Face directory, a local ``.gguf`` file, or a hub id
(ordinary transformers behaviour where the machine is online).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from decoding import store, tiny
from decoding.errors import ModelLoadError, VocabMismatch
from decoding.runner import EagerRunner
from decoding.sequence import LoadedModel, RunnerFactory

log = logging.getLogger("specgate.loader")


@dataclass(frozen=True)
class ModelSpec:
    name: str  # served name
    source: str  # alias, directory, .gguf file or hub id
    draft: str | None = None  # served name of another model used as this one's draft
    dtype: str = "auto"  # auto: bfloat16 on CUDA; on a CPU measured at start (loader.cpu_auto_dtype)
    device: str = "auto"
    max_context: int | None = None
    # how steps run: eager (DynamicCache), static (static cache), cuda_graphs (static + graphs),
    # compile (static + each layer compiled by inductor, under CUDA graphs on CUDA), tensorrt (the
    # `tensorrt` extra), llamacpp (the GGUF as it ships, in llama.cpp: the `llamacpp` extra); auto:
    # compile on CUDA (cuda_graphs if compiling fails); on a CPU llamacpp for a GGUF source with dtype
    # auto where the extra is installed, else static (eager for architectures the static layer does
    # not cover); the static backends and llamacpp batch requests
    backend: str = "auto"
    slots: int = 4  # static backends: sequences with a KV cache at once (>= the engine's max_active)
    # CUDA graphs: capture at load every step shape of up to this many rows (the engine's
    # max_active), so none is captured mid-stream; None: each on first use
    max_batch: int | None = None
    # static backends: exact mode, every decode and verification step at one padded width
    # (decoding.runner.EXACT_WIDTH; see docs/architecture.md, Exact mode). None: on, except for `auto`
    # on a CPU, where exact mode's whole-cache attention costs more than a GPU's
    exact: bool | None = None
    # exact mode on CUDA also batch-invariant: a row's bits do not depend on the rest of the batch
    # (decoding/invariant.py; docs/architecture.md, Exact mode), at a measured cost in throughput
    batch_invariant: bool = False
    # llama.cpp: slots keep their KV across requests for prompts sharing a prefix (decoding.prefix)
    prefix_caching: bool = True


BACKENDS = ("auto", "eager", "static", "cuda_graphs", "compile", "tensorrt", "llamacpp")
STATIC_CONTEXT = 8192  # static backends' default max_context (attention reads the whole cache each step)


def resolve(source: str, pull: bool = True, weights: bool = True) -> tuple[Path | str, str | None]:
    """(path or hub id, gguf file name or None). A pinned model's directory is verified against its
    recorded sha256s first (``weights`` false: its safetensors by size only)."""
    alias = store.canonical(source)
    if alias in store.PINNED:
        try:
            return store.verified_dir(alias, pull=pull, weights=weights), None
        except store.StoreError as exc:
            raise ModelLoadError(str(exc)) from exc
    if alias in tiny.TINY:
        d = store.model_dir(alias)
        if not (d / "config.json").exists():
            d.parent.mkdir(parents=True, exist_ok=True)
            tiny.build(alias, d)
        return d, None
    p = Path(source).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        return p, None
    return source, None  # a hub id: transformers decides (offline machines fail with its message)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return cpu_auto_dtype() if device.type == "cpu" else torch.bfloat16
    try:
        value = getattr(torch, dtype)
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise ModelLoadError(f"unknown dtype '{dtype}' (use auto, bfloat16, float16 or float32)")
    return value


def unreadable(spec: ModelSpec, exc: Exception) -> ModelLoadError:
    """The error for a model whose files or config cannot be read."""
    alias = store.canonical(spec.source)
    local = alias in store.PINNED or alias in tiny.TINY or Path(spec.source).expanduser().exists()
    if not local and os.environ.get("HF_HUB_OFFLINE", "1") not in ("0", "false", "False"):
        # transformers' own words here ("check your internet connection") send an operator the wrong way
        return ModelLoadError(
            f"could not load model '{spec.name}': '{spec.source}' is no pinned alias ({', '.join(store.PINNED)}), "
            "tiny model, local directory or .gguf file, and is not in the local Hugging Face cache; "
            "specgate does not download from a model hub (HF_HUB_OFFLINE=1): point source at a local copy"
        )
    return ModelLoadError(f"could not load model '{spec.name}' from {spec.source}: {exc}")


def serving_context(spec: ModelSpec, config: object, static: bool = True) -> int:
    """The context a model is served at: ``max_context``, else its config's (4096 where it names
    none), capped at STATIC_CONTEXT on a static cache (attended over whole at every step; tensorrt
    and llama.cpp hold one too)."""
    declared = int(getattr(config, "max_position_embeddings", None) or 4096)
    return spec.max_context or (min(declared, STATIC_CONTEXT) if static else declared)


def load(spec: ModelSpec, pull: bool = True) -> LoadedModel:
    t0 = time.perf_counter()
    device = pick_device(spec.device)
    if use_llamacpp(spec, device):
        return load_llamacpp(spec, pull)
    if device.type == "cuda":
        from decoding.static import without_split_k

        without_split_k()  # before the process's first matmul on the GPU (decoding.static.NO_SPLIT_K)
        # bf16 GEMMs reduce in float32, as the GPU benchmarks ran the engine (bench.gpu_batch's
        # speed, and its fast-mode outputs identical to plain decoding); torch's default lets cuBLAS
        # reduce in bf16
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    where, gguf = resolve(spec.source, pull=pull)
    dtype = pick_dtype(spec.dtype, device)
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise unreadable(spec, exc) from exc
    model = model.to(device).eval()  # type: ignore[arg-type]  # transformers types .to() oddly
    if store.canonical(spec.source) in tiny.TINY:
        tokenizer.chat_template = tiny.CHATML  # the current template, also for tiny models built earlier
    config_ctx = int(getattr(model.config, "max_position_embeddings", None) or 4096)
    backend = resolve_backend(spec, device, dtype)
    if backend == "static" and spec.backend == "auto":
        try:
            check_static(model, config_ctx)
        except ModelLoadError as exc:
            log.info(
                "model %s: %s; serving it on the eager backend, one request per forward pass", spec.name, exc
            )
            backend = "eager"
        spec = replace(spec, exact=False if spec.exact is None else spec.exact)
    max_context = serving_context(spec, model.config, static=backend != "eager")
    eos = _eos_ids(model, tokenizer)
    factory, draft_factory = runner_factories(replace(spec, backend=backend), model, device, max_context)
    log.info("loaded %s from %s on %s/%s in %.1fs", spec.name, where, device, dtype, time.perf_counter() - t0)
    return LoadedModel(
        name=spec.name,
        model=model,
        tokenizer=tokenizer,
        draft=spec.draft,
        max_context=max_context,
        eos_token_ids=eos,
        runner_factory=factory,
        draft_runner_factory=draft_factory,
    )


def gguf_backed(source: str) -> bool:
    """Whether ``source`` is a GGUF: a pinned alias (they ship as GGUF) or a .gguf file."""
    return store.canonical(source) in store.PINNED or Path(source).suffix == ".gguf"


@functools.cache
def _llamacpp_installed() -> bool:
    """The llamacpp extra's presence, logged once per process when ``auto`` would have used it."""
    from decoding import llamacpp

    if llamacpp.available():
        return True
    log.info(
        "llama-cpp-python is not installed: GGUF models run dequantised on the torch CPU path; "
        "for llama.cpp's kernels on the GGUF as it ships: %s",
        llamacpp.EXTRA_HINT,
    )
    return False


def use_llamacpp(spec: ModelSpec, device: torch.device) -> bool:
    """``llamacpp`` asked for, or ``auto`` on a CPU for a GGUF source at the default dtype (an
    explicit dtype asks for the torch path's numerics) with the extra installed."""
    if spec.backend == "llamacpp":
        if device.type != "cpu":
            raise ModelLoadError(f"model '{spec.name}': backend llamacpp runs on the CPU, not {device}")
        if not gguf_backed(spec.source):
            raise ModelLoadError(
                f"model '{spec.name}': backend llamacpp needs a GGUF source, not {spec.source}"
            )
        return True
    return (
        spec.backend == "auto"
        and device.type == "cpu"
        and spec.dtype == "auto"
        and gguf_backed(spec.source)
        and _llamacpp_installed()
    )


def load_llamacpp(spec: ModelSpec, pull: bool = True) -> LoadedModel:
    """The GGUF in llama.cpp; tokenizer and config from the converted directory (a pinned alias)
    or from the GGUF itself. No transformers weights are loaded."""
    from decoding.llamacpp import GGUFInfo, LlamaCppModel

    t0 = time.perf_counter()
    where, gguf = resolve(spec.source, pull=pull, weights=False)
    alias = store.canonical(spec.source)
    try:
        path = store.gguf_file(alias) if alias in store.PINNED else Path(where) / str(gguf)
    except store.StoreError as exc:
        raise ModelLoadError(str(exc)) from exc
    kwargs = {"gguf_file": gguf} if gguf else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        config = AutoConfig.from_pretrained(where, **kwargs)
    except (OSError, ValueError) as exc:
        raise unreadable(spec, exc) from exc
    generation = None  # a bare GGUF carries none; the converted directory has the model's own
    if not gguf:
        with contextlib.suppress(OSError, ValueError):
            generation = GenerationConfig.from_pretrained(where)
    max_context = serving_context(spec, config)
    # exact mode (unless `exact: false`): a q8_0 KV cache and capped target steps, so that greedy
    # speculation is bit-exact (decoding/llamacpp.py). Off, llama.cpp's own f16 cache and target rows
    # batched freely: a long prompt prefills faster (2,048 tokens in 43 against 60 s on an AVX2-only
    # EPYC, docs/benchmarks.md), and speculation is target-only's up to rounding ties
    exact = spec.exact is not False
    kv_type = "q8_0" if exact else "f16"
    llama = LlamaCppModel(path, max_context, spec.slots, kv_type=kv_type, prefix_cache=spec.prefix_caching)
    info = GGUFInfo(llama, config, generation)
    log.info(
        "loaded %s from %s on llama.cpp (%d threads, %d slots of %d tokens) in %.1fs",
        spec.name,
        path,
        llama.threads,
        spec.slots,
        max_context,
        time.perf_counter() - t0,
    )
    return LoadedModel(
        name=spec.name,
        model=cast(PreTrainedModel, info),  # the engine reads device, vocabulary and size of it
        tokenizer=tokenizer,
        draft=spec.draft,
        max_context=max_context,
        eos_token_ids=_eos_ids(info, tokenizer),
        runner_factory=llama.runner if exact else functools.partial(llama.runner, exact=False),
        draft_runner_factory=llama.draft_runner,
    )


def runner_factories(
    spec: ModelSpec, model: PreTrainedModel, device: torch.device, max_context: int
) -> tuple[RunnerFactory, RunnerFactory]:
    """The runner factory for serving the model, and the one for drafting with it."""
    backend = resolve_backend(spec, device, model.dtype)
    if backend == "llamacpp":
        raise ModelLoadError(f"model '{spec.name}': backend llamacpp is loaded by load_llamacpp")
    if backend == "eager":
        return EagerRunner, EagerRunner
    if backend == "tensorrt":
        from decoding.trt import tensorrt_runner_factory

        trt = tensorrt_runner_factory(model, max_context, spec.slots)
        return trt, trt
    if backend == "cuda_graphs" and device.type != "cuda":
        raise ModelLoadError(f"model '{spec.name}': backend cuda_graphs needs a CUDA device, not {device}")
    from decoding.static import StaticModel

    def static_model(compile_step: bool) -> StaticModel:
        return StaticModel(
            model,
            max_len=max_context,
            slots=spec.slots,
            graphs=backend in ("cuda_graphs", "compile"),  # StaticModel captures graphs on CUDA only
            compile_step=compile_step,
            exact=spec.exact is not False,
            batch_invariant=spec.batch_invariant,
        )

    static = static_model(backend == "compile")
    if backend == "compile":
        t0 = time.perf_counter()
        try:
            static.warm()  # compile now, not in the first request
        except Exception as exc:  # inductor's toolchain (triton, a C compiler) missing or failing
            if spec.backend != "auto":
                raise ModelLoadError(f"model '{spec.name}': torch.compile failed: {exc!r:.300}") from exc
            log.warning("model %s: torch.compile failed (%r); serving with CUDA graphs alone", spec.name, exc)
            static = static_model(False)
        else:
            log.info("model %s: compiled in %.1fs", spec.name, time.perf_counter() - t0)
    if spec.max_batch and static.graphs_enabled:
        t0 = time.perf_counter()
        n = static.capture_serving(spec.max_batch)
        static.time_steps()  # the engine's batch cost model starts from these (BatchCosts.seed)
        log.info(
            "model %s: %d CUDA graphs captured and timed (steps of up to %d rows) in %.1fs%s",
            spec.name,
            n,
            spec.max_batch,
            time.perf_counter() - t0,
            # exact mode's widths by batch bucket: the rest pad to the next one (decoding.exact)
            f"; exact widths {static.widths.proven}" if static.exact else "",
        )
    return static.runner, static.draft_runner


def cpu_bf16_features() -> list[str]:
    """The CPU's bf16 matrix instructions, from /proc/cpuinfo (empty where there are none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = next((line.split() for line in text.splitlines() if line.startswith("flags")), [])
    return [f for f in ("avx512_bf16", "amx_bf16") if f in flags]


def _linear_seconds(dtype: torch.dtype, rows: int, d: int = 1536, reps: int = 5) -> float:
    """Median seconds of one [rows, d] x [d, 4d] matmul (a 1.5B's MLP shape) on this CPU."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4 * d, d, generator=g).to(dtype)
    x = torch.randn(rows, d, generator=g).to(dtype)
    times = []
    with torch.inference_mode():
        torch.nn.functional.linear(x, w)  # warm-up: kernel selection, thread pool
        for _ in range(reps):
            t = time.perf_counter()
            torch.nn.functional.linear(x, w)
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


@functools.cache
def cpu_auto_dtype() -> torch.dtype:
    """``dtype: auto`` on the torch CPU path, chosen once by measuring (issue 14): bf16 where an 8-row
    bf16 matmul (verification, batched decode) is no slower than float32's, float32 where bf16 runs
    its rows one by one (CPUs without bf16 matrix instructions), which made a 110-token prompt's first
    token 4x slower in bf16 there. Logged with the numbers. One-row decode is then float32's, slower
    in bytes: the trade the issue measured (TTFT 15.7 s -> 4 s, decode 3.3 -> 1.5 tok/s). Some CPUs
    without bf16 instructions sit between: on an AVX2 EPYC bf16 was faster at 1 and 8 rows and 2x
    slower at a 64-row prompt chunk (docs/benchmarks.md, cpu-batch-avx2); bf16 is kept there."""
    b1, b8 = _linear_seconds(torch.bfloat16, 1), _linear_seconds(torch.bfloat16, 8)
    f8 = _linear_seconds(torch.float32, 8)
    picked = torch.bfloat16 if b8 <= f8 else torch.float32
    log.info(
        "dtype auto on this CPU: %s (8-row matmul: bf16 %.2f ms, %.1fx its 1-row %.2f ms; float32 %.2f ms; "
        "bf16 matrix instructions: %s)",
        "bfloat16" if picked == torch.bfloat16 else "float32, bf16 runs rows one by one here",
        b8 * 1e3,
        b8 / b1,
        b1 * 1e3,
        f8 * 1e3,
        ", ".join(cpu_bf16_features()) or "none",
    )
    return picked


def resolve_backend(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: compile on CUDA, static on a CPU (``load`` falls back to eager for architectures
    the static layer does not cover). The static backends batch concurrent requests into one forward
    pass; the eager one runs them one at a time. On a CPU ``auto`` leaves exact mode off, which
    attends over the whole cache (docs/architecture.md, "Exact mode").
    """
    if spec.backend not in BACKENDS:
        raise ModelLoadError(
            f"model '{spec.name}': unknown backend '{spec.backend}' (one of {', '.join(BACKENDS)})"
        )
    if spec.backend != "auto":
        return spec.backend
    return "compile" if device.type == "cuda" else "static"


def check_static(model: PreTrainedModel, max_len: int) -> None:
    """Raise ModelLoadError where the static layer cannot run ``model``."""
    from decoding.layers import check_supported, layer_weights

    check_supported(model, max_len)
    with torch.inference_mode():
        layer_weights(model)  # refuses biases the layer does not apply


def _eos_ids(model: object, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        v = getattr(source, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    # chat models end a turn with a dedicated token that is not always the configured eos
    for special in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(special)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and special in tokenizer.get_vocab():
            ids.add(tid)
    return tuple(sorted(ids))


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft whose vocabulary differs from its target's (tokens would mean different text).
    Logits of different widths are fine where the tokenizers are the same and both widths cover its
    ids: the extra rows are padding no token maps to (Qwen2.5-7B's 152,064 beside the 0.5B's 151,936;
    ``decoding.vocab``)."""
    tv, dv = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if tv != dv:
        diff = len(set(tv.items()) ^ set(dv.items()))
        raise VocabMismatch(target.name, draft.name, f"{diff} token entries differ")
    if min(target.vocab_size, draft.vocab_size) < target.token_ids:
        raise VocabMismatch(
            target.name,
            draft.name,
            f"{target.vocab_size} vs {draft.vocab_size} logits for a tokenizer of {target.token_ids} ids",
        )


def load_all(specs: list[ModelSpec], pull: bool = True) -> dict[str, LoadedModel]:
    models = {s.name: load(s, pull=pull) for s in specs}
    _yield_cores_to_llamacpp(models)
    for m in models.values():
        if m.draft is not None:
            if m.draft not in models:
                raise ModelLoadError(f"model '{m.name}' names draft '{m.draft}', which is not configured")
            check_pair(m, models[m.draft])
    return models


def _yield_cores_to_llamacpp(models: dict[str, LoadedModel]) -> None:
    """Where llama.cpp runs every CPU model, torch only post-processes logits (argmax, softmax,
    penalties): one intra-op thread. More would spin-wait in OpenMP after each op on the cores
    llama.cpp's own threads need (measured on the real pair: docs/benchmarks.md, cpu-llamacpp)."""
    from decoding.llamacpp import GGUFInfo

    cpu = [m for m in models.values() if m.device.type == "cpu"]
    if cpu and all(isinstance(m.model, GGUFInfo) for m in cpu) and torch.get_num_threads() > 1:
        log.info(
            "every CPU model runs on llama.cpp: torch keeps one thread for the logits (was %d)",
            torch.get_num_threads(),
        )
        torch.set_num_threads(1)
