"""The benchmark harness behind ``hybridspec bench``.

Module map, in data-flow order:

- ``workload``: categories of chat prompts from a JSON file (``DEFAULT_WORKLOAD``, package
  data in ``workloads/``), input-grounded or open-ended.
- ``session``: loads the target once, builds the engine and the methods, runs everything.
- ``methods``: the engine's proposers and the baselines behind one protocol;
  ``hf_baseline``: ``LlamaForCausalLM`` on our own weights, and the greedy parity check;
  ``llamacpp_baseline``: llama-cpp-python on the target's GGUF, plain and prompt lookup;
  ``timing``: the timers around the target forward.
- ``harness``: the interleaved schedule, the warm-up, the trials -> ``records``.
- ``summary``: records -> cells (tokens/s, speedups, acceptance, overhead);
  ``targets``: pass/fail against the runtime's performance targets.
- ``report``: the terminal table, the JSON document, the PNG chart; ``cli``: the command.
- ``served`` (``--served``): the same trials through a ``hybridspec serve`` that the session
  starts (``servers``), each request streamed and read by ``sse``.
- ``hybridspec bench serve`` (``serve_cli``): ``servers`` starts hybridspec and llama.cpp's
  servers as processes on free ports; ``loadgen`` runs guidellm against each and reads its
  report; ``serving_report`` makes the tables, the ratios to each peer and the chart.

Glossary: a *trial* runs one method on one prompt (or, for ``--concurrency N``, every prompt
with N in the engine at a time); a *group* is a category or a union of categories (or the
concurrent trials); *outside-forward share* is the part of a request's wall time not spent in
the target model's forward.

The experiments in ``benchmarks/experiments/`` use only the names in ``__all__``: the harness's
entry points, ``servers``' helpers that start a server as a process
on a free loopback port (``ServerSpec``, ``running``, ``free_port``, ``wait_ready``, ``stop``),
and the busy processes of ``--busy N`` (``busy_processes``).

Names are imported on first use (``hybridspec.lazy``), so that ``hybridspec serve`` does not pay
for the bench's transformers baselines when the command line registers ``bench``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridspec.lazy import lazy_exports

if TYPE_CHECKING:
    from hybridspec.bench.busy import busy_processes
    from hybridspec.bench.harness import BenchConfig
    from hybridspec.bench.servers import ServerSpec, free_port, running, stop, wait_ready
    from hybridspec.bench.session import ModelOptions, execute, open_session
    from hybridspec.bench.workload import load_workload

__all__ = [
    "BenchConfig",
    "ModelOptions",
    "ServerSpec",
    "busy_processes",
    "execute",
    "free_port",
    "load_workload",
    "open_session",
    "running",
    "stop",
    "wait_ready",
]

__getattr__, __dir__ = lazy_exports(
    __name__,
    globals(),
    {
        "hybridspec.bench.busy": ("busy_processes",),
        "hybridspec.bench.harness": ("BenchConfig",),
        "hybridspec.bench.servers": (
            "ServerSpec",
            "free_port",
            "running",
            "stop",
            "wait_ready",
        ),
        "hybridspec.bench.session": ("ModelOptions", "execute", "open_session"),
        "hybridspec.bench.workload": ("load_workload",),
    },
)
