"""``make bench``: every engine benchmark this machine can run, in one process, each writing its own
section of docs/benchmarks.md (and its plot).

  - on a CUDA machine: the GPU fast path and speculation at controlled acceptance (``bench.gpu``),
    then the batched engine at N = 1..64 concurrent requests against transformers' static batched
    generate (``bench.gpu_batch``, rendered with its plot), real architectures at real sizes with
    random weights;
  - wherever the real pair is in the model store (``make models`` pulls it): the CPU engine benchmark
    on the real pair (``bench.cpu_engine``) the draft-confidence sweep (``bench.cpu_confidence``) and the batched engine
    (``bench.cpu_batch``);
    with the llamacpp extra installed, specgate on llama.cpp against llama.cpp's own server
    (``bench.cpu_llamacpp``) and prefix caching across a multi-turn agent conversation
    (``bench.cpu_prefix``).

    python -m bench [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

from decoding import store


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="GPU: fewer tokens, k values and N")
    args = ap.parse_args()
    ran = []
    from bench import stall  # the tiny model: every machine

    stall.main([])
    ran.append("stall")
    if torch.cuda.is_available():
        from bench import gpu

        gpu.main(["--quick"] if args.quick else [])
        ran.append("gpu")
        from bench.report_gpu_batch import render

        # a process of its own: in this one bench.gpu's models still hold device memory, and the
        # compiled layers' recompilations for a second set of shapes would count against dynamo's
        # recompile limit, past which it runs them eagerly
        out = "bench/results_gpu_batch.json"
        quick = ["--quick"] if args.quick else []
        subprocess.run([sys.executable, "-m", "bench.gpu_batch", "--out", out, *quick], check=True)
        render(out)
        ran.append("gpu-batch")
    if all(store.is_cached(a) for a in ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")):
        from bench import cpu_engine

        cpu_engine.main([])
        ran.append("cpu-engine")
        from bench import cpu_confidence

        cpu_confidence.main([])
        ran.append("cpu-draft-confidence")
        from bench import cpu_batch

        cpu_batch.main([])
        ran.append("cpu-batch")
        from decoding import llamacpp

        if llamacpp.available():
            from bench import cpu_llamacpp

            cpu_llamacpp.main([])
            ran.append("cpu-llamacpp")
            from bench import cpu_prefix

            cpu_prefix.main([])
            ran.append("cpu-prefix")
        else:
            print(f"llama-cpp-python not installed ({llamacpp.EXTRA_HINT}): llama.cpp benchmark skipped")
    else:
        print("real pair not in the model store (`make models`): CPU engine benchmark skipped")
    if not ran:
        raise SystemExit("nothing to benchmark here")
    print(f"wrote docs/benchmarks.md sections: {', '.join(ran)}")


if __name__ == "__main__":
    main()
