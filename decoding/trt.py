"""TensorRT backend for the draft model (the ``tensorrt`` extra: ``pip install 'specgate[tensorrt]'``).

The draft's 1-token step dominates speculation's overhead, so it is the step worth handing to
TensorRT. The static-cache forward (``decoding.static``) is compiled by Torch-TensorRT's dynamo
front end for each step shape; the KV cache stays a torch buffer the engine shares with the graph.

Not run on this project's machines: TensorRT's wheels do not fit the GPU machine's transfer limit,
so this backend is untested here (docs/benchmarks.md says so). The CUDA-graph and compiled backends
(``backend: cuda_graphs`` / ``compile``) are what was measured.
"""

from __future__ import annotations

from typing import Any

from decoding.errors import ModelLoadError


def _require_tensorrt() -> Any:
    try:
        import tensorrt  # noqa: F401
        import torch_tensorrt
    except ImportError as exc:
        raise ModelLoadError(
            "backend 'tensorrt' needs the optional TensorRT packages: install them with "
            "`pip install 'specgate[tensorrt]'` (or choose backend 'cuda_graphs', which needs nothing extra)"
        ) from exc
    return torch_tensorrt


def tensorrt_runner_factory(model: Any, max_context: int, slots: int) -> Any:
    torch_tensorrt = _require_tensorrt()
    import torch

    from decoding.layers import TORCH_OPS
    from decoding.static import StaticModel

    if model.device.type != "cuda":
        raise ModelLoadError(f"backend 'tensorrt' needs a CUDA device, not {model.device}")
    static = StaticModel(model, max_len=max_context, slots=slots, graphs=False)
    # torch's matmuls for TensorRT to compile, not the split-K Triton op (decoding.invariant.split_k_ops),
    # which it would leave to PyTorch as an island between engines (never run here: no TensorRT)
    static.ops = TORCH_OPS
    eager_step = static.step_one

    compiled: dict[int, object] = {}

    def trt_step(slot: int, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # one engine per step length; the cache tensors are captured as graph inputs by reference
        T = int(ids.shape[0])
        if T > 16:  # prefill chunks: not worth an engine each
            return eager_step(slot, ids, pos)
        fn = compiled.get(T)
        if fn is None:
            fn = compiled[T] = torch_tensorrt.compile(
                eager_step,
                ir="dynamo",
                inputs=[slot, ids, pos],
                enabled_precisions={static.dtype},
                min_block_size=1,
            )
        return fn(slot, ids, pos)  # type: ignore[operator]

    static.step_override = trt_step
    return static.runner
