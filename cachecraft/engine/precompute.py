"""The one precompute: compute a request's chunks in full in their own context (one prefill,
nothing reused, no answer), as the server's POST /v1/chunks and `LLM.precompute` / `LLM.warm`
both do. What happens to the new variants (offered, committed, pinned) is the caller's."""

from __future__ import annotations

from cachecraft.engine.runner import PrefillOutcome, Runner
from cachecraft.request import RagRequest
from cachecraft.reuse.cachecraft import CachecraftStrategy
from cachecraft.reuse.layout import PromptLayout


def prefill_in_full(
    runner: Runner, request: RagRequest, layout: PromptLayout | None = None
) -> PrefillOutcome:
    """One full prefill of `request` (`layout`: its tokens, if already made). Runs the model:
    call it on the engine's step thread (`Engine.call`) or with the engine held (an `LLM`'s
    lock), never beside a step."""
    plan = runner.plan(request, CachecraftStrategy(), lookup=False, layout=layout)
    job = runner.start(plan, precompute=True)
    return runner.finish(job, runner.loaded.model.forward_step([job.work])[0])
