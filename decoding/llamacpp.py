"""The llama.cpp backend: a GGUF evaluated by llama.cpp itself, quantised as it ships (the pinned
Q4_K_M files), through llama-cpp-python's low-level API (the ``llamacpp`` extra).

    LlamaCppModel   one GGUF: a llama context whose KV memory holds ``slots`` sequences (seq id =
                    slot), and the forward pass over several of them in one ``llama_decode``
    LlamaCppRunner  one sequence on one slot (the SequenceRunner the engine drives)
    GGUFInfo        what the engine reads of a resident model (device, vocabulary, parameter count),
                    standing in for the transformers model this backend never loads

The engine keeps drafting, verification, routing and streaming; llama.cpp only computes logits, at
every position a step asks for. Cutting back is ``llama_memory_seq_rm`` of the positions past the
committed length. A finished request's slot keeps its KV for the next request that shares its
prefix (``decoding.prefix.SlotCache``, ``LlamaCppRunner.reuse``).

Exact mode (target runners; docs/architecture.md, "The llama.cpp backend", has the measurements):
llama.cpp's CPU kernels round a token's logits differently depending on how it was batched, so
settings and step shapes are chosen for every verification row to compute exactly what a one-token
step computes:
  - steps of at most ``exact_step`` tokens: 3 with weights repacked (llama.cpp's default, and faster
    here: the repacked Q4_K kernels are a GEMV up to 3 rows and a GEMM that rounds otherwise from 4),
    7 with repacking off (``use_extra_bufts = False``; rows of 8+ rounded otherwise in some runs);
  - flash attention on, with a q8_0 KV cache: with an f16 cache a one-token step over 512 or more
    cached positions takes a split-KV attention path that rows of several tokens never take;
  - each sequence's row decoded on its own, as it would be alone (a batch of several sequences is split
    by llama.cpp in ways that moved the rounding);
  - one KV stream per sequence (``kv_unified = False``): a sequence's cells are its positions, so its
    attention sums in one order whatever runs beside it.
Draft runners skip the step cap and batch freely: their rounding changes proposals, never output.
A build with llama.cpp's AMX kernels uses them where a child process finds they run (``amx_works``):
GCC 12 builds without ``-fno-dse`` crashed in them.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from decoding import store
from decoding.errors import ModelLoadError
from decoding.prefix import SlotCache
from decoding.runner import Row, SlotRunner, Tokens

log = logging.getLogger("specgate.llamacpp")

# the widest row exact mode runs, by how the weights are held (module docstring): repacked for the
# AVX2/AVX-512 kernels, as they ship, or in AMX tiles (integer sums: every row of every width up to 16
# equalled its one-token step at 110 and 700 positions on a 2-core AMX Xeon; probed no wider)
EXACT_STEP = {"repacked": 3, "plain": 7, "amx": 16}
HELD = {  # the same three ways, in words (benchmarks say which one ran)
    "repacked": "repacked weights",
    "plain": "weights as they ship, not repacked",
    "amx": "weights in llama.cpp's AMX tiles",
}

EXTRA_HINT = "pip install 'specgate[llamacpp]'"


def available() -> bool:
    """Whether llama-cpp-python is importable (the ``llamacpp`` extra)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _lib() -> Any:
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelLoadError(f"backend llamacpp needs llama-cpp-python: {EXTRA_HINT}") from exc
    # the library logs through this logger's level (llama_cpp._logger): errors only
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    return llama_cpp


def amx_build(lib: Any) -> bool:
    """Whether this llama.cpp was built with its AMX kernels (``-DGGML_NATIVE=ON`` on a CPU with AMX).
    They take the weights into their own ("extra") buffers."""
    return b"AMX_INT8 = 1" in lib.llama_print_system_info()


def amx_works(lib: Any, path: Path) -> bool | None:
    """Whether this build's AMX kernels run: on the 2-core AMX Xeon lent here, llama-cpp-python 0.3.36
    built by GCC 12 crashed the process (segmentation fault) in the first ``llama_decode`` of a prompt
    with them on. That is upstream's open bug (llama.cpp issue 20824; PR 26954: GCC drops the stores
    to the tile configuration on the stack before ``_tile_loadconfig`` reads it). Built with
    ``-fno-dse -fno-tree-dse`` (the Makefile's flags) they ran and matched one-token steps bit for bit.
    A crash cannot be caught in-process, so a child process decodes ``path`` with them once per build
    of the library; the verdict is kept under the store's home. None, and nothing kept, where the
    child failed without a crash (an error exit: the model did not load, say) or hung: that says
    nothing of the kernels, and a kept "crashes" would turn them off for this build for good."""
    libdir = Path(lib.__file__).parent
    build = sorted(
        (str(f.relative_to(libdir)), f.stat().st_size, f.stat().st_mtime_ns) for f in libdir.rglob("*.so*")
    )
    key = hashlib.sha256(repr(build).encode()).hexdigest()[:16]
    verdict = store.home() / "llamacpp" / f"amx-{key}.json"
    if verdict.exists():
        return bool(json.loads(verdict.read_text())["works"])
    try:
        child = subprocess.run(
            [sys.executable, "-m", "decoding.llamacpp", "--amx-check", str(path)],
            capture_output=True,
            timeout=600,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
    except subprocess.TimeoutExpired:
        log.warning("llama.cpp's AMX check did not finish in 600 s: AMX off for this load, no verdict kept")
        return None
    if child.returncode > 0:  # an error, not a signal
        tail = (child.stderr or b"").decode(errors="replace").strip().splitlines()[-1:]
        log.warning(
            "llama.cpp's AMX check failed (exit %d: %s): AMX off for this load, no verdict kept",
            child.returncode,
            tail,
        )
        return None
    works = child.returncode == 0
    verdict.parent.mkdir(parents=True, exist_ok=True)
    verdict.write_text(json.dumps({"works": works, "returncode": child.returncode, "library": str(libdir)}))
    log.info(
        "llama.cpp's AMX kernels %s (checked once for this build: %s)", "run" if works else "crash", verdict
    )
    return works


def cpu_threads() -> int:
    """The cores this process may run on (llama.cpp's own default counts the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class LlamaCppModel:
    """One GGUF in a llama context with ``slots`` KV sequences of up to ``max_len`` tokens each."""

    def __init__(
        self,
        path: Path,
        max_len: int,
        slots: int = 1,
        threads: int | None = None,
        repack: bool = True,
        flash_attn: bool = True,
        unified_kv: bool = False,
        n_batch: int = 512,
        kv_type: str = "q8_0",
        prefix_cache: bool = True,
        amx_checked: bool = False,  # the AMX self-test's own child: take the kernels as they are
    ):
        lib = self.lib = _lib()
        lib.llama_backend_init()
        mp = lib.llama_model_default_params()
        mp.n_gpu_layers = 0
        amx = repack and amx_build(lib)
        works = True if not amx or amx_checked else amx_works(lib, path)
        if works is False:
            log.warning(
                "llama.cpp's AMX kernels crash in this build: weights are not repacked (rebuild with "
                "`make install`'s LLAMACPP_CMAKE_ARGS for them; decoding.llamacpp.amx_works)"
            )
        if not works:  # None: the check itself failed (amx_works said why)
            repack = amx = False
        mp.use_extra_bufts = repack
        self.kv_type = kv_type
        self.held = "amx" if amx else "repacked" if repack else "plain"  # a key of EXACT_STEP and HELD
        self.exact_step = EXACT_STEP[self.held]
        self.model = lib.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise ModelLoadError(f"llama.cpp could not load {path}")
        vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = int(lib.llama_vocab_n_tokens(vocab))
        self.n_embd = int(lib.llama_model_n_embd(self.model))
        self.n_params = int(lib.llama_model_n_params(self.model))
        self.n_ctx_train = int(lib.llama_model_n_ctx_train(self.model))
        self.max_len = max_len
        self.slots = slots
        self.n_batch = n_batch
        self.threads = threads or cpu_threads()
        cp = lib.llama_context_default_params()
        cp.n_ctx = max_len * slots  # split evenly between the sequences when each has its own stream
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = slots
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = unified_kv
        cp.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cp.no_perf = True
        cp.type_k = cp.type_v = getattr(lib, f"GGML_TYPE_{kv_type.upper()}")
        self.ctx = lib.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lib.llama_model_free(self.model)
            raise ModelLoadError(f"llama.cpp could not create a context for {path} ({slots} x {max_len})")
        self.mem = lib.llama_get_memory(self.ctx)
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.device = torch.device("cpu")
        self.max_graph_tokens = 16  # drafters feed rows up to this wide through forward_batch
        self._pending: dict[int, int] = {}  # slot -> real tokens of its next forward_batch row
        self.cache = SlotCache(slots)  # what each slot's KV holds, kept across requests
        self.prefix_cache = prefix_cache  # False: every request prefills its whole prompt

    # ---- slots: a prefix cache across requests (decoding.prefix) -------------------------------

    @property
    def free_slots(self) -> int:
        return len(self.cache)

    def acquire(self) -> int:
        """The least recently used free slot, as it is: ``adopt`` chooses again with the prompt, and
        a runner's first write cuts its KV at the runner's length."""
        return self.cache.take().slot

    def release(self, slot: int) -> None:
        self.cache.give_back(slot)  # its KV stays, for a later request sharing its prefix

    def adopt(
        self, slot: int, tokens: list[int], unit: int | None, strict: bool, salt: str | None
    ) -> tuple[int, int]:
        """For a runner owning ``slot`` whose sequence starts with ``tokens``: the slot it should
        own instead (``SlotCache.take``) and the positions its KV keeps; a prefix another slot holds
        is copied over first (between streams llama.cpp copies a whole stream, on the next decode)."""
        take = self.cache.take(tokens if self.prefix_cache else [], unit, strict, salt, mine=slot)
        if take.source is not None:
            self.lib.llama_memory_seq_cp(self.mem, take.source, take.slot, -1, -1)
        self.cut(take.slot, take.reuse)
        return take.slot, take.reuse

    def runner(self, _model: object = None, exact: bool = True) -> LlamaCppRunner:
        """The engine's runner factory (the argument is the model stand-in, already known here)."""
        return LlamaCppRunner(self, self.acquire(), exact)

    def draft_runner(self, _model: object = None) -> LlamaCppRunner:
        """A drafter's runner: no step cap, batched freely (its rounding never changes the output)."""
        return self.runner(exact=False)

    def cut(self, slot: int, length: int) -> None:
        """Forget the positions of ``slot`` from ``length`` on."""
        self.lib.llama_memory_seq_rm(self.mem, slot, length, -1)
        self.cache.cut(slot, length)

    # ---- the forward pass ---------------------------------------------------------------------

    def forward_rows(self, rows: list[Row], exact: bool = False) -> list[torch.Tensor | None]:
        """Several sequences' rows; each row's logits as its ``Row.logits`` asks: [T, V], [1, V] or
        None. One llama_decode for all of them, except in exact mode, where each row decodes on its
        own: llama.cpp splits a multi-sequence batch into per-sequence slices whose rounding moved
        with the batch's shape (measured: 6 + 6 tokens differed, 5 + 5 and 7 + 7 did not).

        In exact mode a row that wants every position's logits is at most ``exact_step`` tokens (a
        verification), except a scored prompt's chunk ("prompt"): it decodes whole, as an unscored
        chunk does, so its cache is the same bits and the completion after it too; only its
        logits, which are reported and never verified, round as a multi-row step does."""
        for r in rows:
            T = int(r.tokens.shape[0])
            assert r.start + T <= self.max_len, (
                f"sequence of {r.start + T} tokens exceeds the context ({self.max_len})"
            )
            self.cut(r.slot, r.start)  # stale positions of a rejected draft must not be attended
        if not exact:
            return self._rows(rows)
        for r in rows:
            assert r.logits != "all" or int(r.tokens.shape[0]) <= self.exact_step, (
                f"an exact row of {r.tokens.shape[0]} tokens (at most {self.exact_step})"
            )
        return [self._rows([r])[0] for r in rows]  # one decode per sequence: as it would run alone

    def _rows(self, rows: list[Row]) -> list[torch.Tensor | None]:
        flat: list[tuple[int, int, int, bool]] = []  # (token, position, slot, wants logits)
        for r in rows:
            T = int(r.tokens.shape[0])
            every = r.logits in ("all", "prompt")
            for j, t in enumerate(r.tokens.tolist()):
                flat.append((int(t), r.start + j, r.slot, every or (r.logits == "last" and j == T - 1)))
        logits = self._decode(flat) if flat else torch.zeros(0, self.n_vocab)  # [outputs, V]
        result: list[torch.Tensor | None] = []
        at = 0
        for r in rows:
            T = int(r.tokens.shape[0])
            n = {"all": T, "prompt": T, "last": 1, "none": 0}[r.logits]
            result.append(logits[at : at + n] if n else None)
            at += n
        return result

    def forward_batch(
        self, slots: list[int], starts: list[int], ids: torch.Tensor, exact: bool = False
    ) -> torch.Tensor:
        """The decode-only step (as ``StaticModel.forward_batch``): ``ids`` [B, W] padded; each row
        runs only its real tokens (``LlamaCppRunner.advance`` recorded how many) -> logits [B, W, V],
        zero past a row's tokens."""
        B, W = ids.shape
        widths = [self._pending.pop(s, W) for s in slots]
        rows = [Row(s, ids[b, : widths[b]], st) for b, (s, st) in enumerate(zip(slots, starts, strict=True))]
        out = torch.zeros(B, W, self.n_vocab)
        for b, t in enumerate(self.forward_rows(rows, exact)):
            assert t is not None
            out[b, : widths[b]] = t
        return out

    def _decode(self, flat: list[tuple[int, int, int, bool]]) -> torch.Tensor:
        lib, batch = self.lib, self.batch
        parts = []
        for c in range(0, len(flat), self.n_batch):
            chunk = flat[c : c + self.n_batch]
            wanted = []
            for i, (tok, pos, slot, out) in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = slot
                batch.logits[i] = out
                if out:
                    wanted.append(i)
            batch.n_tokens = len(chunk)
            rc = lib.llama_decode(self.ctx, batch)
            wrote: dict[int, tuple[int, list[int]]] = {}  # slot -> (first position, tokens)
            for tok, pos, slot, _ in chunk:
                wrote.setdefault(slot, (pos, []))[1].append(tok)
            if rc != 0:
                for slot in wrote:  # what it left in the KV is unknown: no later request reuses it
                    lib.llama_memory_seq_rm(self.mem, slot, -1, -1)
                    self.cache.forget(slot)
                raise RuntimeError(f"llama_decode returned {rc} for {len(chunk)} tokens")
            for slot, (pos, toks) in wrote.items():
                self.cache.wrote(slot, pos, toks, alone=len(wrote) == 1)
            # by batch index: llama.cpp computes a multi-sequence batch in its own order (equal splits
            # per sequence) and maps each batch position to its output row here
            for i in wanted:
                ptr = ctypes.cast(lib.llama_get_logits_ith(self.ctx, i), ctypes.POINTER(ctypes.c_float))
                row = np.ctypeslib.as_array(ptr, (self.n_vocab,))
                parts.append(torch.from_numpy(row.copy())[None])  # the buffer is reused next decode
        if not parts:
            return torch.zeros(0, self.n_vocab)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def close(self) -> None:
        if self.ctx:
            self.lib.llama_batch_free(self.batch)
            self.lib.llama_free(self.ctx)
            self.lib.llama_model_free(self.model)
            self.ctx = self.model = None


class LlamaCppRunner(SlotRunner[LlamaCppModel]):
    """One sequence's handle on a LlamaCppModel: its slot (the llama.cpp sequence id) and length."""

    def __init__(self, model: LlamaCppModel, slot: int, exact: bool = True):
        super().__init__(model, slot, exact)
        self.prefill_chunk = model.n_batch

    def reuse(self, tokens: list[int], exact: bool, salt: str | None = None, chunk: int | None = None) -> int:
        """Before its first step: move to the slot holding the longest reusable prefix of
        ``tokens`` and keep it; the tokens kept (decoding.prefix). ``exact``: only whole prefill
        pieces of the grid a cold prefill would cut (``chunk`` tokens, None: one piece per
        ``prefill_chunk``), so the KV is the same bits; else the whole common prefix."""
        assert self._length == 0, "a prefix is reused before the sequence's first step"
        unit = piece(chunk, self.m.n_batch)
        self.slot, self._length = self.m.adopt(self.slot, tokens, unit, exact, salt)
        return self._length

    @property
    def max_step_tokens(self) -> int | None:
        """Exact mode: the widest step that still rounds as one-token steps do."""
        return self.m.exact_step if self.exact else None

    def advance(self, n: int) -> int:
        """The position of this sequence's next token, before ``n`` more are appended by the next
        ``forward_batch`` (which runs only these ``n`` of its padded row)."""
        self.m._pending[self.slot] = n
        return super().advance(n)

    def forward(self, tokens: Tokens, logits: bool = True) -> torch.Tensor | None:
        ids = tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long)
        step = self.m.exact_step
        if not (logits and self.exact and ids.shape[0] > step):
            return self.m.forward_rows([self.row(ids, "all" if logits else "none")], self.exact)[0]
        # logits of a long run in exact mode: steps of exact_step (a caller's check, not the engine's way)
        chunks = [ids[s : s + step] for s in range(0, ids.shape[0], step)]
        return torch.cat(
            [t for c in chunks if (t := self.m.forward_rows([self.row(c)], True)[0]) is not None]
        )

    def crop(self, length: int) -> None:
        if length < self._length:  # llama.cpp attends to whatever its cache holds: forget the rest
            self.m.cut(self.slot, length)
        super().crop(length)


def piece(chunk: int | None, n_batch: int) -> int | None:
    """The width of the pieces a prompt is decoded in, at positions on a multiple of it: the
    engine's chunks, each split by ``_decode`` at ``n_batch`` tokens (None: a grid of no one width)."""
    c = chunk or n_batch
    if c <= n_batch:
        return c
    return n_batch if c % n_batch == 0 else None


class _Weight:
    def __init__(self, rows: int, cols: int):
        self.weight = torch.empty(rows, cols, device="meta")  # a shape, no memory


class GGUFInfo:
    """The parts of a transformers model the engine and loader read (device, config, vocabulary,
    parameter count), for a model whose weights live in llama.cpp."""

    def __init__(self, llama: LlamaCppModel, config: Any, generation_config: Any = None):
        self.llama = llama
        self.config = config
        self.generation_config = generation_config
        self.device = llama.device
        self.dtype = torch.float32  # what the logits are
        self._out = _Weight(llama.n_vocab, llama.n_embd)

    def parameters(self) -> Iterator[torch.Tensor]:
        yield torch.empty(self.llama.n_params, device="meta")

    def get_output_embeddings(self) -> _Weight:
        return self._out


def _check_amx(path: str) -> None:
    """The child of ``amx_works``: a prompt and a verification-sized step with the AMX kernels on;
    a crash is its exit status."""
    llama = LlamaCppModel(Path(path), 256, 1, amx_checked=True)
    runner = llama.runner()
    runner.forward(list(range(100, 140)), logits=False)
    runner.forward(list(range(200, 209)))
    llama.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--amx-check"] and len(sys.argv) == 3:
        _check_amx(sys.argv[2])
    else:
        raise SystemExit("usage: python -m decoding.llamacpp --amx-check GGUF")
