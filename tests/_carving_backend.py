"""A test backend that takes its scratch as a real backend must (issue 15 item 2): a float region from
``meta.workspace`` and a work table from ``meta.int_workspace``, carved with ``WorkspaceLayout``; the
arithmetic is the reference backend's.  Its sizes are set per test; it records every batch it planned."""

import torch

from attncore.core.backend import Backend
from attncore.core.capabilities import Capabilities
from attncore.core.problem import OPS
from attncore.core.workspace import WorkspaceLayout
from attncore.reference.backend import ReferenceBackend

FEATURES = frozenset({"window", "soft_cap", "alibi", "rope", "sinks", "fp8_scales", "return_lse", "cuda_graph"})
DTYPES = frozenset({torch.float16, torch.float32})


class CarvingBackend(Backend):
    name = "carving_test"
    capabilities = (Capabilities(ops=frozenset(OPS) - {"pod", "batch_pod"}, q_dtypes=DTYPES, kv_dtypes=DTYPES,
                                 features=FEATURES),)

    def __init__(self, float_bytes: int = 4096, int_entries_per_req: int = 4) -> None:
        self.float_bytes = float_bytes
        self.int_entries_per_req = int_entries_per_req
        self.compute = True  # False: run() only checks its table (no reference arithmetic, no allocation)
        self.metas = []
        self.carved = []
        self._ref = ReferenceBackend()

    def plan(self, problem, meta):
        f = WorkspaceLayout(self.name)
        f.add("partials", (self.float_bytes // 4,), torch.float32)
        i = WorkspaceLayout(self.name)
        i.add("work", (meta.batch_size, self.int_entries_per_req), torch.int32)
        fv = f.carve(meta.workspace, "float_workspace_buffer", device=meta.device)
        iv = i.carve(meta.int_workspace, "int_workspace_buffer", device=meta.device)
        iv["work"].fill_(meta.batch_size)  # a plan-scoped table run() reads
        self.metas.append(meta)
        self.carved.append((fv["partials"], iv["work"]))
        return (self._ref.plan(problem, meta) if self.compute else None, iv["work"], meta.batch_size)

    def run(self, plan, args) -> None:
        ref_plan, work, b = plan
        if work.numel() and int(work[0, 0]) != b:
            raise AssertionError("the plan's work table was overwritten")
        if ref_plan is not None:
            self._ref.run(ref_plan, args)


class NoopBackend(Backend):
    """run() does nothing: what remains of a call's time is attncore's own host overhead."""

    name = "noop_test"
    capabilities = (Capabilities(ops=frozenset(OPS), q_dtypes=DTYPES, kv_dtypes=DTYPES, features=FEATURES),)

    def plan(self, problem, meta):
        return meta

    def run(self, plan, args) -> None:
        pass
