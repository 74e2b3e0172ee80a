"""Whether a probe runs under torch.compile, in one Python call: `traced() or flags._is_compiling_flag`.

Every probe asks this first, so that Dynamo, tracing a probe inside a compiled region, folds it
to True and traces only the original call (no graph break, no guard). `torch.compiler.is_compiling()`
costs two Python calls (it asks `torch.jit.is_scripting()` first), at every phase of every step.
The probes write the check out as `traced() or flags._is_compiling_flag`:

- `traced` is `torch.compiler.is_dynamo_compiling`, a function that returns False and that
  Dynamo folds to True, so under Dynamo the `or` never reads the flag (Dynamo would guard on a
  module attribute it read, and the compiled code would fail that guard when it runs).
- `flags._is_compiling_flag` is what `is_compiling()` returns outside Dynamo: True during a
  compile session's other tracing and during `torch.export`.

Releases without those names get `is_compiling` itself and a False flag.
"""

from __future__ import annotations

import types

import torch.compiler

__all__ = ["flags", "traced"]

traced = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)
flags = (torch.compiler if hasattr(torch.compiler, "_is_compiling_flag")
         else types.SimpleNamespace(_is_compiling_flag=False))
