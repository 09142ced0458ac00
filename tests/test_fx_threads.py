"""torch.fx's tracing patches act only in the tracing thread (`compat.fx_patches_per_thread`): every
torch.compile traces through `torch.fx.Tracer.trace`, which replaces `torch.nn.Module.__call__` and
`__getattr__` on the class for the trace's duration, so a module called in another thread meanwhile went to the
tracer ("NameError: module is not installed as a submodule": an engine's eager prefill while another engine
compiled its decode step, 2 x H200, 2026-11-29). Deterministic: the trace is held open while another thread
calls its own module."""

from __future__ import annotations

import threading

import torch
import torch.fx

from thinkcraft.llm import compat


class _Held(torch.nn.Module):
    """A module whose traced forward has another thread call a module of its own while the trace's patches are in
    place, and records what that call returned (or raised)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(4, 4)
        self.seen: list[object] = []

    def forward(self, x):  # noqa: ANN001, ANN201
        def call_elsewhere() -> None:
            try:
                probe = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.ReLU())
                self.seen.append(probe(torch.ones(1, 3)).shape)  # __call__ and __getattr__ of a foreign module
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                self.seen.append(e)

        t = threading.Thread(target=call_elsewhere)
        t.start()
        t.join()
        return self.inner(x)


def test_a_module_called_in_another_thread_during_a_trace_is_not_traced() -> None:
    compat.fx_patches_per_thread()
    held = _Held()
    graph = torch.fx.symbolic_trace(held)
    assert held.seen == [torch.Size([1, 3])], held.seen  # before: NameError from the tracer
    # the tracing thread's own module calls are still traced as modules
    assert [n.target for n in graph.graph.nodes if n.op == "call_module"] == ["inner"]
    # and the class has its methods back once the trace ended
    from torch.fx import _symbolic_trace as st

    assert torch.nn.Module.__call__ is st._orig_module_call
    assert torch.nn.Module.__getattr__ is st._orig_module_getattr


def test_nested_and_repeated_traces_keep_their_patches() -> None:
    """A trace inside a trace (torch's deduplicate=False), then one after it: both record their modules."""
    compat.fx_patches_per_thread()

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(2, 2)

        def forward(self, x):  # noqa: ANN001, ANN201
            inner = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(2, 2)))
            assert [n.op for n in inner.graph.nodes].count("call_module") == 1
            return self.a(x)

    g = torch.fx.symbolic_trace(Outer())
    assert [n.target for n in g.graph.nodes if n.op == "call_module"] == ["a"]
    again = torch.fx.symbolic_trace(Outer())
    assert [n.target for n in again.graph.nodes if n.op == "call_module"] == ["a"]
